"""Model, data and hyper-parameters shared by the plain recipe and the Lightning workers."""

import contextlib
import itertools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TRAIN_SIZE = 64
VAL_SIZE = 37  # not a multiple of any world size the tests use: DistributedSampler must pad it
VAL_BATCH = 8
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


def gather_predictions(predictions: dict[int, torch.Tensor]) -> torch.Tensor:
    """Every rank's predictions by validation sample index, gathered, in index order (padding duplicates agree)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, predictions)
    merged = {index: value for part in gathered for index, value in part.items()}
    return torch.stack([merged[index] for index in range(VAL_SIZE)])


def evaluate_by_hand(
    modules: list[torch.nn.Module],
    predict: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    context: Callable[[], Any] = contextlib.nullcontext,
) -> torch.Tensor:
    """The recipe's evaluation after training: rank 0's weights and buffers on every rank, eval mode, no grad, the
    validation set in batches of VAL_BATCH through an unshuffled DistributedSampler; the gathered predictions."""
    for module in modules:
        # Not state_dict(): under apex O2/O3 it holds fp32 copies of the fp16 tensors.
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(tensor.detach(), src=0)
        module.eval()
    dataset = val_set()
    loader = DataLoader(dataset, batch_size=VAL_BATCH, sampler=DistributedSampler(dataset, shuffle=False))
    predictions: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for x, _, index in loader:
            with context():
                output = predict(x.to(device)).float().cpu()
            predictions.update(zip(index.tolist(), output, strict=True))
    return gather_predictions(predictions)
