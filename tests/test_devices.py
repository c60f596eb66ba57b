"""select_devices: the CUDA pinning rules, checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from lightning_ddp_amp import LauncherEnvironmentError, Topology
from lightning_ddp_amp.launch.devices import select_devices


def topology(local_rank: int, local_world_size: int = 2) -> Topology:
    return Topology(
        rank=local_rank, local_rank=local_rank, world_size=local_world_size, local_world_size=local_world_size
    )


def test_each_local_rank_gets_the_gpu_with_its_index() -> None:
    devices = select_devices("cuda", topology(1), visible_cuda_devices=2)
    assert devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert devices[1] == torch.device("cuda", 1)


def test_one_visible_gpu_per_process_means_cuda_0_for_every_rank() -> None:
    # A scheduler narrowed CUDA_VISIBLE_DEVICES to this process's GPU.
    devices = select_devices("cuda", topology(1), visible_cuda_devices=1)
    assert devices[1] == torch.device("cuda", 0)


def test_an_explicit_list_of_gpus_maps_local_ranks() -> None:
    devices = select_devices("cuda", topology(1), visible_cuda_devices=4, requested=[2, 3])
    assert devices[1] == torch.device("cuda", 3)


def test_local_rank_beyond_the_visible_gpus_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(LauncherEnvironmentError, match=r"^LOCAL_RANK='2': it selects cuda:2 but this process sees 2"):
        select_devices("cuda", topology(2, local_world_size=4), visible_cuda_devices=2)


def test_cpu_ranks_all_use_the_cpu() -> None:
    assert select_devices("cpu", topology(1), visible_cuda_devices=0) == [torch.device("cpu")] * 2
