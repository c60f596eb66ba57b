"""AmpPrecision on real ranks (gloo, forked from the preloaded interpreter): overflows, skipped steps and resuming, with apex through its CPU
test double and with native AMP on the CPU. test_apex_reference.py compares whole runs with the recipe by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Preloaded, needs_cpu_fp16

# Every run here computes in float16 on the CPU: the apex double's O1, native fp16 AMP.
pytestmark = [pytest.mark.multiprocess, needs_cpu_fp16]


def train(preloaded: Preloaded, out: Path, *args: str) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    preloaded.run("train_amp.py", "--out", str(out), *args, log=out / "logs").check()
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def events(report: dict[str, Any], kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in report["events"] if kind is None or e["event"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("amp")


@pytest.fixture(scope="module")
def apex_interrupted(preloaded: Preloaded, runs: Path) -> list[dict[str, Any]]:
    """One epoch of apex-O1 with an overflow at step 3, checkpointed at the end."""
    out = runs / "apex-interrupted"
    return train(
        preloaded,
        out,
        "--precision",
        "apex-O1",
        "--epochs",
        "1",
        "--overflow-at-step",
        "3",
        "--checkpoint",
    )


@pytest.fixture(scope="module")
def apex_resumed(preloaded: Preloaded, runs: Path, apex_interrupted: Any) -> list[dict[str, Any]]:
    """A new pair of processes resuming from that checkpoint for a second epoch."""
    checkpoint = str(runs / "apex-interrupted" / "last.ckpt")
    return train(preloaded, runs / "apex-resumed", "--precision", "apex-O1", "--resume", checkpoint)


def overflow_steps(report: dict[str, Any]) -> list[int]:
    """The steps whose backward overflowed: the apex double notes an overflow after that step's scale_loss."""
    kinds = [e["event"] for e in events(report) if e["event"] in ("scale_loss", "overflow")]
    return [kinds[:i].count("scale_loss") - 1 for i, kind in enumerate(kinds) if kind == "overflow"]


def test_an_apex_overflow_skips_the_step_and_holds_the_schedule(apex_interrupted: Any) -> None:
    for report in apex_interrupted:
        # The injected overflow at step 3, and any fp16 overflow while the scale settles down from 2**16.
        skipped = overflow_steps(report)
        assert 3 in skipped and len(skipped) < 8
        assert report["skipped"] == len(events(report, "skipped_step")) == len(skipped)
        assert (report["global_step"], report["scheduler_steps"]) == (8, 8 - len(skipped))
        # Each overflow halved the scale; the steps after the last one (steps 0 to 7) ran unskipped.
        scaler = {"loss_scale": 2.0**16 / 2 ** len(skipped), "unskipped": 7 - max(skipped)}
        assert report["precision_state"]["loss_scalers"] == [scaler]


def test_resume_restores_the_amp_state_after_initialize(apex_interrupted: Any, apex_resumed: Any, runs: Path) -> None:
    saved = torch.load(runs / "apex-interrupted" / "last.ckpt", weights_only=False)["AmpPrecision"]
    assert saved == apex_interrupted[0]["precision_state"]
    for report in apex_resumed:
        assert report["at_start"] == {"precision_state": saved, "global_step": 8}
        kinds = [e["event"] for e in events(report)]
        assert kinds.index("initialize") < kinds.index("load_state_dict") < kinds.index("scale_loss")


@pytest.fixture(scope="module")
def native_interrupted(preloaded: Preloaded, runs: Path) -> list[dict[str, Any]]:
    out = runs / "native-interrupted"
    return train(preloaded, out, "--precision", "plugin", "--epochs", "1", "--overflow-at-step", "3", "--checkpoint")


@pytest.fixture(scope="module")
def native_resumed(preloaded: Preloaded, runs: Path, native_interrupted: Any) -> list[dict[str, Any]]:
    checkpoint = str(runs / "native-interrupted" / "last.ckpt")
    return train(preloaded, runs / "native-resumed", "--precision", "plugin", "--resume", checkpoint)


def test_native_fp16_trains_in_half_precision_on_two_cpu_ranks(native_interrupted: Any) -> None:
    for report in native_interrupted:
        assert report["hidden_dtypes"] == ["torch.float16"]
        assert report["precision"] == "16-mixed"
        # The injected overflow, and any fp16 overflow while the scaler settles, but never every step: skipped steps
        # do not schedule.
        assert 1 <= report["skipped"] < report["global_step"] == 8
        assert report["scheduler_steps"] == 8 - report["skipped"]


def test_resume_restores_the_native_scaler(native_interrupted: Any, native_resumed: Any, runs: Path) -> None:
    saved = torch.load(runs / "native-interrupted" / "last.ckpt", weights_only=False)["AmpPrecision"]
    assert saved == native_interrupted[0]["precision_state"]
    assert saved["grad_scaler"]["scale"] < 65536.0  # backed off from its initial value by the overflow(s)
    for report in native_resumed:
        assert report["at_start"] == {"precision_state": saved, "global_step": 8}
