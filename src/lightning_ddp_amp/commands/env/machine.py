"""The env report's machine sections: the devices this rank would train on, the versions it runs with, and the
process-group backends its torch offers; each with what stands in the way."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.amp import native_backend
from lightning_ddp_amp.commands.env.launcher import problem_of
from lightning_ddp_amp.errors import LightningDDPAmpError
from lightning_ddp_amp.launch import process_group
from lightning_ddp_amp.launch.devices import select_devices
from lightning_ddp_amp.launch.topology import Topology
from lightning_ddp_amp.versions import gathered

#: The oldest torch release the package supports (pyproject.toml: torch>=2.1; CI runs 2.1.2, 2.13.0 and the newest).
OLDEST_TORCH = Version("2.1")


def devices_section(
    env: Mapping[str, str], topology: Topology | None, problems: list[dict[str, str]]
) -> dict[str, Any]:
    """The CPUs and CUDA devices this process sees, and the one this rank would train on."""
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    section: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cuda_available": cuda,
        "cuda_device_count": count,
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "cuda_devices": [
            {
                "index": index,
                "name": torch.cuda.get_device_name(index),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(index))),
            }
            for index in range(count)
        ],
        "bf16_supported": torch.cuda.is_bf16_supported() if cuda else None,
    }
    if topology is not None:
        try:
            device = select_devices("cuda" if cuda else "cpu", topology, count)[topology.local_rank]
        except LightningDDPAmpError as error:
            problems.append(problem_of(error))
        else:
            section["this_rank_device"] = str(device)
    return section


def versions_section(problems: list[dict[str, str]]) -> dict[str, Any]:
    """The versions (:func:`~lightning_ddp_amp.versions.gathered`), what this torch lacks, and a torch or Lightning
    outside the releases the package supports."""
    section: dict[str, Any] = {**gathered()}
    # What this torch lacks, probed, and what the package does without it.
    section["torch_gaps"] = process_group.torch_gaps() + native_backend.torch_gaps()
    if Version(torch.__version__).release < OLDEST_TORCH.release:
        problems.append(
            {
                "problem": f"torch {torch.__version__} is older than the releases lightning-ddp-amp supports",
                "fix": f"pip install 'torch>={OLDEST_TORCH}'",
            }
        )
    low, high = _lightning.TESTED_LIGHTNING
    for name in ("lightning", "pytorch_lightning"):
        found = section[name]
        if found is not None and not low <= Version(found) < high:
            problems.append(
                {
                    "problem": f"{name} {found} is outside the releases lightning-ddp-amp is tested with",
                    "fix": f"pip install '{name.replace('_', '-')}>={low},<{high}'",
                }
            )
    return section


def backends_section(problems: list[dict[str, str]]) -> dict[str, Any]:
    """The process-group backends this torch build offers, and the one envddp would use."""
    if not dist.is_available():
        problems.append(
            {
                "problem": "this torch build has no torch.distributed",
                "fix": "install a torch build with distributed support (every official Linux build has it)",
            }
        )
        return {"distributed": False}
    section: dict[str, Any] = {
        "distributed": True,
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
        "ucc": dist.is_ucc_available(),
        "default": "nccl" if torch.cuda.is_available() else "gloo",
    }
    if torch.cuda.is_available() and not section["nccl"]:
        problems.append(
            {
                "problem": "CUDA is available but this torch build has no NCCL",
                "fix": 'install a torch build with NCCL, or pass EnvDDPStrategy(process_group_backend="gloo")',
            }
        )
    return section
