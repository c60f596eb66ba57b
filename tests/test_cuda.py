"""Real GPUs: NCCL, device pinning, and the recipe on CUDA. Skipped where no GPU is visible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    WORKERS,
    Torchrun,
    check,
    finish,
    free_port,
    launcher_variables,
    max_abs_difference,
    start_python,
    worker_env,
)

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
            "--devices",
            "1",  # "auto" would start one rank per GPU (test_auto_devices_start_one_rank_per_gpu)
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
def test_auto_devices_start_one_rank_per_gpu(tmp_path: Path) -> None:
    # `python train.py` on a machine with several GPUs: envddp starts one rank per GPU itself, on NCCL.
    command = (str(WORKERS / "train_envddp.py"), "--out", str(tmp_path), "--batch-size", "4")
    check(finish(start_python(*command, "--accelerator", "cuda", "--epochs", "1"), timeout=300))
    for rank in range(GPUS):
        assert (report(tmp_path, rank)["device"], report(tmp_path, rank)["backend"]) == (f"cuda:{rank}", "nccl")
        assert report(tmp_path, rank)["launcher"] == "self-launch"


def test_doctor_reports_the_gpus_cuda_and_nccl() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ddp_amp", "env", "--json"],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(result.stdout)
    assert data["devices"]["cuda_device_count"] == GPUS
    assert data["devices"]["this_rank_device"] == "cuda:0"
    assert data["versions"]["torch_cuda"] == torch.version.cuda
    assert data["versions"]["nccl"] is not None
    assert data["backends"]["default"] == "nccl"
    assert data["launcher"]["decision"].startswith("self-launch" if GPUS > 1 else "single process")


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
    port = free_port()
    command = (str(WORKERS / "train_envddp.py"), "--out", str(tmp_path), "--batch-size", "4")
    processes = [
        start_python(
            *command,
            *("--accelerator", "cuda", "--epochs", "1"),
            env={**launcher_variables(rank, port), "CUDA_VISIBLE_DEVICES": str(rank)},
        )
        for rank in (0, 1)
    ]
    for process in processes:
        check(finish(process, timeout=300))
    assert [report(tmp_path, rank)["device"] for rank in (0, 1)] == ["cuda:0", "cuda:0"]


def _real_apex() -> bool:
    try:
        import apex
        import apex.amp
    except ImportError:
        return False
    return not getattr(apex, "IS_TEST_DOUBLE", False)


real_apex = pytest.mark.skipif(not _real_apex(), reason="needs real NVIDIA apex with apex.amp")


def _train_amp(out: Path, *args: str, nproc: int = 1, torchrun: Torchrun | None = None) -> list[dict[str, object]]:
    out.mkdir()
    command = ("train_amp.py", "--out", str(out), "--accelerator", "cuda", *args)
    if torchrun is not None:
        check(torchrun.run(*command, nproc=nproc, timeout=300))
    else:
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        result = subprocess.run(
            [sys.executable, str(WORKERS / command[0]), *command[1:]],
            env=worker_env(env),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.parametrize(("precision", "dtype"), [("amp-O1", "torch.float16"), ("bf16-mixed", "torch.bfloat16")])
def test_native_amp_on_cuda(tmp_path: Path, precision: str, dtype: str) -> None:
    (report,) = _train_amp(tmp_path / "run", "--precision", precision)
    assert report["hidden_dtypes"] == [dtype]


@pytest.mark.apex
@real_apex
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_real_apex_trains_and_checkpoints_its_state(tmp_path: Path, level: str) -> None:
    (report,) = _train_amp(tmp_path / "run", "--precision", f"apex-{level}", "--checkpoint")
    assert report["precision_state"]["backend"] == "apex"
    # Real fp16 overflows only while the dynamic scale settles: a frozen schedule would show here.
    assert report["skipped"] <= 3
    assert report["scheduler_steps"] == report["global_step"] - report["skipped"]
    saved = torch.load(tmp_path / "run" / "last.ckpt", weights_only=False)["AmpPrecision"]
    assert saved == report["precision_state"]


@pytest.mark.apex
@real_apex
@two_gpus
def test_real_apex_under_envddp_on_two_gpus(torchrun: Torchrun, tmp_path: Path) -> None:
    reports = _train_amp(tmp_path / "run", "--precision", "apex-O1", "--ddp-impl", "apex", nproc=2, torchrun=torchrun)
    assert all(str(r["wrapper"]).startswith("apex.parallel") for r in reports)
