# Generated from ../../commands/env.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""`the env report`: what this process would train with, and what stands in the way.

The report covers the launcher and topology this rank reads, its devices, the versions of torch, Lightning, CUDA,
cuDNN and NCCL, the process-group backends, and NVIDIA apex: whether it is installed at all, whether it is the
impostor from PyPI, whether ``apex.amp`` is still there, and whether its compiled extensions load with this torch.
Each problem comes with its fix in one line.

It starts no process group and writes nothing, so it is safe on any rank of a running job and on a machine without
a GPU. apex's compiled extensions are loaded in a child process: one built for another torch can crash the
interpreter that imports it (the segmentation fault users meet in ``scaled_loss.backward()``).
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import platform
import socket
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.amp import native_backend
from lightning_ddp_amp.amp.apex_loader import APEX_INSTALL, NATIVE_ALTERNATIVES, installation
from lightning_ddp_amp.errors import LightningDDPAmpError
from lightning_ddp_amp.launch import process_group
from lightning_ddp_amp.launch.devices import select_devices
from lightning_ddp_amp.launch.environment import (
    LAUNCHER_VARIABLES,
    MPIRUN_VARIABLES,
    SLURM_NODELISTS,
    SLURM_TASKS_PER_NODE,
    SRUN_VARIABLES,
    Topology,
    detect_launcher,
    other_launcher,
    read_topology,
    started_by,
)
from lightning_ddp_amp.versions import installed

#: The oldest torch release the package supports (pyproject.toml: torch>=2.1; CI runs 2.1.2, 2.13.0 and the newest).
OLDEST_TORCH = Version("2.1")

#: apex's compiled extensions: what each one is for, as the report says it.
APEX_EXTENSIONS = {
    "amp_C": "fused multi-tensor kernels of apex.amp and apex.optimizers",
    "apex_C": "flatten/unflatten of apex.parallel.DistributedDataParallel",
    "syncbn": "apex.parallel.SyncBatchNorm",
    "fused_layer_norm_cuda": "apex.normalization.FusedLayerNorm",
}
_APEX_TIMEOUT_S = 120

# The environment a launcher leaves, shown as is so that a report can be compared across ranks: every variable
# read_topology reads, and the other launchers' families, so that the report can say why they were ignored.
_SHOWN = (
    *LAUNCHER_VARIABLES,
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "CUDA_VISIBLE_DEVICES",
    *SRUN_VARIABLES,
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
    *SLURM_TASKS_PER_NODE,
    *SLURM_NODELISTS,
)
_SHOWN_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_", "MV2_COMM_WORLD_", "JSM_NAMESPACE_")
#: The widest line of the text report, and the column its facts start in.
WIDTH = 100
LABEL = 13


def report(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Everything the env report knows, as plain JSON-compatible data.

    Args:
        environ: The environment to read; ``os.environ`` when None.
        argv: The training command line to search for ``--local-rank``; none when None (the env report's own
            arguments are not a training script's).

    Returns:
        A dict with the sections ``launcher``, ``devices``, ``versions``, ``backends`` and ``apex``, and
        ``problems``: a list of ``{"problem": ..., "fix": ...}``, empty when nothing stands in the way.
    """
    ...


def _launcher(
    env: Mapping[str, str], argv: list[str], problems: list[dict[str, str]]
) -> tuple[dict[str, Any], Topology | None]:
    ...


def _rendezvous_problems(env: Mapping[str, str], topology: Topology) -> list[dict[str, str]]:
    """The classic multi-node mistakes: rank 0's address on loopback, or its port already taken on its node."""
    ...


def _is_loopback(address: str) -> bool:
    ...


def _port_taken(port: int) -> bool:
    ...


def _decision(topology: Topology, gpus: int) -> str:
    """Who started the ranks, or that envddp would start them, or a single process: what envddp does here."""
    ...


def _ignored_launchers(env: Mapping[str, str], used: str) -> list[str]:
    """Other launchers' variables in this environment, and why they were not read."""
    ...


def _devices(env: Mapping[str, str], topology: Topology | None, problems: list[dict[str, str]]) -> dict[str, Any]:
    ...


def _versions(problems: list[dict[str, str]]) -> dict[str, Any]:
    ...


def _cudnn_version() -> int | None:
    ...


def _nccl_version() -> str | None:
    ...


def _backends(problems: list[dict[str, str]]) -> dict[str, Any]:
    ...


def _apex(problems: list[dict[str, str]]) -> dict[str, Any]:
    ...


def _read(path: Path) -> str:
    ...


def _load_extension(name: str) -> dict[str, str]:
    """Whether apex's compiled module ``name`` loads next to this torch, tried in a child process."""
    ...


def render(data: Mapping[str, Any]) -> str:
    """The report as text for people: a header naming the rank, one fact per label, then the problems with their
    fixes; every line within :data:`WIDTH` columns (only a single word longer than that, such as a path, is not
    broken)."""
    ...


def _whose(launcher: Mapping[str, Any]) -> str:
    """Which rank the report is of, for the header: reports from every rank of a job look alike otherwise."""
    ...


def _fact(label: str, text: str) -> list[str]:
    """One labelled fact, its continuation lines under the text."""
    ...


def _wrap(text: str, indent: str = "") -> list[str]:
    ...


def main(argv: Sequence[str] | None = None) -> int:
    """The ``lightning-ddp-amp`` command. Returns 0 when the report lists no problems, else 1."""
    ...
