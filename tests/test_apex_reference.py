"""AmpPrecision against the recipe written by hand, on 2 real ranks (gloo, apex through its CPU double).

Each pair trains train_amp.py's two sub-models twice: with ``Trainer(strategy="envddp", precision=...)`` and with
the classic recipe in plain torch (workers/train_apex_recipe.py, workers/train_native_recipe.py). The first sub-model
holds an affine BatchNorm, which apex O2 keeps fp32: its gradients are the ones only ``optimizer.zero_grad()`` clears
(both workers fail under O2 if apex found no such fp32 parameter). A pair must end in
the same state (weights, fp32 master weights, loss scale, skipped steps), and must have really computed in half
precision: the dtypes it saw say so, and its weights are not the fp32 run's. After training, both evaluate in the same
process (``trainer.validate`` / ``test`` / ``predict``, and the recipe's own loop) and must predict the same. The apex runs also show the recipe's
order of calls, from the apex double's event log. Nothing here is about torchrun's agent: the ranks are forked from
an interpreter that already imported torch and Lightning (conftest.Preloaded), with torchrun's variables.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Preloaded, max_abs_difference, needs_cpu_fp16

pytestmark = pytest.mark.multiprocess

#: Both runs of a pair do the same arithmetic; only their DDP buckets differ (one wrapper, or one per sub-model).
SAME = 1e-6
#: Half precision rounds every step: a run that did not compute in it would end this close to the fp32 run.
NOT_FP32 = 1e-4
STEPS = 16  # 2 epochs of 64 samples, 2 ranks, 4 samples per rank per step
VAL_SIZE = 37  # workers/common.py's validation set


@dataclass(frozen=True)
class Run:
    """What train_amp.py reports on each rank, and what rank 0 saves to amp_state.pt."""

    reports: list[dict[str, Any]]
    state: dict[str, Any]


@dataclass(frozen=True)
class Pair:
    """The envddp run and what the hand-written recipe saved; ``half`` is the dtype both compute in."""

    half: str
    envddp: Run
    reference: dict[str, Any]


def train_amp(preloaded: Preloaded, out: Path, *args: str) -> Run:
    out.mkdir(parents=True)
    preloaded.run("train_amp.py", "--out", str(out), *args, log=out / "logs").check()
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    return Run(reports, torch.load(out / "amp_state.pt"))


def train_pair(
    preloaded: Preloaded, out: Path, envddp: Sequence[str], reference: Sequence[str], half: str = "torch.float16"
) -> Pair:
    """``train_amp.py *envddp`` and the reference worker ``reference[0] *reference[1:]``, with the apex double."""
    script, *args = reference
    saved = preloaded.reference(script, *args, out=out / "reference")
    return Pair(half, train_amp(preloaded, out / "envddp", *envddp), torch.load(saved))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reference")


@pytest.fixture(scope="module")
def fp32(preloaded: Preloaded, runs: Path) -> Run:
    return train_amp(preloaded, runs / "fp32", "--precision", "32-true")


OVERFLOW_AT_STEP_3 = ("--overflow-at-step", "3")


@pytest.fixture(scope="module")
def apex_o1(preloaded: Preloaded, runs: Path) -> Pair:
    """apex O1 (torch functions patched to fp16) under torch DDP, with an overflow injected at step 3 in both."""
    return train_pair(
        preloaded,
        runs / "apex-O1",
        envddp=["--precision", "apex-O1", *OVERFLOW_AT_STEP_3],
        reference=["train_apex_recipe.py", "--opt-level", "O1", *OVERFLOW_AT_STEP_3],
    )


@pytest.fixture(scope="module")
def apex_o2(preloaded: Preloaded, runs: Path) -> Pair:
    """apex O2 (fp16 model, fp32 master weights, fp32 BatchNorm) under torch DDP, each rank seeded apart: the DDP wrap
    gives every rank rank 0's weights, and the masters must be built from those."""
    return train_pair(
        preloaded,
        runs / "apex-O2",
        envddp=["--precision", "apex-O2", "--seed-per-rank"],
        reference=["train_apex_recipe.py", "--opt-level", "O2", "--seed-per-rank"],
    )


@pytest.fixture(scope="module")
def apex_o3(preloaded: Preloaded, runs: Path) -> Pair:
    """apex O3 (fp16 model, no master weights) under torch DDP."""
    return train_pair(
        preloaded,
        runs / "apex-O3",
        envddp=["--precision", "apex-O3"],
        reference=["train_apex_recipe.py", "--opt-level", "O3"],
    )


