"""The versions this process runs with, gathered once for every report: ``env``, ``--version`` and ``compare.json``."""

from __future__ import annotations

import importlib.metadata
import platform

import torch
import torch.distributed as dist
from typing_extensions import TypedDict


class Versions(TypedDict):
    """What a report names this process as running with, each under the key every report uses.

    The packages are their installed distributions' versions (None when not installed), torch the version of the torch
    this interpreter imported; ``torch_cuda``, ``cudnn`` and ``nccl`` are None where this build or machine has none.
    """

    python: str
    platform: str
    lightning_ddp_amp: str | None
    torch: str
    torch_cuda: str | None
    cudnn: int | None
    nccl: str | None
    lightning: str | None
    pytorch_lightning: str | None


def gathered() -> Versions:
    """Every version a report shows, read now (not cached: a test may stand in for any of them)."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "lightning_ddp_amp": installed("lightning_ddp_amp"),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": _cudnn(),
        "nccl": _nccl(),
        "lightning": installed("lightning"),
        "pytorch_lightning": installed("pytorch_lightning"),
    }


def installed(name: str) -> str | None:
    """The installed version of the distribution ``name``, or None when it is not installed.

    Args:
        name: Its name as ``env --json`` and ``compare.json`` key it (``"pytorch_lightning"``, ``"lightning_ddp_amp"``);
            importlib.metadata reads ``-`` and ``_`` alike, so it is also the name pip knows.
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cudnn() -> int | None:
    if not torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
        return None
    version: int | None = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    return version


def _nccl() -> str | None:
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        return None
    return ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
