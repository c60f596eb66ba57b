"""AmpPrecision on real ranks (torchrun, gloo): apex through its CPU test double, and native AMP on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Torchrun, check, max_abs_difference

pytestmark = pytest.mark.multiprocess


def train(torchrun: Torchrun, out: Path, *args: str, apex_double: bool = False) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    check(torchrun.run("train_amp.py", "--out", str(out), *args, apex_double=apex_double))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "weights.pt")


def events(report: dict[str, Any], kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in report["events"] if kind is None or e["event"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("amp")


@pytest.fixture(scope="module")
def fp32(torchrun: Torchrun, runs: Path) -> list[dict[str, Any]]:
    return train(torchrun, runs / "fp32", "--precision", "32-true")


@pytest.fixture(scope="module")
def apex_o1(torchrun: Torchrun, runs: Path) -> list[dict[str, Any]]:
    return train(torchrun, runs / "apex-O1", "--precision", "apex-O1", apex_double=True)


@pytest.fixture(scope="module")
def apex_o2_apex_ddp(torchrun: Torchrun, runs: Path) -> list[dict[str, Any]]:
    return train(torchrun, runs / "apex-O2", "--precision", "apex-O2", "--ddp-impl", "apex", apex_double=True)


def test_apex_o1_ends_with_the_fp32_weights(fp32: Any, apex_o1: Any, runs: Path) -> None:
    # The double casts nothing and scales by powers of two, so only a wrong order or a lost step could differ.
    assert max_abs_difference(weights(runs / "fp32"), weights(runs / "apex-O1")) <= 1e-6


def test_apex_o2_with_apex_ddp_ends_with_the_fp32_weights(fp32: Any, apex_o2_apex_ddp: Any, runs: Path) -> None:
    assert max_abs_difference(weights(runs / "fp32"), weights(runs / "apex-O2")) <= 1e-6
    assert {r["wrapper"] for r in apex_o2_apex_ddp} == {"apex.parallel.DistributedDataParallel"}
    for report in apex_o2_apex_ddp:
        kinds = [e["event"] for e in events(report)]
        assert kinds.index("initialize") < kinds.index("ddp_wrap") < kinds.index("scale_loss")


def test_initialize_sees_both_sub_models_and_the_optimizer_before_the_ddp_wrap(apex_o1: Any) -> None:
    for report in apex_o1:
        assert report["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel"
        (initialize,) = events(report, "initialize")
        assert (initialize["models"], initialize["optimizers"]) == (["Sequential", "Linear"], ["SGD"])
        kinds = [e["event"] for e in events(report)]
        assert kinds[0] == "initialize"
        assert kinds.index("ddp_wrap") < kinds.index("scale_loss")
        assert events(report, "ddp_wrap") == [{"event": "ddp_wrap", "model": "TwoModels"}]


def test_every_backward_runs_inside_scale_loss(apex_o1: Any, apex_o2_apex_ddp: Any) -> None:
    for report in [*apex_o1, *apex_o2_apex_ddp]:
        assert report["backward_outside_scale_loss"] == 0
        assert len(events(report, "scale_loss")) == report["global_step"] == 16


@pytest.fixture(scope="module")
def apex_interrupted(torchrun: Torchrun, runs: Path) -> list[dict[str, Any]]:
    """One epoch of apex-O1 with an overflow at step 3, checkpointed at the end."""
    out = runs / "apex-interrupted"
    return train(
        torchrun,
        out,
        "--precision",
        "apex-O1",
        "--epochs",
        "1",
        "--overflow-at-step",
        "3",
        "--checkpoint",
        apex_double=True,
    )


@pytest.fixture(scope="module")
def apex_resumed(torchrun: Torchrun, runs: Path, apex_interrupted: Any) -> list[dict[str, Any]]:
    """A new pair of processes resuming from that checkpoint for a second epoch."""
    checkpoint = str(runs / "apex-interrupted" / "last.ckpt")
    return train(torchrun, runs / "apex-resumed", "--precision", "apex-O1", "--resume", checkpoint, apex_double=True)


def test_an_apex_overflow_skips_the_step_and_holds_the_schedule(apex_interrupted: Any) -> None:
    for report in apex_interrupted:
        assert len(events(report, "skipped_step")) == 1
        assert report["skipped"] == 1
        assert (report["global_step"], report["scheduler_steps"]) == (8, 7)
        assert report["precision_state"]["loss_scalers"] == [{"loss_scale": 32768.0, "unskipped": 4}]


def test_resume_restores_the_amp_state_after_initialize(apex_interrupted: Any, apex_resumed: Any, runs: Path) -> None:
    saved = torch.load(runs / "apex-interrupted" / "last.ckpt", weights_only=False)["AmpPrecision"]
    assert saved == apex_interrupted[0]["precision_state"]
    for report in apex_resumed:
        assert report["at_start"] == {"precision_state": saved, "global_step": 8}
        kinds = [e["event"] for e in events(report)]
        assert kinds.index("initialize") < kinds.index("load_state_dict") < kinds.index("scale_loss")


@pytest.fixture(scope="module")
def native_interrupted(torchrun: Torchrun, runs: Path) -> list[dict[str, Any]]:
    out = runs / "native-interrupted"
    return train(torchrun, out, "--precision", "plugin", "--epochs", "1", "--overflow-at-step", "3", "--checkpoint")


@pytest.fixture(scope="module")
def native_resumed(torchrun: Torchrun, runs: Path, native_interrupted: Any) -> list[dict[str, Any]]:
    checkpoint = str(runs / "native-interrupted" / "last.ckpt")
    return train(torchrun, runs / "native-resumed", "--precision", "plugin", "--resume", checkpoint)


def test_native_fp16_trains_in_half_precision_on_two_cpu_ranks(native_interrupted: Any) -> None:
    for report in native_interrupted:
        assert report["hidden_dtypes"] == ["torch.float16"]
        assert report["precision"] == "16-mixed"
        # The injected overflow, and any fp16 overflow while the scaler settles: skipped steps do not schedule.
        assert report["skipped"] >= 1
        assert report["scheduler_steps"] == report["global_step"] - report["skipped"] == 8 - report["skipped"]


def test_resume_restores_the_native_scaler(native_interrupted: Any, native_resumed: Any, runs: Path) -> None:
    saved = torch.load(runs / "native-interrupted" / "last.ckpt", weights_only=False)["AmpPrecision"]
    assert saved == native_interrupted[0]["precision_state"]
    assert saved["grad_scaler"]["scale"] < 65536.0  # backed off from its initial value by the overflow(s)
    for report in native_resumed:
        assert report["at_start"] == {"precision_state": saved, "global_step": 8}


def test_native_bfloat16_trains_on_two_cpu_ranks(torchrun: Torchrun, runs: Path, fp32: Any) -> None:
    reports = train(torchrun, runs / "bf16", "--precision", "plugin", "--dtype", "bfloat16")
    for report in reports:
        assert report["hidden_dtypes"] == ["torch.bfloat16"]
        assert report["precision"] == "bf16-mixed"
        assert report["skipped"] == 0
    trained = weights(runs / "bf16")
    assert all(torch.isfinite(t).all() for t in trained.values())
    # bfloat16 rounds, so the weights are near the fp32 run's, not equal to them.
    assert 0 < max_abs_difference(weights(runs / "fp32"), trained) < 0.05
