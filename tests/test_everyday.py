"""Everyday Lightning under every precision the package offers, on 2 real ranks (workers/everyday.py).

One run per precision, every feature in it: a CNN fitted with validation every 3 batches, ``sync_dist`` logging,
torchmetrics, top-2 and last checkpoints, early stopping, an LR monitor into a CSV logger, a warm-up beside
ReduceLROnPlateau, clipping and accumulation, ``all_gather`` and ``barrier``; then ``validate``, ``test`` and
``predict`` after the fit, a transformer evaluated in eval mode, a GAN with manual optimization and two losses, and a
sequence model (embedding, Linear, LSTM, GRU) fitted, validated, tested and predicted. Where apex trained the CNN,
the GAN and the sequence model run in a launch each (apex supports one ``amp.initialize`` per process) and the first
records envddp's refusal of a second fit. At the end one new process reloads each run's best checkpoint and the
sequence model's, and predicts. The ranks are forked from a preloaded interpreter (conftest.Preloaded): the runs cost their training.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
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
#: The dtype each precision computes in on the CPU, where it is not float16. Lightning runs 16-mixed as bf16-mixed on
#: the CPU (it says so); apex O0 is fp32.
COMPUTES_IN = {"32-true": "float32", "16-mixed": "bfloat16", "bf16-mixed": "bfloat16", "apex-O0": "float32"}
#: The precisions that compute under torch.autocast("cpu", ...), in the dtype of COMPUTES_IN (float16 where absent).
CPU_AUTOCAST = {"16-mixed", "bf16-mixed", "native-O1", "native-O2"}
EVAL_BATCHES = 5  # 37 samples, shards of 19 and 18 (exact_eval), 4 a batch
EVAL_SHARDS = (19, 18)
STEPS = 8  # 2 epochs of 7 batches a rank, accumulating 2: 4 optimizer steps an epoch
WARMUP_LR = [0.05 * (step + 1) / 4 for step in range(4)]


@dataclass(frozen=True)
class Run:
    """Both ranks' reports of one precision: the CNN's (with the GAN's and the sequence model's where they ran in the
    same process), the GAN's and the sequence model's (where each ran in a launch of its own); or why the run
    failed."""

    out: Path
    cnn: list[dict[str, Any]]
    gan: list[dict[str, Any]]
    seq: list[dict[str, Any]]
    failed: str = ""


def launch(preloaded: Preloaded, out: Path, precision: str, part: str) -> tuple[list[dict[str, Any]], str]:
    """Both ranks' reports of one part, and why it failed ("" when it did not)."""
    ranks = preloaded.run("everyday.py", "--out", str(out), "--precision", precision, "--part", part, log=out / part)
    name = part if part in ("gan", "seq") else "cnn"
    reports = [json.loads(path.read_text()) for path in sorted(out.glob(f"{name}-rank*.json"))]
    errors = [report["error"]["trace"] for report in reports if "error" in report]
    if errors or ranks.returncodes != [0, 0] or len(reports) != 2:
        logs = "\n".join(f"--- rank {rank}:\n{log[-3000:]}" for rank, log in enumerate(ranks.logs))
        return reports, f"{precision} --part {part}: exit statuses {ranks.returncodes}\n{errors[0] if errors else logs}"
    return reports, ""


