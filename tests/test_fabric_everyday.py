"""Everyday Lightning Fabric under every precision the package offers, on 2 real ranks (workers/fabric_everyday.py).

One run per precision, all in one process as a user's script is: ``Fabric(strategy="envddp", ...)`` with a
CSVLogger, ``fabric.launch()``, a GAN, a transformer and a sequence model set up in one ``setup_models`` call (apex
supports one ``amp.initialize`` per process), a second ``fabric.setup``, the collectives, ``fabric.autocast()``, the
GAN's two optimizers with a ``loss_id`` each, training then evaluation under ``torch.no_grad()``, and ``fabric.log`` /
``fabric.log_dict``. Each combination works, or is refused at ``fabric.setup`` / ``fabric.backward`` naming the
call, the precision and the fix. The ranks are forked from a preloaded interpreter (conftest.Preloaded).
"""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest import Preloaded, needs_cpu_fp16
from test_everyday import COMPUTES_IN, CPU_AUTOCAST, PRECISIONS, torch_refuses_the_sequence_model
from test_fabric import fabric_for, model_and_optimizer

from lightning_ddp_amp.errors import PrecisionConfigurationError
from lightning_ddp_amp.fabric import setup_models

pytestmark = pytest.mark.multiprocess

#: The precisions whose plugin is AmpPrecision on apex (amp-O1 finds the apex double on the ranks' path).
APEX = {"amp-O1", "apex-O0", "apex-O1", "apex-O2", "apex-O3"}
#: What ``Fabric(..., precision=P)`` or ``plugins=[AmpPrecision(...)]`` builds: the plugin's class, its backend, and
#: the Lightning precision it reports. Lightning runs 16-mixed as bf16-mixed on the CPU (it says so).
PLUGINS = {
    "32-true": ["Precision", None, "32-true"],
    "16-mixed": ["MixedPrecision", None, "bf16-mixed"],
    "bf16-mixed": ["MixedPrecision", None, "bf16-mixed"],
    "amp-O1": ["AmpPrecision", "apex", "16-mixed"],
    "native-O1": ["AmpPrecision", "native", "16-mixed"],
    "native-O2": ["AmpPrecision", "native", "16-mixed"],
    "apex-O0": ["AmpPrecision", "apex", "32-true"],
    "apex-O1": ["AmpPrecision", "apex", "16-mixed"],
    "apex-O2": ["AmpPrecision", "apex", "16-mixed"],
    "apex-O3": ["AmpPrecision", "apex", "16-true"],
}
PARTS = ["fabric", "launch", "setup", "collectives", "autocast", "gan", "transformer", "seq", "log"]
STEPS = 3  # workers/fabric_everyday.py: 3 training batches a rank for each model
EVAL_SAMPLES = 7  # 13 samples: DistributedSampler pads to 2 shards of 7


@dataclass(frozen=True)
class Run:
    """Both ranks' reports of one precision, with their logs."""

    precision: str
    out: Path
    reports: list[dict[str, Any]]
    logs: list[str]