@pytest.fixture(scope="module")
def apex_o2_apex_ddp(preloaded: Preloaded, runs: Path) -> Pair:
    """apex O2 (fp16 model, fp32 master weights, fp32 BatchNorm) under apex.parallel.DistributedDataParallel, each
    rank seeded apart, as under torch DDP."""
    return train_pair(
        preloaded,
        runs / "apex-O2-apex-ddp",
        envddp=["--precision", "apex-O2", "--ddp-impl", "apex", "--seed-per-rank"],
        reference=["train_apex_recipe.py", "--opt-level", "O2", "--ddp-impl", "apex", "--seed-per-rank"],
    )


@pytest.fixture(scope="module")
def native_fp16(preloaded: Preloaded, runs: Path) -> Pair:
    """torch.autocast(float16) with a GradScaler."""
    return train_pair(
        preloaded,
        runs / "native-fp16",
        envddp=["--precision", "plugin", "--dtype", "float16"],
        reference=["train_native_recipe.py", "--dtype", "float16"],
    )


@pytest.fixture(scope="module")
def native_bf16(preloaded: Preloaded, runs: Path) -> Pair:
    """torch.autocast(bfloat16), no loss scaling."""
    return train_pair(
        preloaded,
        runs / "native-bf16",
        envddp=["--precision", "plugin", "--dtype", "bfloat16"],
        reference=["train_native_recipe.py", "--dtype", "bfloat16"],
        half="torch.bfloat16",
    )


FP16_PAIRS = ["apex_o1", "apex_o2", "apex_o3", "apex_o2_apex_ddp", "native_fp16"]


@pytest.fixture(
    scope="module",
    params=[*(pytest.param(name, marks=needs_cpu_fp16) for name in FP16_PAIRS), "native_bf16"],
)
def pair(request: pytest.FixtureRequest) -> Pair:
    """Each pair in turn; each is trained once, the first time a test asks for it."""
    return request.getfixturevalue(request.param)


def differences(envddp: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """The largest absolute difference of each part of the saved state that the reference saved too."""
    found = {"model": max_abs_difference(envddp["model"], reference["model"])}
    if "master_params" in reference:
        mine, theirs = envddp["master_params"], reference["master_params"]
        found["master_params"] = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(mine, theirs, strict=True)
        )
    for part in ("amp", "scaler"):
        if part in reference:
            found[part] = max(numbers_apart(envddp[part], reference[part]), default=0.0)
    return found


def numbers_apart(mine: Any, theirs: Any) -> list[float]:
    if isinstance(theirs, dict):
        assert mine.keys() == theirs.keys()
        return [d for key in theirs for d in numbers_apart(mine[key], theirs[key])]
    return [abs(float(mine) - float(theirs))]


def test_envddp_ends_in_the_references_state(pair: Pair) -> None:
    found = differences(pair.envddp.state, pair.reference)
    assert max(found.values()) <= SAME, found
    assert pair.envddp.state["skipped"] == pair.reference["skipped"]


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluation_after_fit_predicts_what_the_recipes_evaluation_loop_does(pair: Pair, stage: str) -> None:
    mine, theirs = pair.envddp.state["evaluated"][stage], pair.reference["evaluated"]
    assert mine.shape == theirs.shape == (VAL_SIZE, 1)
    assert (mine - theirs).abs().max().item() <= SAME


def test_evaluation_after_fit_runs_in_half_precision(pair: Pair, fp32: Run) -> None:
    assert (pair.envddp.state["evaluated"]["test"] - fp32.state["evaluated"]["test"]).abs().max().item() > NOT_FP32


def test_both_runs_compute_in_half_precision(pair: Pair) -> None:
    dtypes = [(run["param_dtype"], run["hidden_dtypes"]) for run in (pair.envddp.state, pair.reference)]
    assert dtypes[0] == dtypes[1]
    param_dtype, hidden_dtypes = dtypes[0]
    assert pair.half in {param_dtype, *hidden_dtypes}


def test_half_precision_moves_the_weights_away_from_the_fp32_run(pair: Pair, fp32: Run) -> None:
    assert max_abs_difference(pair.envddp.state["model"], fp32.state["model"]) > NOT_FP32


@needs_cpu_fp16
def test_an_injected_overflow_skips_the_same_steps_in_both_runs(apex_o1: Pair) -> None:
    # The injected overflow, and any fp16 overflow while the scale settles down from 2**16; never every step.
    assert 1 <= apex_o1.envddp.state["skipped"] == apex_o1.reference["skipped"] < STEPS


def test_bfloat16_needs_no_loss_scaling(native_bf16: Pair) -> None:
    for report in native_bf16.envddp.reports:
        assert report["precision"] == "bf16-mixed"
        assert report["skipped"] == 0
    assert native_bf16.envddp.state["scaler"] == native_bf16.reference["scaler"] == {}


