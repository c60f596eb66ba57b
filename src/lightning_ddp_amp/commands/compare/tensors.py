"""What compare keeps of a run's tensors: fingerprints of its starting weights and first batch, equal only for
bit-identical tensors; its weights as fp32 files on the CPU; and the noise floor's perturbation, one ulp up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def one_ulp_up(pl_module: Any) -> None:
    """Every floating weight one unit in the last place up: a change no precision question depends on."""
    with torch.no_grad():
        for parameter in pl_module.parameters():
            if parameter.is_floating_point():
                parameter.copy_(torch.nextafter(parameter, torch.full_like(parameter, math.inf)))


def _tensors(data: Any) -> Iterator[Tensor]:
    """Every tensor in a batch, in order (tensors, mappings, sequences, dataclasses)."""
    if isinstance(data, Tensor):
        yield data
    elif isinstance(data, Mapping):  # dict, and UserDict-based batches (Hugging Face's BatchEncoding)
        for key in sorted(data, key=str):
            yield from _tensors(data[key])
    elif isinstance(data, (list, tuple)):
        for item in data:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(data) and not isinstance(data, type):
        for field in dataclasses.fields(data):
            yield from _tensors(getattr(data, field.name))


def hash_batch(batch: Any) -> str:
    """The fingerprint of every tensor in a batch, in order."""
    return hash_tensors(dict(enumerate(_tensors(batch))))


def hash_tensors(tensors: dict[Any, Tensor]) -> str:
    """SHA-256 of names, dtypes, shapes and bytes, so equal only for bit-identical tensors."""
    digest = hashlib.sha256()
    for name, tensor in tensors.items():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fp32(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The floating tensors of a state, as fp32 on the CPU: what the weight files hold and distances compare."""
    return {name: t.detach().float().cpu() for name, t in state.items() if torch.is_floating_point(t)}


def save_fp32(state: dict[str, Tensor], path: Path) -> None:
    """Write the state's :func:`fp32` copy: a weights file of compare's run folders."""
    torch.save(fp32(state), path)