@pytest.fixture(
    scope="module",
    params=[p if p in COMPUTES_IN else pytest.param(p, marks=needs_cpu_fp16) for p in PRECISIONS],
)
def run(request: pytest.FixtureRequest, preloaded: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One 2-rank run of the worker under the precision; a rank's recorded error fails the precision's tests."""
    precision = request.param
    out = tmp_path_factory.mktemp(precision)
    ranks = preloaded.run("fabric_everyday.py", "--out", str(out), "--precision", precision, log=out / "logs")
    reports = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    errors = [
        f"rank {report['rank']}, part {report['error']['part']}:\n{report['error']['trace']}"
        for report in reports
        if "error" in report
    ]
    if errors:
        pytest.fail(f"{precision}: {errors[0]}", pytrace=False)
    ranks.check()
    assert len(reports) == 2
    return Run(precision, out, reports, ranks.logs)


def uses_apex(run: Run) -> bool:
    return run.precision in APEX


def computes_in(precision: str) -> str:
    return COMPUTES_IN.get(precision, "float16")


def all_finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(value) for value in values)


def test_every_part_runs_on_both_ranks_of_one_process_group(run: Run) -> None:
    for rank, report in enumerate(run.reports):
        assert report["ran"] == PARTS
        assert report["topology"] == {"world_size": 2, "global_rank": rank}


def test_each_precision_builds_its_plugin(run: Run) -> None:
    for report in run.reports:
        plugin = report["plugin"]
        assert [plugin["type"], plugin["backend"], plugin["precision"]] == PLUGINS[run.precision]


def test_all_reduce_sums_and_averages_across_the_ranks(run: Run) -> None:
    for report in run.reports:  # rank r hands r + 1
        assert (report["collectives"]["all_reduce_sum"], report["collectives"]["all_reduce_mean"]) == (3.0, 1.5)


def test_all_gather_stacks_each_ranks_tensor_along_a_new_first_dimension(run: Run) -> None:
    for report in run.reports:  # rank r hands a 2x3 tensor of r
        assert report["collectives"]["all_gather_shape"] == [2, 2, 3]
        assert report["collectives"]["all_gather_values"] == [0.0, 1.0]


def test_all_gather_of_a_dict_keeps_each_tensors_dtype(run: Run) -> None:
    # Under apex O1 too, whose patches of torch would compute a float16 result from anything they touch.
    for report in run.reports:
        assert report["collectives"]["all_gather_dict"] == {
            "rank": [[2, 1], "int64", [0, 1]],
            "half": [[2, 1], "float16", [1.0, 1.0]],
        }


def test_broadcast_hands_every_rank_rank_zeros_object(run: Run) -> None:
    for report in run.reports:
        assert report["collectives"]["broadcast"] == {"from": 0, "list": [0, 0, 0]}


def test_fabric_print_prints_on_rank_zero_only(run: Run) -> None:
    assert "fabric.print from rank 0" in run.logs[0]
    assert "fabric.print from rank" not in run.logs[1]


#: The dtype of a float32 matmul outside, inside and after ``with fabric.autocast():``. Where the precision computes
#: under torch.autocast it is the autocast dtype inside only; apex O1 patched torch in amp.initialize, so every matmul
#: is float16 and fabric.autocast() changes nothing; apex O0/O2/O3 cast the models, not torch.
AUTOCAST = {
    precision: (
        ["float32", computes_in(precision), "float32"]
        if precision in CPU_AUTOCAST
        else ["float16"] * 3
        if precision in ("amp-O1", "apex-O1")
        else ["float32"] * 3
    )
    for precision in PRECISIONS
}


def test_fabric_autocast_casts_a_matmul_as_the_precision_does_and_changes_nothing_under_apex_o1(run: Run) -> None:
    for report in run.reports:
        autocast = report["autocast"]
        assert [autocast["outside"], autocast["inside"], autocast["after"]] == AUTOCAST[run.precision]


def test_apex_o2_and_o3_cast_every_model_to_float16_and_the_others_keep_float32(run: Run) -> None:
    expected = ["float16"] if run.precision in ("apex-O2", "apex-O3") else ["float32"]
    for report in run.reports:
        assert report["model_dtypes"] == dict.fromkeys(("generator", "discriminator", "transformer", "seq"), expected)


def seq_refusal(precision: str) -> str:
    """torch's own error for the sequence model under ``precision`` on this CPU (test_everyday.py asks torch); ""
    where torch runs it."""
    if precision not in CPU_AUTOCAST:
        return ""
    return torch_refuses_the_sequence_model(computes_in(precision))


def test_every_model_computes_in_the_precisions_dtype_in_training_and_evaluation(run: Run) -> None:
    dtype = [computes_in(run.precision)]
    for report in run.reports:
        dtypes = report["dtypes"]
        assert dtypes["generator"]["train"] == dtype
        assert dtypes["transformer_embed"] == {"train": dtype, "eval": dtype}
        if not seq_refusal(run.precision):
            assert dtypes["seq_lstm"] == {"train": dtype, "eval": dtype}  # apex O1: envddp's RNN fix lets it cast


def test_a_gan_trains_with_two_optimizers_to_finite_losses_and_weights(run: Run) -> None:
    for report in run.reports:
        gan = report["gan"]
        assert gan["steps"] == STEPS
        assert gan["losses_finite"] and gan["weights_finite"], gan["losses"]


def test_the_loss_scale_is_fixed_at_one_under_apex_o0_and_o3_and_dynamic_under_fp16_mixed_levels(run: Run) -> None:
    for report in run.reports:
        scales = report["gan"]["loss_scales"]
        if run.precision in ("apex-O0", "apex-O3"):
            assert scales == [1.0] * STEPS
        elif run.precision in ("amp-O1", "apex-O1", "apex-O2"):
            assert scales == [2.0**16] * STEPS  # apex's first dynamic scale; no overflow in these steps
        elif run.precision.startswith("native"):
            # GradScaler starts at 2**16 and halves on each overflow it skips a step for.
            assert all(2.0**10 <= scale <= 2.0**16 and math.log2(scale).is_integer() for scale in scales)
        else:
            assert scales == [None] * STEPS  # Lightning's plugins: no AmpPrecision, no loss scale to ask for


def test_loss_id_under_lightnings_own_precisions_is_refused_at_fabric_backward_naming_the_fix(run: Run) -> None:
    for report in run.reports:
        if report["plugin"]["type"] == "AmpPrecision":
            assert "loss_id_refused" not in report  # taken: two loss scalers (num_losses=2)
            continue
        precision = report["plugin"]["precision"]
        assert report["loss_id_refused"].startswith(
            "PrecisionConfigurationError: loss_id=0: fabric.backward(loss, loss_id=..., optimizers=...) under"
            f" precision {precision!r}: only AmpPrecision takes loss_id and optimizers"
        ), report["loss_id_refused"]
        assert "Fix: call fabric.backward(loss) under Lightning's precisions" in report["loss_id_refused"]


def test_adams_default_eps_is_refused_at_setup_under_apex_o3_and_its_fix_trains(run: Run) -> None:
    for report in run.reports:
        if run.precision != "apex-O3":
            assert "setup_refused" not in report
            continue
        refused = report["setup_refused"]
        assert refused.startswith(
            "eps=1e-08: setup_models(fabric, models, optimizer) under precision 'apex-O3' steps the float16 weights"
            " themselves, where Adam's eps rounds to 0"
        ), refused
        assert "Fix: pass Adam(..., eps=1e-4)" in refused and "precision='apex-O2'" in refused
        # The worker then set up again with eps=1e-4: one amp.initialize, after the refusal, and the GAN trains.
        assert report["gan"]["weights_finite"]


def test_a_second_setup_is_refused_under_apex_naming_the_call_and_trains_elsewhere(run: Run) -> None:
    for report in run.reports:
        if uses_apex(run):
            assert report["second_setup_refused"].startswith(
                f"call='fabric.setup(model, optimizer)': under precision 'apex-{run.precision[-2:]}' it would call"
                " amp.initialize again, but apex supports one amp.initialize per process"
            )
            assert "setup_models(fabric, [model_a, model_b], optimizer)" in report["second_setup_refused"]
        else:
            assert "second_setup_refused" not in report
            assert report["second_setup"] == {"weights_finite": True}


def check_trained(trained: dict[str, Any]) -> None:
    assert trained["steps"] == STEPS
    assert trained["losses_finite"] and trained["weights_finite"]
    assert trained["moved"] > 0
    evaluation = trained["eval"]
    assert evaluation["samples"] == EVAL_SAMPLES and evaluation["finite"]
    assert not evaluation["requires_grad"]  # torch.no_grad()
    assert evaluation["was_training_after"]


def test_a_transformer_trains_then_evaluates_in_eval_mode_without_gradients(run: Run) -> None:
    for report in run.reports:
        check_trained(report["transformer"])


def test_the_sequence_model_trains_and_evaluates_wherever_torch_runs_its_lstm(run: Run) -> None:
    refused = seq_refusal(run.precision)
    for report in run.reports:
        if refused:
            assert report["seq_failed"]["message"] == refused  # torch's own error, as torch raises it alone
            continue
        assert "seq_failed" not in report, report["seq_failed"]["trace"]
        check_trained(report["seq"])


@pytest.mark.parametrize("model", ["transformer", "seq"])
def test_all_gather_of_the_evaluation_loss_holds_each_ranks_mean_on_both_ranks(run: Run, model: str) -> None:
    if model == "seq" and seq_refusal(run.precision):
        pytest.skip(f"torch refuses the LSTM under {run.precision} on this CPU")
    means = [sum(report[model]["eval"]["losses"]) / 2 for report in run.reports]  # 2 batches a rank
    for report in run.reports:
        assert report[model]["eval"]["gathered"] == pytest.approx(means, rel=1e-6)


def test_fabric_log_and_log_dict_write_rank_zeros_values_to_the_csv_logger(run: Run) -> None:
    with (run.out / "csv" / "fabric" / "version_0" / "metrics.csv").open() as file:
        written: dict[str, dict[str, float]] = {}
        for row in csv.DictReader(file):
            step = row.pop("step")
            written.setdefault(step, {}).update({name: float(value) for name, value in row.items() if value})
    logged = run.reports[0]["logged"]
    assert set(logged) == {"0", "1", "2", "100"}
    assert written == logged
    assert all_finite([value for values in logged.values() for value in values.values()])
    names = {name for step in ("0", "1", "2") for name in logged[step]}
    expected = {"d_loss", "g_loss", "transformer_loss"} | ({"seq_loss"} if not seq_refusal(run.precision) else set())
    assert names == expected
    assert logged["100"] == {"collectives_sum": 3.0}


# In one process (no launcher: envddp trains alone): the two refusals this matrix asked of the package.


@needs_cpu_fp16
@pytest.mark.parametrize("flag", ["apex-O3", "native-O3"])
def test_an_eps_that_rounds_to_zero_in_float16_is_refused_before_amp_initialize(
    flag: str, apex_double: ModuleType
) -> None:
    fabric = fabric_for(flag)
    model = torch.nn.Linear(8, 4)
    with pytest.raises(PrecisionConfigurationError) as raised:
        setup_models(fabric, [model], torch.optim.Adam(model.parameters()))
    message = str(raised.value)
    assert message.startswith(f"eps=1e-08: setup_models(fabric, models, optimizer) under precision {flag!r}")
    assert f"precision={flag[:-2] + 'O2'!r}" in message
    # Refused before amp.initialize: the fix runs in the same process, and trains to finite weights.
    [model], optimizer = setup_models(fabric, [model], torch.optim.Adam(model.parameters(), eps=1e-4))
    for _ in range(2):
        optimizer.zero_grad()
        fabric.backward(torch.relu(model(torch.randn(4, 8))).float().pow(2).mean())
        optimizer.step()
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


@needs_cpu_fp16
def test_an_eps_float16_holds_and_an_optimizer_without_eps_are_taken_under_apex_o3(apex_double: ModuleType) -> None:
    fabric = fabric_for("apex-O3")
    model_a, model_b = torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)
    setup_models(
        fabric,
        [model_a, model_b],
        torch.optim.Adam(model_a.parameters(), eps=1e-4),
        torch.optim.SGD(model_b.parameters(), lr=0.1),
    )


@pytest.mark.parametrize("argument", ["loss_id", "optimizers", "delay_unscale"])
def test_an_amp_precision_argument_of_backward_is_refused_under_lightnings_precision_before_backward(
    argument: str,
) -> None:
    fabric = fabric_for("32-true")
    model, optimizer = fabric.setup(*model_and_optimizer())
    value = {"loss_id": 1, "optimizers": optimizer, "delay_unscale": True}[argument]
    with pytest.raises(PrecisionConfigurationError) as raised:
        fabric.backward(model(torch.randn(2, 8)).sum(), **{argument: value})
    assert f"fabric.backward(loss, {argument}=...) under precision '32-true'" in str(raised.value)
    assert all(parameter.grad is None for parameter in model.parameters())  # no backward ran


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("native-O1", "torch.autocast(float16) with dynamic loss scaling; the inputs and outputs keep the dtypes"),
        ("native-O3", "the selected modules (or the whole model) cast to float16, no loss scaling"),
    ],
)
def test_fabrics_amp_precision_says_what_it_computes_and_how_it_differs_from_fabrics_mixed(
    flag: str, says: str, no_apex: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Fabric's own 16-mixed / bf16-mixed cast the inputs to half and the outputs to fp32; AmpPrecision casts neither, as
    # the apex recipe and a hand-written torch.autocast loop do: a script switching over is told in one line.
    with caplog.at_level(logging.INFO):
        fabric = fabric_for(flag)
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("AmpPrecision:")]
    assert len(lines) == 1 and says in lines[0], lines
    assert ("Fabric's own '16-mixed' casts floating inputs to float16 and outputs to float32" in lines[0]) == (
        flag == "native-O1"
    )
    model, _ = fabric.setup(*model_and_optimizer())
    if flag == "native-O1":  # what the line says: the output as autocast made it, the input as the script made it
        seen: list[torch.dtype] = []
        model.module[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        assert model(torch.randn(2, 8)).dtype == torch.float16
        assert seen == [torch.float32]