def events(report: dict[str, Any], kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in report["events"] if kind is None or e["event"] == kind]


@needs_cpu_fp16
def test_initialize_sees_both_sub_models_and_the_optimizer_before_the_ddp_wrap(apex_o1: Pair) -> None:
    for report in apex_o1.envddp.reports:
        assert report["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel"
        (initialize,) = events(report, "initialize")
        assert (initialize["models"], initialize["optimizers"]) == (["Sequential", "Linear"], ["SGD"])
        kinds = [e["event"] for e in events(report)]
        assert kinds[0] == "initialize"
        assert kinds.index("ddp_wrap") < kinds.index("scale_loss")
        assert events(report, "ddp_wrap") == [{"event": "ddp_wrap", "model": "TwoModels"}]


@needs_cpu_fp16
def test_apex_ddp_wraps_the_model_after_initialize(apex_o2_apex_ddp: Pair) -> None:
    for report in apex_o2_apex_ddp.envddp.reports:
        assert report["wrapper"] == "apex.parallel.distributed.DistributedDataParallel"
        kinds = [e["event"] for e in events(report)]
        assert kinds.index("initialize") < kinds.index("ddp_wrap") < kinds.index("scale_loss")


@needs_cpu_fp16
def test_every_backward_runs_inside_scale_loss(apex_o1: Pair, apex_o2_apex_ddp: Pair) -> None:
    for report in [*apex_o1.envddp.reports, *apex_o2_apex_ddp.envddp.reports]:
        assert report["backward_outside_scale_loss"] == 0
        assert len(events(report, "scale_loss")) == report["global_step"] == STEPS


# --- RNNs fed by fp16 activations under O1 (workers/rnn_pairs.py) ------------------------------------------------


@dataclass(frozen=True)
class RNNRun:
    weights: dict[str, torch.Tensor]
    dtypes: dict[str, str]
    logs: list[str]


def rnn_run(preloaded: Preloaded, out: Path, mode: str, *args: str) -> RNNRun:
    ranks = preloaded.run("rnn_pairs.py", "--out", str(out), "--mode", mode, *args, log=out / "logs")
    if mode == "lightning":
        ranks.check()  # the classic script is judged by what it saved (its plain teardown may abort on exit)
    return RNNRun(torch.load(out / "weights.pt"), json.loads((out / "dtypes.json").read_text()), ranks.logs)


@pytest.fixture(scope="module")
def rnn_pair(preloaded: Preloaded, runs: Path) -> tuple[RNNRun, RNNRun]:
    return rnn_run(preloaded, runs / "rnn-classic", "classic"), rnn_run(preloaded, runs / "rnn-lightning", "lightning")


@needs_cpu_fp16
def test_lstm_gru_and_rnn_fed_fp16_activations_compute_in_fp16_under_apex_o1(rnn_pair: tuple[RNNRun, RNNRun]) -> None:
    classic, lightning = rnn_pair
    half = {"lstm": "torch.float16", "gru": "torch.float16", "rnn": "torch.float16"}
    assert classic.dtypes == half
    assert lightning.dtypes == half


@needs_cpu_fp16
def test_rnns_under_apex_o1_end_in_the_weights_of_the_recipe_with_torchs_dtype_check_lifted_by_hand(
    rnn_pair: tuple[RNNRun, RNNRun],
) -> None:
    classic, lightning = rnn_pair
    assert max_abs_difference(classic.weights, lightning.weights) == 0.0
    assert all(torch.isfinite(tensor).all() for tensor in lightning.weights.values())


@needs_cpu_fp16
def test_the_rnn_fix_is_said_once_on_rank_zero(rnn_pair: tuple[RNNRun, RNNRun]) -> None:
    _, lightning = rnn_pair
    line = "AmpPrecision: apex O1 runs RNNs in fp16 inside torch's _VF calls"
    assert lightning.logs[0].count(line) == 1
    assert line not in lightning.logs[1]


@needs_cpu_fp16
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_the_same_rnns_train_in_fp16_under_apex_o2_and_o3_with_nothing_lifted(
    preloaded: Preloaded, tmp_path: Path, level: str
) -> None:
    # O2 and O3 cast the whole model, RNN weights included, so torch's dtype check passes and envddp hooks nothing.
    run = rnn_run(preloaded, tmp_path, "lightning", "--level", level)
    assert run.dtypes == {"lstm": "torch.float16", "gru": "torch.float16", "rnn": "torch.float16"}
    assert all(torch.isfinite(tensor).all() for tensor in run.weights.values())
    assert "AmpPrecision: apex O1 runs RNNs" not in run.logs[0]
