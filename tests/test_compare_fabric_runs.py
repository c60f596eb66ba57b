"""`lightning-ddp-amp compare` on kept loops, for real (issue 45): the package's Fabric example and a GAN with two
models, two optimizers and three losses, each compared on 2 ranks under torchrun with the apex double. One compare
per script, read by every test here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from test_compare import run_compare

REPO = Path(__file__).parent.parent
EXAMPLE = str(REPO / "examples" / "fabric" / "train.py")
GAN = str(REPO / "tests" / "workers" / "gan_pairs.py")
#: torchrun, as this interpreter runs it.
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
pytestmark = pytest.mark.multiprocess

#: The example's batch fed an inf (its step skips under every precision with a loss scale), and the run's length:
#: one step past its first epoch (16 steps on 2 ranks), after which it saves its checkpoint.
BAD_BATCH, EXAMPLE_STEPS = 3, 17
#: The GAN's optimizer steps on 2 ranks: 8 batches (2 epochs of 4), each stepping the discriminator and the generator.
GAN_STEPS = 16


@dataclass(frozen=True)
class Compared:
    result: subprocess.CompletedProcess[str]
    out: Path

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.out / "compare.json").read_text())  # type: ignore[no-any-return]

    def candidate(self, name: str) -> dict[str, Any]:
        (found,) = [each for each in self.report["candidates"] if each["name"] == name]
        return found


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Compared:
    work = tmp_path_factory.mktemp("example")
    out = work / "out"
    result = run_compare(
        work,
        *("apex-O1", "native-O1", "apex-O1", "--noise-floor", "--metric", "val_acc:0.005"),
        *("--steps", str(EXAMPLE_STEPS), "--snapshots", "2", "--out", str(out)),
        *("--", *TORCHRUN, "--nproc-per-node=2", EXAMPLE, "--bad-batch", str(BAD_BATCH)),
        *("--checkpoint", str(work / "checkpoint.pt")),
        apex_double=True,
        timeout=600,
    )
    return Compared(result, out)


@pytest.fixture(scope="module")
def gan(tmp_path_factory: pytest.TempPathFactory) -> Compared:
    work = tmp_path_factory.mktemp("gan")
    out = work / "out"
    result = run_compare(
        work,
        *("apex-O1", "native-O1", "apex-O1", "--steps", str(GAN_STEPS), "--snapshots", "2", "--out", str(out)),
        *(
            "--",
            *TORCHRUN,
            "--nproc-per-node=2",
            GAN,
            "--door",
            "fabric",
            "--level",
            "O1",
            "--out",
            str(work / "state"),
        ),
        apex_double=True,
        timeout=600,
    )
    return Compared(result, out)


def test_the_fabric_example_compares_close_to_apex_and_identical_to_itself(example: Compared) -> None:
    assert example.result.returncode == 0, example.result.stdout[-6000:]
    # On the CPU the apex double's O1 and torch's autocast compute this MLP alike, to the bit.
    assert example.candidate("native-O1")["status"] in ("identical", "close")
    assert example.candidate("apex-O1#2")["status"] == "identical"
    assert example.report["comparable"] is True
    assert example.report["noise_floor"] is not None


def test_every_run_records_each_step_on_both_ranks_and_stops_cleanly_at_its_steps(example: Compared) -> None:
    for candidate in example.report["candidates"]:
        folder = Path(candidate["directory"])
        record = json.loads((folder / "record.json").read_text())
        assert candidate["returncode"] == 0 and candidate["world_size"] == 2
        assert [rank["rank"] for rank in record["ranks"]] == [0, 1]
        assert all(rank["step"] == list(range(EXAMPLE_STEPS)) for rank in record["ranks"])
        assert {path.name for path in folder.glob("record-rank*.json")} == {"record-rank0.json", "record-rank1.json"}


def test_the_checkpoint_the_example_saves_is_each_runs_own(example: Compared) -> None:
    work = Path(example.report["candidates"][0]["directory"]).parent.parent
    assert not (work / "checkpoint.pt").exists()
    for candidate in example.report["candidates"]:
        saved = Path(candidate["directory"], "files", "checkpoint.pt")  # compare ran in work, the script's folder
        assert torch.load(saved, weights_only=True)["epoch"] == 1, candidate["name"]
        assert f"fabric.save({str(work / 'checkpoint.pt')!r}) -> {str(saved)!r}" in candidate["replaced"]


def test_the_injected_overflow_is_located_in_the_example_on_every_amp_run(example: Compared) -> None:
    for name in ("apex-O1", "native-O1"):
        candidate = example.candidate(name)
        assert BAD_BATCH in candidate["summary"]["skipped_steps"]
        (located,) = [each for each in candidate["overflows"] if each["step"] == BAD_BATCH]
        assert (located["phase"], located["module"], located["dtype"]) == (
            "forward",
            "module0.layers.0",
            "torch.float16",
        )


def test_the_metric_the_loop_logs_with_fabric_log_gets_its_verdict(example: Compared) -> None:
    metric = example.candidate("native-O1")["summary"]["metrics"]["val_acc"]
    assert metric["stage"] == "logged"
    assert abs(metric["difference"]) <= 0.005
    assert "val_acc" in example.result.stdout


def test_weights_are_measured_against_the_baselines_at_the_snapshots(example: Compared) -> None:
    distances = json.loads((Path(example.candidate("native-O1")["directory"]) / "record.json").read_text())
    # The snapshot halfway; the end's distance is the report's, from the final weights.
    assert [step for step, _ in distances["weight_distances"]] == [EXAMPLE_STEPS // 2]
    assert example.candidate("native-O1")["summary"]["weight_distance"] is not None
    final = torch.load(Path(example.candidate("apex-O1")["directory"]) / "weights-final.pt", weights_only=True)
    assert {name.split(".")[0] for name in final} == {"module0", "module1"}


def test_the_gan_records_both_optimizers_steps_and_locates_its_injected_loss_overflows(gan: Compared) -> None:
    baseline = gan.candidate("apex-O1")
    record = json.loads((Path(baseline["directory"]) / "record.json").read_text())
    assert all(rank["step"] == list(range(GAN_STEPS)) for rank in record["ranks"])
    # gan_pairs multiplies errD_real by inf at its batch 2 (step 4: the discriminator's) and errG at batch 5 (step 11).
    for name in ("apex-O1", "native-O1"):
        located = {each["step"]: each for each in gan.candidate(name)["overflows"]}
        assert {4, 11} <= set(gan.candidate(name)["summary"]["skipped_steps"])
        assert (located[4]["phase"], located[4]["module"]) == ("loss", "(the loss)")
        assert (located[11]["phase"], located[11]["module"]) == ("loss", "(the loss)")


def test_the_gan_under_torchs_one_scaler_is_apart_from_apexs_three_and_the_report_says_why(gan: Compared) -> None:
    # apex keeps a loss scaler per loss_id (num_losses=3) and skips each optimizer on its own; GradScaler is one
    # scaler for the three losses: the early fp16 overflows skip different steps, and the runs train out of phase.
    assert gan.result.returncode == 1, gan.result.stdout[-6000:]
    assert gan.candidate("apex-O1#2")["status"] == "identical"
    native = gan.candidate("native-O1")
    assert native["status"] == "apart"
    assert "skipped on overflow" in native["reason"] and "out of phase" in native["reason"]


def test_the_gans_three_losses_are_reported_each_on_the_steps_of_its_optimizer(gan: Compared) -> None:
    # errD_real (loss_id 0) and errD_fake (1) come before the discriminator's steps (even), errG (2) the generator's
    # (odd); compare.json writes a loss that was not given, and one that overflowed (steps 4 and 11), as null.
    optimizer_steps = {
        "0": set(range(0, GAN_STEPS, 2)),
        "1": set(range(0, GAN_STEPS, 2)),
        "2": set(range(1, GAN_STEPS, 2)),
    }
    for name in ("apex-O1", "native-O1", "apex-O1#2"):
        by_id = gan.candidate(name)["series"]["loss_by_id"]
        assert sorted(by_id) == ["0", "1", "2"]
        for loss_id, steps in optimizer_steps.items():
            given = {step for step, loss in enumerate(by_id[loss_id]) if loss is not None}
            assert steps - {4, 11} <= given <= steps, (name, loss_id)
    assert sorted(gan.candidate("native-O1")["summary"]["loss_by_id"]) == ["0", "1", "2"]
    same = gan.candidate("apex-O1#2")["summary"]["loss_by_id"]
    assert all(each["final_loss_relative_difference"] == 0 for each in same.values())
    assert "loss_id 2" in gan.result.stdout
