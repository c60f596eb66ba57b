"""Which device each local rank trains on.

The classic recipe pins ``cuda:LOCAL_RANK``. When a scheduler narrows CUDA_VISIBLE_DEVICES so that each process
sees exactly one GPU, that GPU is ``cuda:0`` for every rank. This module makes that choice in one pure function,
so it is tested without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from lightning_ddp_amp.errors import LauncherEnvironmentError
from lightning_ddp_amp.launch.topology import Topology


def select_devices(
    device_type: str,
    topology: Topology,
    visible_cuda_devices: int,
    requested: Sequence[int] | None = None,
) -> list[torch.device]:
    """The device of every local rank on this node, indexed by local rank.

    Args:
        device_type: ``"cuda"``, ``"cpu"``, or another torch device type (used as is, no index).
        topology: The launcher's topology.
        visible_cuda_devices: ``torch.cuda.device_count()`` in this process.
        requested: CUDA indices the user listed in ``Trainer(devices=[...])``, one per local rank, or None.

    Raises:
        LauncherEnvironmentError: LOCAL_RANK names a GPU this process cannot see.
    """
    local_world_size = topology.local_world_size
    if device_type != "cuda":
        return [torch.device(device_type)] * local_world_size
    if requested is not None:
        indices = list(requested)
    elif visible_cuda_devices == 1:
        indices = [0] * local_world_size
    else:
        indices = list(range(local_world_size))
    mine = indices[topology.local_rank]
    if mine >= visible_cuda_devices:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise LauncherEnvironmentError(
            "LOCAL_RANK",
            str(topology.local_rank),
            f"it selects cuda:{mine} but this process sees {visible_cuda_devices} CUDA device(s)"
            f" (CUDA_VISIBLE_DEVICES={visible})",
            "start at most one process per visible GPU (`torchrun --nproc-per-node` ≤ GPUs), or widen"
            " CUDA_VISIBLE_DEVICES",
        )
    return [torch.device("cuda", index) for index in indices]
