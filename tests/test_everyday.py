"""Everyday Lightning under every precision the package offers, on 2 real ranks (workers/everyday.py).

One run per precision, every feature in it: a CNN fitted with validation every 3 batches, ``sync_dist`` logging,
torchmetrics, top-2 and last checkpoints, early stopping, an LR monitor into a CSV logger, a warm-up beside
ReduceLROnPlateau, clipping and accumulation, ``all_gather`` and ``barrier``; then ``validate``, ``test`` and
``predict`` after the fit, a transformer evaluated in eval mode, and a GAN with manual optimization and two losses.
Where apex trained the CNN, the GAN runs in a second launch (apex supports one ``amp.initialize`` per process) and
the first records envddp's refusal of a second fit. At the end one new process reloads each run's best checkpoint
and predicts. The ranks are forked from a preloaded interpreter (conftest.Preloaded): the runs cost their training.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import CPU_FP16_MISSING, Preloaded

pytestmark = pytest.mark.multiprocess

#: Every precision the package offers: Lightning's own under envddp, amp-O1 (apex here: the test double is on the
#: ranks' path), torch's AMP as AmpPrecision(backend="native"), and apex's four levels on the double.
PRECISIONS = [
    "32-true",
    "16-mixed",
    "bf16-mixed",
    "amp-O1",
    "native-O1",
    "native-O2",
    "apex-O0",
    "apex-O1",
    "apex-O2",
    "apex-O3",
]
FP32 = {"32-true", "bf16-mixed", "apex-O0"}
EVAL_BATCHES = 5  # 37 samples, 19 a rank after padding, 4 a batch
STEPS = 8  # 2 epochs of 7 batches a rank, accumulating 2: 4 optimizer steps an epoch
WARMUP_LR = [0.05 * (step + 1) / 4 for step in range(4)]


@dataclass(frozen=True)
class Run:
    """Both ranks' reports of one precision: the CNN's (with the GAN's where it ran in the same process) and the
    GAN's (where it ran in a launch of its own)."""

    out: Path
    cnn: list[dict[str, Any]]
    gan: list[dict[str, Any]]


def launch(preloaded: Preloaded, out: Path, precision: str, part: str) -> list[dict[str, Any]]:
    ranks = preloaded.run("everyday.py", "--out", str(out), "--precision", precision, "--part", part, log=out / part)
    name = "gan" if part == "gan" else "cnn"
    reports = [json.loads(path.read_text()) for path in sorted(out.glob(f"{name}-rank*.json"))]
    errors = [report["error"]["trace"] for report in reports if "error" in report]
    assert not errors and ranks.returncodes == [0, 0], errors[0] if errors else ranks.check()
    return reports


@pytest.fixture(scope="module")
def matrix(preloaded: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Each precision's run, where this torch can compute in it, then the reload of every run in one new process."""
    runs: dict[str, Run] = {}
    for precision in PRECISIONS:
        if precision not in FP32 and CPU_FP16_MISSING:
            continue
        out = tmp_path_factory.mktemp(precision)
        cnn = launch(preloaded, out, precision, "all")
        gan = launch(preloaded, out, precision, "gan") if cnn[0]["apex"] else cnn
        runs[precision] = Run(out, cnn, gan)
    reload = tmp_path_factory.mktemp("reload")
    folders = [str(run.out) for run in runs.values()]
    preloaded.run("everyday.py", "--out", str(reload), "--reload", *folders, nproc=1, log=reload).check()
    reloaded = json.loads((reload / "reload.json").read_text())
    for run in runs.values():
        run.cnn[0]["reloaded"] = reloaded[run.out.name]
    return runs


@pytest.fixture(
    params=[
        p
        if p in FP32
        else pytest.param(p, marks=pytest.mark.skipif(bool(CPU_FP16_MISSING), reason=str(CPU_FP16_MISSING)))
        for p in PRECISIONS
    ]
)
def run(request: pytest.FixtureRequest, matrix: dict[str, Run]) -> Run:
    return matrix[request.param]


def all_finite(values: dict[str, float]) -> bool:
    return bool(values) and all(math.isfinite(value) for value in values.values())


def test_fit_then_validate_test_and_predict_finish_on_both_ranks_with_finite_metrics(run: Run) -> None:
    for report in run.cnn:
        assert report["fit"]["global_step"] == STEPS
        assert all_finite(report["fit"]["callback_metrics"])
        assert all_finite(report["validate"]) and all_finite(report["test"])
    # Lightning shards predictions without padding: every sample once.
    assert sorted(index for report in run.cnn for index in report["predict"]["index"]) == list(range(37))


def test_the_precision_is_the_one_asked_for(run: Run) -> None:
    precision = run.cnn[0]["precision"]
    assert run.cnn[0]["apex"] == (precision.startswith("apex") or precision == "amp-O1")


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_sync_dist_reduces_each_kind_of_value_across_the_ranks(run: Run, stage: str) -> None:
    prefix = "val" if stage == "validate" else "test"
    for report in run.cnn:
        logged = report[stage]
        assert logged[f"{prefix}_rank_mean"] == 0.5  # integer tensors: the fraction kept
        assert logged[f"{prefix}_float_mean"] == 0.75
        assert logged[f"{prefix}_rank_max"] == 1.0  # Python floats
        assert logged[f"{prefix}_rank_sum"] == 3 * EVAL_BATCHES
    assert run.cnn[0][stage] == run.cnn[1][stage]


def test_metrics_logged_during_fit_agree_on_both_ranks(run: Run) -> None:
    first, second = (report["fit"]["callback_metrics"] for report in run.cnn)
    synced = [name for name in first if name not in ("train_acc", "val_acc", "train_loss_step")]
    assert {name: first[name] for name in synced} == {name: second[name] for name in synced}
    assert first["val_rank_mean"] == 0.5


def test_all_gather_and_barrier_see_every_rank_at_each_validation(run: Run) -> None:
    for report in run.cnn:
        # The sanity check, 4 validations during fit (every 3 batches, 2 epochs), and validate after it.
        assert report["fit"]["gathered"] == [[0, 1]] * 6


def test_top_two_and_last_checkpoints_are_written_by_val_loss(run: Run) -> None:
    fit = run.cnn[0]["fit"]
    assert len(fit["best_k_models"]) == 2
    assert fit["best_model_path"] in fit["best_k_models"]
    for path in [*fit["best_k_models"], fit["last_model_path"]]:
        assert Path(path).is_file()


def test_the_lr_monitor_writes_the_per_step_warm_up_to_the_csv_logger(run: Run) -> None:
    with (run.out / "csv" / "version_0" / "metrics.csv").open() as file:
        lrs = [float(row["lr-SGD"]) for row in csv.DictReader(file) if row.get("lr-SGD")]
    assert lrs[:1] == WARMUP_LR[:1]
    assert max(lrs) == pytest.approx(WARMUP_LR[-1])


def test_reduce_lr_on_plateau_steps_on_the_validation_loss(run: Run) -> None:
    # After the warm-up the LR is 0.05; the plateau scheduler halves it when val_loss stops falling.
    assert all(0 < lr <= 0.05 for lr in run.cnn[0]["fit"]["lrs"])


def test_a_transformer_validates_and_tests_in_eval_mode_after_the_fit(run: Run) -> None:
    for report in run.cnn:
        assert set(report["transformer"]) == {"val_transformer_loss", "test_transformer_loss"}
        assert all_finite(report["transformer"])


#: What envddp refuses, by precision, before the first step; everything else must work.
GAN_REFUSED = {
    "apex-O3": r"^eps=1e-08: opt_level O3 steps the float16 weights themselves, where Adam's eps rounds to 0"
}


def test_a_gan_trains_with_manual_optimization_two_optimizers_and_two_losses(run: Run) -> None:
    refused = GAN_REFUSED.get(run.cnn[0]["precision"])
    for report in run.gan:
        if refused:
            assert re.match(refused, report["gan_refused"]), report["gan_refused"]
            continue
        gan = report["gan"]
        assert (gan["steps"], gan["global_step"]) == (7, 14)  # two optimizer steps a batch
        assert gan["weights_finite"] and all_finite(gan["callback_metrics"])


def test_a_second_fit_where_apex_already_trained_is_refused_naming_the_fit(run: Run) -> None:
    for report in run.cnn:
        if report["apex"]:
            assert report["second_fit_refused"].startswith(
                "backend='apex': trainer.fit would call amp.initialize again"
            )
        else:
            assert "second_fit_refused" not in report


def test_the_best_checkpoint_reloads_and_predicts_in_a_new_process(run: Run) -> None:
    reloaded = run.cnn[0]["reloaded"]
    assert reloaded["index"] == list(range(37))
    assert all(0 <= label < 4 for label in reloaded["classes"])
