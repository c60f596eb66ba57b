"""Real GPUs: NCCL, device pinning, and the recipe on CUDA. Skipped where no GPU is visible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, Torchrun, check, finish, free_port, max_abs_difference, worker_env

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")


def report(out: Path, rank: int) -> dict[str, object]:
    return json.loads((out / f"rank{rank}.json").read_text())


def test_single_process_trains_on_cuda_0(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(WORKERS / "train_envddp.py"),
            "--out",
            str(tmp_path),
            "--batch-size",
            "4",
            "--accelerator",
            "cuda",
            "--epochs",
            "1",
        ],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert report(tmp_path, 0)["device"] == "cuda:0"


@two_gpus
def test_nccl_ranks_pin_their_gpus_and_match_the_recipe(torchrun: Torchrun, tmp_path: Path) -> None:
    recipe, envddp = tmp_path / "recipe", tmp_path / "envddp"
    recipe.mkdir()
    envddp.mkdir()
    check(torchrun.run("train_recipe.py", "--out", str(recipe), "--batch-size", "4", "--cuda", timeout=300))
    check(
        torchrun.run("train_envddp.py", "--out", str(envddp), "--batch-size", "4", "--accelerator", "cuda", timeout=300)
    )
    for rank in (0, 1):
        assert report(envddp, rank)["device"] == f"cuda:{rank}"
        assert report(envddp, rank)["backend"] == "nccl"
        assert report(envddp, rank)["ddp"] == {"device_ids": [rank], "output_device": rank}
    weights = [torch.load(path / "weights.pt") for path in (recipe, envddp)]
    assert max_abs_difference(*weights) <= 1e-5


@two_gpus
def test_one_visible_gpu_per_process_uses_cuda_0(tmp_path: Path) -> None:
    # What a scheduler does: each process sees only its own GPU through CUDA_VISIBLE_DEVICES.
    port = str(free_port())
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKERS / "train_envddp.py"),
                "--out",
                str(tmp_path),
                "--batch-size",
                "4",
                "--accelerator",
                "cuda",
                "--epochs",
                "1",
            ],
            env=worker_env(
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "CUDA_VISIBLE_DEVICES": str(rank),
                }
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    for process in processes:
        check(finish(process, timeout=300))
    assert [report(tmp_path, rank)["device"] for rank in (0, 1)] == ["cuda:0", "cuda:0"]
