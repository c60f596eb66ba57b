"""Model, data and hyper-parameters shared by the plain recipe and the Lightning workers."""

import os
from typing import Any

import torch
from torch.utils.data import TensorDataset

TRAIN_SIZE = 64
VAL_SIZE = 37  # not a multiple of any world size the tests use: DistributedSampler must pad it
LR = 0.1
SEED = 0


def build_net() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def dataset(size: int, seed: int) -> TensorDataset:
    """(x, y, index) triples; the index lets workers record which samples each rank saw."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(size, 1, generator=generator)
    return TensorDataset(x, y, torch.arange(size))


def train_set() -> TensorDataset:
    return dataset(TRAIN_SIZE, seed=1)


def val_set() -> TensorDataset:
    return dataset(VAL_SIZE, seed=2)


def save_complete(obj: Any, path: str) -> None:
    """``torch.save`` through a temporary file: once ``path`` exists it is complete (see conftest.run_reference)."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