@pytest.fixture(scope="module")
def matrix(preloaded: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Each precision's run, where this torch can compute in it, then the reload of every run in one new process.

    Where apex trained the CNN, the GAN and then the sequence model run in a launch each: three launches under apex,
    one under the others. A failed run fails its own precision's tests; the others still run.
    """
    runs: dict[str, Run] = {}
    for precision in PRECISIONS:
        if precision not in COMPUTES_IN and CPU_FP16_MISSING:
            continue
        out = tmp_path_factory.mktemp(precision)
        cnn, failed = launch(preloaded, out, precision, "all")
        gan = seq = cnn
        if not failed and cnn[0]["apex"]:
            gan, failed = launch(preloaded, out, precision, "gan")
        if not failed and cnn[0]["apex"]:
            seq, failed = launch(preloaded, out, precision, "seq")
        runs[precision] = Run(out, cnn, gan, seq, failed)
    reload = tmp_path_factory.mktemp("reload")
    folders = [str(run.out) for run in runs.values() if not run.failed]
    preloaded.run("everyday.py", "--out", str(reload), "--reload", *folders, nproc=1, log=reload).check()
    reloaded = json.loads((reload / "reload.json").read_text())
    for run in runs.values():
        if not run.failed:
            run.cnn[0]["reloaded"] = reloaded[run.out.name]["cnn"]
            run.seq[0]["seq_reloaded"] = reloaded[run.out.name].get("seq")
    return runs


@pytest.fixture(
    params=[
        p
        if p in COMPUTES_IN
        else pytest.param(p, marks=pytest.mark.skipif(bool(CPU_FP16_MISSING), reason=str(CPU_FP16_MISSING)))
        for p in PRECISIONS
    ]
)
def run(request: pytest.FixtureRequest, matrix: dict[str, Run]) -> Run:
    found = matrix[request.param]
    if found.failed:
        pytest.fail(found.failed, pytrace=False)
    return found


def all_finite(values: dict[str, float]) -> bool:
    return bool(values) and all(math.isfinite(value) for value in values.values())


def test_fit_then_validate_test_and_predict_finish_on_both_ranks_with_finite_metrics(run: Run) -> None:
    for report in run.cnn:
        assert report["fit"]["global_step"] == STEPS
        assert all_finite(report["fit"]["callback_metrics"])
        assert all_finite(report["validate"]) and all_finite(report["test"])
    # Lightning shards predictions without padding: every sample once.
    assert sorted(index for report in run.cnn for index in report["predict"]["index"]) == list(range(37))


#: A precision label of Lightning's, as a warning would name it ("Precision 16-mixed is not supported by ...").
LIGHTNING_LABEL = re.compile(r"\b(?:16|bf16|32|64)-(?:mixed|true)\b")


def test_no_warning_of_the_fit_names_a_precision_the_script_did_not_ask_for(run: Run) -> None:
    # Under AmpPrecision Lightning sees a label ("16-mixed" for amp-O1); a warning naming it would name a precision
    # the user never asked for. The CNN's fit runs with Lightning's model summary on, as scripts have it.
    precision = run.cnn[0]["precision"]
    for report in run.cnn:
        named = [warning for warning in report["fit_warnings"] if LIGHTNING_LABEL.search(warning)]
        assert named == [] or precision in " ".join(named), named


def test_each_precision_computes_in_its_dtype_and_amp_o1_runs_apex_where_apex_can_run(run: Run) -> None:
    precision = run.cnn[0]["precision"]
    for report in run.cnn:
        assert report["apex"] == (precision.startswith("apex") or precision == "amp-O1")
        assert report["fit"]["computed_in"] == [COMPUTES_IN.get(precision, "float16")]  # the conv's output


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_sync_dist_reduces_each_kind_of_value_across_the_ranks(run: Run, stage: str) -> None:
    prefix = "val" if stage == "validate" else "test"
    # Epoch means weigh each rank's value by its samples: Lightning divides the reduced sums by envddp's mean of the
    # ranks' integer sample counts, 18.5 (truncated to 18 by Lightning's own reduce, float64 before, under apex O1 an
    # error).
    first, second = EVAL_SHARDS
    for report in run.cnn:
        logged = report[stage]
        assert logged[f"{prefix}_rank_mean"] == pytest.approx(second / (first + second))
        assert logged[f"{prefix}_float_mean"] == pytest.approx((0.25 * first + 1.25 * second) / (first + second))
        assert logged[f"{prefix}_rank_max"] == 1.0  # Python floats
        assert logged[f"{prefix}_rank_sum"] == 3 * EVAL_BATCHES
    assert run.cnn[0][stage] == run.cnn[1][stage]


#: envddp's reduce on 2 ranks, by input and op: (value, dtype). Rank r hands 19 - r, uint8 200, r == 0, r + 0.25 and
#: r + 0.5 (workers/everyday.py REDUCE_INPUTS). Integer means are in torch's default dtype, never float64.
REDUCED = {
    "int64-mean": [18.5, "float32"],
    "int64-sum": [37.0, "int64"],
    "int64-max": [19.0, "int64"],
    "int64-min": [18.0, "int64"],
    "uint8-mean": [200.0, "float32"],
    "bool-mean": [0.5, "float32"],
    "float32-mean": [0.75, "float32"],
    "float32-sum": [1.5, "float32"],
    "float32-max": [1.25, "float32"],
    "float32-min": [0.25, "float32"],
    "bfloat16-mean": [1.0, "bfloat16"],
    "bfloat16-sum": [2.0, "bfloat16"],
    "bfloat16-max": [1.5, "bfloat16"],
    "bfloat16-min": [0.5, "bfloat16"],
}


def test_reduce_gives_each_op_its_value_and_dtype_on_two_ranks_after_the_fit(run: Run) -> None:
    for report in run.cnn:
        found = report["reduce"]
        assert {key: found[key] for key in REDUCED} == REDUCED


def test_metrics_logged_during_fit_agree_on_both_ranks(run: Run) -> None:
    first, second = (report["fit"]["callback_metrics"] for report in run.cnn)
    synced = [name for name in first if name not in ("train_acc", "val_acc", "train_loss_step")]
    assert {name: first[name] for name in synced} == {name: second[name] for name in synced}


def test_all_gather_and_barrier_see_every_rank_at_each_validation(run: Run) -> None:
    for report in run.cnn:
        # The sanity check, 4 validations during fit (every 3 batches, 2 epochs), and validate after it.
        assert report["fit"]["gathered"] == [[0, 1]] * 6


def test_top_two_and_last_checkpoints_are_written_by_val_loss(run: Run) -> None:
    fit = run.cnn[0]["fit"]
    assert len(fit["val_losses"]) == 4  # every 3 batches, 2 epochs of 7
    assert fit["best_model_score"] == pytest.approx(min(fit["val_losses"]))
    assert len(fit["best_k_models"]) == 2
    assert fit["best_model_path"] in fit["best_k_models"]
    for path in [*fit["best_k_models"], fit["last_model_path"]]:
        assert Path(path).is_file()


def test_the_lr_monitor_writes_the_per_step_warm_up_to_the_csv_logger(run: Run) -> None:
    with (run.out / "csv" / "version_0" / "metrics.csv").open() as file:
        lrs = [float(row["lr-SGD"]) for row in csv.DictReader(file) if row.get("lr-SGD")]
    assert lrs[:1] == WARMUP_LR[:1]
    assert max(lrs) == pytest.approx(WARMUP_LR[-1])


def test_early_stopping_follows_the_validation_loss(run: Run) -> None:
    fit = run.cnn[0]["fit"]
    assert fit["early_stopping_best"] == pytest.approx(min(fit["val_losses"]))


def test_reduce_lr_on_plateau_halves_the_lr_after_each_epoch_whose_val_loss_did_not_improve(run: Run) -> None:
    best, epochs = math.inf, run.cnn[0]["fit"]["epochs_around_plateau"]
    assert len(epochs) == 2
    for epoch in epochs:
        improved = epoch["val_loss"] < best * (1 - 1e-4)  # ReduceLROnPlateau's default relative threshold
        best = min(best, epoch["val_loss"]) if improved else best
        assert epoch["lr_after"] == pytest.approx(epoch["lr_before"] * (1.0 if improved else 0.5))


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


#: Where the fit's process predicts in fp16 (apex's casts) and a new process, without amp.initialize, in fp32.
FP16_ONLY_IN_THE_FIT_PROCESS = {"amp-O1", "apex-O1", "apex-O2", "apex-O3"}


def test_the_best_checkpoint_reloads_in_a_new_process_and_predicts_what_it_predicted_after_the_fit(run: Run) -> None:
    precision, reloaded = run.cnn[0]["precision"], run.cnn[0]["reloaded"]
    assert reloaded["index"] == list(range(37))
    after_fit = {i: logits for report in run.cnn for i, logits in zip(*report["predict_best"].values(), strict=True)}
    expected = [value for index in range(37) for value in after_fit[index]]
    tolerance = 0.05 if precision in FP16_ONLY_IN_THE_FIT_PROCESS else 1e-5  # fp16 rounding, or the same arithmetic
    assert [value for row in reloaded["logits"] for value in row] == pytest.approx(expected, abs=tolerance)


@functools.cache
def torch_refuses_the_sequence_model(dtype: str) -> str:
    """torch's own error for a step of the sequence model under ``torch.autocast("cpu", dtype)``, in this process,
    without the package or Lightning; "" when torch runs it.

    oneDNN's LSTM has no kernel for some dtypes on some CPUs ("could not create a primitive descriptor for the LSTM
    forward propagation primitive"): here, with torch 2.13 on AVX512-BF16, an fp32 input under float16 autocast, but
    not the Linear's float16 output the model hands its LSTM.
    """
    from workers.everyday import SmallSeq, sequences

    tokens = sequences(4, seed=0).tensors[0]
    try:
        with torch.autocast("cpu", dtype=getattr(torch, dtype)):
            loss = SmallSeq()(tokens).sum()
        loss.backward()
    except RuntimeError as error:
        return f"RuntimeError: {error}"
    return ""


def refusal(precision: str) -> str:
    """torch's own error for the sequence model under ``precision`` on this CPU; "" where torch runs it."""
    if precision not in CPU_AUTOCAST:
        return ""
    return torch_refuses_the_sequence_model(COMPUTES_IN.get(precision, "float16"))


SEQ_MODULES = {"embed", "project", "lstm", "gru", "head"}
SEQ_STEPS = 7  # 1 epoch of 7 batches a rank


def test_a_sequence_model_trains_validates_and_tests_wherever_torch_runs_its_lstm(run: Run) -> None:
    refused = refusal(run.seq[0]["precision"])
    for report in run.seq:
        if refused:
            # torch's error, as torch raises it without the package; the CNN's and the GAN's tests pass beside it.
            assert report["seq_failed"]["message"] == refused
            continue
        assert "seq_failed" not in report, report["seq_failed"]["trace"]
        seq = report["seq"]
        assert seq["global_step"] == SEQ_STEPS
        assert all_finite(seq["callback_metrics"]) and all_finite(seq["validate"]) and all_finite(seq["test"])
        assert set(seq["validate"]) == {"val_seq_loss", "val_seq_acc"}
        assert set(seq["test"]) == {"test_seq_loss", "test_seq_acc"}
        assert set(seq["moved"]) == SEQ_MODULES and min(seq["moved"].values()) > 0  # the gradients reach every module
    if not refused:
        assert run.seq[0]["seq"]["validate"] == run.seq[1]["seq"]["validate"]  # sync_dist
        assert run.seq[0]["seq"]["test"] == run.seq[1]["seq"]["test"]


def test_the_sequence_models_lstm_computes_in_the_precisions_dtype(run: Run) -> None:
    precision = run.seq[0]["precision"]
    if refusal(precision):
        pytest.skip(f"torch refuses the LSTM under {precision} on this CPU")
    for report in run.seq:
        # Under apex O1 too: apex casts the recurrence to fp16 inside torch's _VF call (envddp's RNN fix lets it).
        assert report["seq"]["lstm_computed_in"] == [COMPUTES_IN.get(precision, "float16")]


def seq_tolerance(precision: str) -> float:
    """How far the sequence model's predictions in a new process may be from the fit process's: fp16 rounding where
    only the fit process computes in fp16; under float16 autocast both do, but one rank batches the 37 samples unlike
    two, and oneDNN's fp16 LSTM rounds by batch (an fp16 ulp, 3e-5 here); elsewhere the same arithmetic."""
    if precision in FP16_ONLY_IN_THE_FIT_PROCESS:
        return 0.05
    return 1e-3 if precision in CPU_AUTOCAST and COMPUTES_IN.get(precision, "float16") == "float16" else 1e-5


def test_the_sequence_model_reloads_in_a_new_process_and_predicts_what_it_predicted_after_the_fit(run: Run) -> None:
    precision, reloaded = run.seq[0]["precision"], run.seq[0]["seq_reloaded"]
    if refusal(precision):
        assert reloaded is None  # no fit, no checkpoint
        return
    assert reloaded["index"] == list(range(37))
    after_fit = {i: logits for report in run.seq for i, logits in zip(*report["seq"]["predict"].values(), strict=True)}
    expected = [value for index in range(37) for value in after_fit[index]]
    tolerance = seq_tolerance(precision)
    assert [value for row in reloaded["logits"] for value in row] == pytest.approx(expected, abs=tolerance)
