"""``lightning-ddp-amp compare``: the user's command, run unchanged under each precision, and the report on them.

The runs are real: one-process runs of ``workers/compare_train.py`` (a plain Lightning script that never imports the
package) and two ranks under torchrun of ``examples/two_models_one_optimizer.py``. The report's numbers are checked
against a plain-torch loop with formulas written here, not against compare's own code.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import typing
import warnings
from copy import deepcopy
from pathlib import Path
from types import ModuleType, UnionType
from typing import Any

import lightning.fabric
import lightning.pytorch as pl
import numpy
import pytest
import torch
import typing_extensions
from conftest import CPU_FP16_MISSING, DOUBLES, WORKERS, needs_cpu_fp16, worker_env
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy

import lightning_ddp_amp
from lightning_ddp_amp import AmpPrecision, EnvDDPStrategy, StrategyConfigurationError
from lightning_ddp_amp.commands.compare import command as compare
from lightning_ddp_amp.commands.compare import patching as compare_patching
from lightning_ddp_amp.commands.compare import picture as compare_picture
from lightning_ddp_amp.commands.compare import recorder as compare_recorder
from lightning_ddp_amp.commands.compare import report as compare_report
from lightning_ddp_amp.commands.compare import run_precision, terminal
from lightning_ddp_amp.commands.compare import schema as compare_schema
from lightning_ddp_amp.commands.compare import summary as compare_summary
from lightning_ddp_amp.commands.compare import verdict as compare_verdict
from lightning_ddp_amp.commands.compare.candidate import Candidate
from lightning_ddp_amp.commands.compare.run_folder import (
    FINAL_WEIGHTS,
    PLAN_VARIABLE,
    RECORD_FILE,
    START_WEIGHTS,
    Plan,
    snapshot_file,
)
from lightning_ddp_amp.commands.compare.tolerance import Metric, Tolerance

REPO = Path(__file__).parent.parent
SCRIPT = str(WORKERS / "compare_train.py")
EXAMPLE = str(REPO / "examples" / "two_models_one_optimizer.py")
SCHEMA = json.loads((REPO / "docs" / "compare.schema.json").read_text())
STEPS = 12


def run_compare(
    cwd: Path, *args: str, apex_double: bool = False, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_ddp_amp compare ARGS`` in ``cwd``, output merged; a hang fails after ``timeout``.

    The checkout is on ``PYTHONPATH``, so that a command may also be ``python -m tests.workers.compare_train``.
    """
    env = worker_env(apex_double=apex_double)
    env["PYTHONPATH"] = os.pathsep.join([*filter(None, [env.get("PYTHONPATH")]), str(REPO)])
    return subprocess.run(
        [sys.executable, "-m", "lightning_ddp_amp", "compare", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def script(*args: str) -> list[str]:
    return ["--", sys.executable, SCRIPT, *args]


def candidate(report: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = (entry for entry in report["candidates"] if entry["name"] == name)
    return found


def relative(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference)


def block(output: str, name: str) -> list[str]:
    """The lines of one run's block in compare's terminal report: from ``NAME  STATUS`` to the blank line."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{name}  ") and line.split()[0] == name)
    return lines[start : lines.index("", start)]


class LearningRates:
    """One compare of the same script at lr 0.1 (three times: run as a file, as ``python -m``, and under torchrun
    --max-restarts=1 crashing once at step 2) and 0.11, with min_steps far beyond --steps, and two candidates that
    fail: one crashes, one runs apex under Lightning's ddp strategy, which the package refuses."""

    def __init__(self, root: Path) -> None:
        self.cwd = root
        # The baseline validates after fit, which sets the strategy up again; the second run starts a helper process
        # that fails, as a probe does, and still succeeds.
        baseline = script("--min-steps", "1000", "--validate-after")
        as_module = [
            "--",
            sys.executable,
            "-m",
            "tests.workers.compare_train",
            "--min-steps",
            "1000",
            "--helper-raises",
        ]
        restarted = [
            "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--max-restarts=1", SCRIPT,
            "--min-steps", "1000", "--crash-at", "2", "--crash-once",
        ]  # fmt: skip
        self.result = run_compare(
            root, "32-true", "32-true", "32-true", "32-true", "apex-O1", "32-true", "--steps", str(STEPS),
            "--grad-norm-every", "5", "--out", "out", *baseline, *as_module, *script("--min-steps", "1000", "--lr", "0.11"),
            *script("--crash-at", "1"), *script("--strategy", "ddp"), *restarted,
            apex_double=True,
            timeout=600,
        )  # fmt: skip
        self.out = root / "out"
        self.report = json.loads((self.out / "compare.json").read_text())
        self.compared = [entry for entry in self.report["candidates"] if entry["status"] != "failed"]


@pytest.fixture(scope="module")
def learning_rates(tmp_path_factory: pytest.TempPathFactory) -> LearningRates:
    return LearningRates(tmp_path_factory.mktemp("learning_rates"))


def test_each_run_stops_after_the_steps_asked_even_below_the_scripts_min_steps(learning_rates: LearningRates) -> None:
    for entry in learning_rates.compared:
        assert entry["series"]["step"] == list(range(STEPS)), learning_rates.result.stdout[-3000:]


def test_a_candidate_apart_exits_1_and_names_the_first_step_it_left_the_tolerance(
    learning_rates: LearningRates,
) -> None:
    report, output = learning_rates.report, learning_rates.result.stdout
    assert learning_rates.result.returncode == 1, output[-3000:]
    same, faster = candidate(report, "32-true#2"), candidate(report, "32-true#3")
    assert same["status"] == "identical" and same["summary"]["weight_distance"] == 0
    assert "32-true#2: IDENTICAL: the baseline's loss at every step and its final weights, bit for bit" in output
    assert faster["status"] == "apart"
    base = candidate(report, "32-true")["series"]["loss"]
    expected = next(
        i for i, (a, b) in enumerate(zip(faster["series"]["loss"], base, strict=True)) if relative(a, b) > 0.02
    )
    assert faster["summary"]["first_step_apart"] == expected
    assert "32-true#3: APART: " in output
    assert f"  first step apart  {expected}" in block(output, "32-true#3")
    for name in ("32-true", "32-true#2", "32-true#5"):  # the baseline, and runs that never left the tolerance
        assert not any(line.startswith("  first step apart") for line in block(output, name)), name


def test_each_record_holds_the_hash_of_the_first_batch_its_run_trained(learning_rates: LearningRates) -> None:
    # The recording's side of the first-batch check (the report's side: a hand-edited record, below). The script's
    # loader does not shuffle: the first batch is the dataset's first 8 (x, y, index) triples.
    sys.path.insert(0, str(WORKERS))
    try:
        from common import dataset
    finally:
        sys.path.remove(str(WORKERS))
    digest = hashlib.sha256()  # names (positions in the batch), dtypes, shapes, then the bytes, tensor by tensor
    for position, tensor in enumerate(dataset(64, seed=1)[:8]):
        digest.update(f"{position}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for entry in learning_rates.compared:
        record = json.loads((Path(entry["directory"]) / "record.json").read_text())
        assert [rank["batch_hash"] for rank in record["ranks"]] == [digest.hexdigest()], entry["name"]


def test_each_record_holds_the_hash_of_the_weights_its_run_started_from(learning_rates: LearningRates) -> None:
    # The recording's side of the same-start check (the report's side: a hand-edited record, below): the model as the
    # script builds it, seeded; unseeded, it would be another model.
    sys.path.insert(0, str(WORKERS))
    try:
        from compare_train import build
    finally:
        sys.path.remove(str(WORKERS))

    def sha256(state: dict[str, torch.Tensor]) -> str:
        digest = hashlib.sha256()  # names, dtypes, shapes, then the bytes, tensor by tensor
        for name, tensor in state.items():
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    seeded = sha256(build(0.1)[0].state_dict())
    assert sha256(build(0.1, seeded=False)[0].state_dict()) != seeded
    for entry in learning_rates.compared:
        record = json.loads((Path(entry["directory"]) / "record.json").read_text())
        assert [rank["weights_hash"] for rank in record["ranks"]] == [seeded], entry["name"]


def test_a_one_process_compare_whose_only_problem_is_a_candidate_apart_exits_1(
    learning_rates: LearningRates, tmp_path: Path
) -> None:
    # The fixture's compare also has failed candidates, so its exit status says nothing about an apart one alone:
    # its baseline and its lr-0.11 run (real one-process records), reported as a compare of only those two.
    runs = [
        Candidate(
            name, "32-true", ["python", "t.py"], Path(candidate(learning_rates.report, name)["directory"]), returncode=0
        )
        for name in ("32-true", "32-true#3")
    ]
    report = compare_report.build(runs, Tolerance(), steps=STEPS, argv=[])
    assert [entry["status"] for entry in report["candidates"]] == ["baseline", "apart"]
    assert report["problem"] is None
    assert compare_report.write(report, tmp_path) == 1  # compare's exit status


def test_the_report_agrees_with_a_plain_torch_loop(learning_rates: LearningRates) -> None:
    sys.path.insert(0, str(WORKERS))
    try:
        from compare_train import build
    finally:
        sys.path.remove(str(WORKERS))

    norms: list[float] = []

    def train(lr: float) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        model, loader = build(lr)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        batches, losses = list(loader), []
        norms.clear()
        for step in range(STEPS):
            x, y, _ = batches[step % len(batches)]
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model.net(x), y)
            loss.backward()
            norms.append(float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))))
            optimizer.step()
            losses.append(loss.item())
        return losses, start, model.state_dict()

    base_losses, start, base = train(0.1)
    base_norms = list(norms)
    losses, _, weights = train(0.11)
    tail = max(1, STEPS // 10)  # the documented final loss: the mean of the last tenth of the steps
    final_difference = relative(sum(losses[-tail:]) / tail, sum(base_losses[-tail:]) / tail)
    apart = math.sqrt(sum(float((weights[k] - base[k]).square().sum()) for k in base))
    travel = math.sqrt(sum(float((base[k] - start[k]).square().sum()) for k in base))
    summary = candidate(learning_rates.report, "32-true#3")["summary"]
    assert summary["final_loss_relative_difference"] == pytest.approx(final_difference, rel=1e-4)
    assert summary["weight_distance"] == pytest.approx(apart / travel, rel=1e-4)
    series = candidate(learning_rates.report, "32-true")["series"]
    assert series["loss"] == pytest.approx(base_losses, rel=1e-5)
    every = 5  # --grad-norm-every 5: the gradient norm at steps 0, 5 and 10, None between
    assert series["grad_norm"][::every] == pytest.approx(base_norms[::every], rel=1e-5) and every < STEPS
    assert [value is None for value in series["grad_norm"]] == [step % every != 0 for step in range(STEPS)]


def test_files_go_to_each_candidates_folder_never_to_the_scripts(learning_rates: LearningRates) -> None:
    assert sorted(path.name for path in learning_rates.cwd.iterdir()) == ["out"]  # no script_logs, script_checkpoints
    for entry in learning_rates.compared:
        folder = Path(entry["directory"])
        assert list((folder / "checkpoints").glob("*.ckpt")), entry["name"]
        assert (folder / "logs" / "lightning_logs" / "version_0").is_dir(), entry["name"]  # the CSVLogger
        assert (folder / FINAL_WEIGHTS).is_file()
        # The run's own output, kept as it was shown.
        assert (
            f"lightning-ddp-amp compare [{entry['name']}]"
            in (folder / "stdout.log").read_text() + (folder / "stderr.log").read_text()
        )
    crashed = Path(candidate(learning_rates.report, "32-true#4")["directory"])
    assert "RuntimeError: the model crashed at step 1" in (crashed / "stderr.log").read_text()


def test_rank_zero_says_once_what_was_replaced(learning_rates: LearningRates) -> None:
    output = learning_rates.result.stdout
    for name in ("32-true", "32-true#2", "32-true#3"):
        assert output.count(f"lightning-ddp-amp compare [{name}]: this run's Trainer was changed:") == 1
    assert f"max_steps=-1 -> {STEPS}" in output
    assert "ModelCheckpoint(dirpath=" in output and "CSVLogger writes to" in output
    assert "precision='32-true' -> '32-true'" not in output  # the script's own precision: no change
    assert not any(line.startswith("precision=") for line in candidate(learning_rates.report, "32-true")["replaced"])


@pytest.mark.parametrize(
    ("script_precision", "listed"), [("bf16-mixed", []), ("32-true", ["'32-true' -> 'bf16-mixed'"])]
)
def test_the_precision_is_listed_as_a_change_only_where_the_run_changes_it(
    script_precision: str, listed: list[str], tmp_path: Path
) -> None:
    defaults = compare_patching._trainer_defaults(pl.Trainer, inspect.signature(pl.Trainer.__init__), pl)
    changes = compare_recorder.Changes()
    plan = Plan("bf16-mixed", "bf16-mixed", STEPS, str(tmp_path))
    compare_patching._replace_arguments({"precision": script_precision}, defaults, plan, changes, pl)
    said = [change.removeprefix("precision=") for change in changes.replaced if change.startswith("precision=")]
    assert said == listed


def test_compare_json_follows_the_documented_schema(learning_rates: LearningRates) -> None:
    assert learning_rates.report["versions"]["torch"] == torch.__version__
    # The apex the runs imported: the CPU test double, from this repository (no package metadata).
    assert learning_rates.report["apex"] == {
        "location": str(DOUBLES / "apex"),
        "version": "test double",
        "test_double": True,
    }
    assert learning_rates.report["versions"]["apex"] == "test double"
    assert learning_rates.report["command"][:2] == ["lightning-ddp-amp", "compare"]
    assert_matches(learning_rates.report, SCHEMA)


def test_the_picture_has_eight_titled_panels_whose_series_equal_the_json_under_a_title_saying_what_ran_where(
    learning_rates: LearningRates,
) -> None:
    image = pytest.importorskip("matplotlib.image", reason="the [compare] extra is not installed (make test has it)")

    picture = image.imread(learning_rates.out / "compare.png")
    assert picture.shape[:2] == (1280, 1120)
    report = learning_rates.report
    figure = compare_picture.plot(report, learning_rates.cwd / "again.png")
    title = figure.get_suptitle()
    assert "lightning-ddp-amp compare 32-true 32-true" in title and f"torch {torch.__version__}" in title
    assert report["hardware"] in title and "apex test double" in title
    assert [axis.get_title() for axis in figure.axes] == [title for title, _ in compare_picture.PANELS]
    colours: dict[str, set[str]] = {}  # a run is one colour in every panel, whichever runs a panel leaves out
    for axis, (name, key) in zip(figure.axes, compare_picture.PANELS, strict=True):
        if key == "metrics":
            continue
        if key == "loss_scale":  # float32 runs only: the panel says so instead of an empty axis
            assert not axis.get_lines() and list(axis.get_yticks()) == []
            assert [text.get_text() for text in axis.texts] == [compare_picture.NO_LOSS_SCALE]
            continue
        lines = {
            line.get_label().split(", same curve as ")[0]: line
            for line in axis.get_lines()
            if not line.get_label().startswith(("_", "tolerance"))
        }
        for label, line in lines.items():
            colours.setdefault(label, set()).add(str(line.get_color()))
        drawn = ["32-true#2", "32-true#3", "32-true#4", "32-true#5"]  # the crashed #4 keeps the step it took
        if key not in ("relative_loss_difference", "weight_distance"):
            drawn.insert(0, "32-true")
        if key in ("relative_loss_difference", "weight_distance", "step_time_s"):
            drawn.remove("32-true#4")  # never compared; its one step is the warm-up, which step times leave out
        assert sorted(lines) == sorted(f"{n} ({candidate(report, n)['status']})" for n in drawn), name
        for label, line in lines.items():
            entry = candidate(report, label.split(" ")[0])
            xs, ys = compare_picture.points(entry, key)
            assert list(line.get_xdata()) == xs
            assert list(line.get_ydata()) == pytest.approx(ys, nan_ok=True)
    # Differences in percent; the step times without the warm-up step; the tolerance drawn where distances are.
    differences = compare_picture.points(candidate(report, "32-true#3"), "relative_loss_difference")[1]
    series = candidate(report, "32-true#3")["series"]
    assert differences == pytest.approx([100 * v for v in series["relative_loss_difference"]])
    assert compare_picture.points(candidate(report, "32-true"), "step_time_s")[0][0] == 1
    assert all(len(found) == 1 for found in colours.values()), colours
    assert len({colour for found in colours.values() for colour in found}) == len(colours)
    for axis, tolerance in ((figure.axes[1], "loss"), (figure.axes[2], "weights")):
        value = 100 * report["tolerance"][tolerance]
        (line,) = [line for line in axis.get_lines() if line.get_label() == f"tolerance {value:.3g}%"]
        assert list(line.get_ydata()) == [value] * 2


def test_curves_that_lie_on_each_other_take_turns_and_the_legend_names_the_run_each_covers(
    learning_rates: LearningRates,
) -> None:
    image = pytest.importorskip("matplotlib.image", reason="the [compare] extra is not installed (make test has it)")
    from matplotlib.colors import to_rgb

    # 32-true#2 and #5 trained as the baseline did: three equal loss curves, each still seen.
    figure = compare_picture.plot(learning_rates.report, learning_rates.cwd / "turns.png")
    loss = figure.axes[0]
    assert [text.get_text() for text in loss.get_legend().get_texts()] == [
        "32-true (baseline)",
        "32-true#2 (identical), same curve as 32-true",
        "32-true#3 (apart)",
        "32-true#4 (failed)",
        "32-true#5 (identical), same curve as 32-true",
    ]
    loss.get_legend().set_visible(False)
    figure.savefig(learning_rates.cwd / "turns.png", dpi=figure.dpi)  # pixels where the window extents say
    pixels = image.imread(learning_rates.cwd / "turns.png")[..., :3]
    box = loss.get_window_extent()
    panel = pixels[int(pixels.shape[0] - box.y1) : int(pixels.shape[0] - box.y0), int(box.x0) : int(box.x1)]
    colours = {line.get_label().split(" ")[0]: line.get_color() for line in loss.get_lines()}
    for name in ("32-true", "32-true#2", "32-true#5"):
        seen = int((numpy.linalg.norm(panel - numpy.array(to_rgb(colours[name])), axis=-1) < 0.1).sum())
        assert seen > 50, (name, seen)


def test_the_difference_panels_start_at_zero_and_say_their_tolerance_in_the_legend(
    learning_rates: LearningRates,
) -> None:
    pytest.importorskip("matplotlib", reason="the [compare] extra is not installed (make test has it)")
    figure = compare_picture.plot(learning_rates.report, learning_rates.cwd / "zero.png")
    for axis, tolerance in ((figure.axes[1], "2%"), (figure.axes[2], "5%")):
        assert axis.get_ylim()[0] == 0  # no room for a negative difference, which cannot happen
        assert f"tolerance {tolerance}" in [text.get_text() for text in axis.get_legend().get_texts()]
        assert not axis.texts  # no label on the line, which a legend could cover


def test_the_loss_scale_panel_draws_only_runs_with_a_scale_and_marks_each_skipped_step(overflows: Overflows) -> None:
    pytest.importorskip("matplotlib", reason="the [compare] extra is not installed (make test has it)")
    figure = compare_picture.plot(overflows.report, overflows.cwd / "scale.png")
    scale = figure.axes[3]
    assert [text.get_text() for text in scale.get_legend().get_texts()] == [
        "native-O1 (apart)",
        "apex-O1 (apart), same curve as native-O1",
    ]
    for line in scale.get_lines():
        assert line.get_marker() == compare_picture.SKIPPED_MARKER and line.get_markevery() == [5]  # step 5
        assert line.get_markeredgecolor() == "black"
    assert scale.get_lines()[0].get_markersize() >= 12 > scale.get_lines()[1].get_markersize()


def test_a_panel_without_a_run_to_draw_still_says_its_tolerance_and_matplotlib_warns_nothing(
    learning_rates: LearningRates,
) -> None:
    pytest.importorskip("matplotlib", reason="the [compare] extra is not installed (make test has it)")
    report = deepcopy(learning_rates.report)
    # The baseline and a run that crashed at its first step: no difference to draw, no step time after the warm-up.
    report["candidates"] = [candidate(report, "32-true"), candidate(report, "32-true#4")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend"
        figure = compare_picture.plot(report, learning_rates.cwd / "quiet.png")
    legends = [[text.get_text() for text in axis.get_legend().get_texts()] for axis in figure.axes[1:3]]
    assert legends == [["tolerance 2%"], ["tolerance 5%"]]


def test_without_matplotlib_the_table_and_json_are_written_and_one_line_says_how_to_get_the_picture(
    learning_rates: LearningRates, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets where it is not installed
    assert compare_report.write(learning_rates.report, tmp_path) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["compare.json"]
    assert (
        'no picture: matplotlib is not installed (pip install "lightning-ddp-amp[compare]")' in capsys.readouterr().out
    )


def test_the_reports_first_line_says_how_many_steps_the_runs_took_beside_steps_where_the_script_stopped_sooner(
    learning_rates: LearningRates,
) -> None:
    assert f"\ncompare: 6 runs of {STEPS} steps, baseline 32-true, on " in learning_rates.result.stdout
    # The same runs, as if the script's max_epochs had ended them after 5 steps, one of them after 7.
    report = json.loads(json.dumps(learning_rates.report))
    for entry in report["candidates"]:
        if entry["series"] is not None:
            entry["series"]["step"] = entry["series"]["step"][:5]
    first = terminal.render(report).splitlines()[1]
    assert first.startswith(
        f"compare: 6 runs of 5 steps (--steps {STEPS}; the script's max_steps or max_epochs stopped them sooner),"
    )
    candidate(report, "32-true#2")["series"]["step"] = list(range(7))
    assert terminal.render(report).splitlines()[1].startswith(f"compare: 6 runs of 5 to 7 steps (--steps {STEPS};")


def test_failed_candidates_are_named_with_their_error_and_the_others_still_compared(
    learning_rates: LearningRates,
) -> None:
    output = learning_rates.result.stdout
    assert "32-true#4: FAILED: RuntimeError in the script: the model crashed at step 1" in output
    # The crashed run keeps the step it took, as its rank wrote it when the exception came.
    crashed = candidate(learning_rates.report, "32-true#4")
    assert crashed["series"]["step"] == [0] and crashed["summary"] is None
    assert crashed["series"]["loss"] == candidate(learning_rates.report, "32-true")["series"]["loss"][:1]
    assert "the model crashed at step 1 (after 1 step, kept in compare.json)" in " ".join(output.split())
    # The package's own refusal of apex under a strategy that wraps the model before the precision plugin runs.
    assert "apex-O1: FAILED: PrecisionConfigurationError in the script: strategy=" in output
    statuses = [entry["status"] for entry in learning_rates.report["candidates"]]
    assert statuses == ["baseline", "identical", "apart", "failed", "failed", "identical"]


class Overflows:
    """One compare of ``compare_train.py`` validating every 4 batches and testing after fit, whose ``net.2`` leaves
    float16's range at step 5 (``(x * 1e5) / 1e5``: nothing in float32): the float32 baseline, its noise-floor run,
    and torch's AMP and the apex double at O1."""

    def __init__(self, root: Path) -> None:
        self.cwd = root
        command = script("--val-every", "4", "--test-after", "--gain", "1e5", "--gain-at", "5")
        self.result = run_compare(
            root, "32-true", "native-O1", "apex-O1", "--noise-floor", "--steps", str(STEPS),
            "--metric", "val_within:0.5", "--out", "out", *command,
            apex_double=True,
            timeout=600,
        )  # fmt: skip
        self.out = root / "out"
        self.report = json.loads((self.out / "compare.json").read_text())


@pytest.fixture(scope="module")
def overflows(tmp_path_factory: pytest.TempPathFactory) -> Overflows:
    if CPU_FP16_MISSING is not None:
        pytest.skip(CPU_FP16_MISSING)
    return Overflows(tmp_path_factory.mktemp("overflows"))


def logged(entry: dict[str, Any]) -> list[dict[str, float]]:
    """What the run's CSVLogger wrote in validation and test, row by row: an independent record of the metrics."""
    import csv

    (path,) = Path(entry["directory"]).glob("logs/lightning_logs/version_*/metrics.csv")
    rows = []
    for row in csv.DictReader(path.open()):
        values = {k: float(v) for k, v in row.items() if v and k.startswith(("val_", "test_"))}
        if values:
            rows.append({**values, "step": int(row["step"])})
    return rows


def test_every_validation_and_test_run_keeps_what_the_script_logged_as_its_logger_wrote_it(
    overflows: Overflows,
) -> None:
    assert overflows.result.returncode in (0, 1), overflows.result.stdout[-3000:]  # a skip may put fp16 apart
    for entry in overflows.report["candidates"]:
        evaluations = entry["evaluations"]
        assert [(e["stage"], e["step"]) for e in evaluations] == [
            ("validate", 4), ("validate", 8), ("validate", 12), ("test", 12),
        ], entry["name"]  # fmt: skip
        # Lightning's CSV rows are at the step before (its loggers count from 0) and hold the same values.
        rows = logged(entry)
        assert [sorted(e["metrics"]) for e in evaluations] == [sorted(set(row) - {"step"}) for row in rows]
        for evaluation, row in zip(evaluations, rows, strict=True):
            ours = {k: math.nan if v is None else v for k, v in evaluation["metrics"].items()}  # JSON: NaN is null
            assert ours == pytest.approx({k: v for k, v in row.items() if k != "step"}, rel=1e-6, nan_ok=True)


def test_the_report_sets_each_metrics_last_value_beside_the_baselines_and_metric_joins_the_verdict(
    overflows: Overflows, tmp_path: Path
) -> None:
    report, base = overflows.report, candidate(overflows.report, "32-true")
    native = candidate(report, "native-O1")
    for name, stage in (("val_loss", "validate"), ("val_within", "validate"), ("test_loss", "test")):
        value = next(e["metrics"][name] for e in reversed(native["evaluations"]) if name in e["metrics"])
        baseline = next(e["metrics"][name] for e in reversed(base["evaluations"]) if name in e["metrics"])
        assert native["summary"]["metrics"][name] == pytest.approx(
            {"stage": stage, "value": value, "baseline": baseline, "difference": value - baseline,
             "relative_difference": abs(value - baseline) / abs(baseline)}
        )  # fmt: skip
        assert f"  {name:<18}{value:.6g}, baseline {baseline:.6g}, difference {value - baseline:+.3g} ({stage})" in (
            block(overflows.result.stdout, "native-O1")
        )
    assert report["metrics"] == [{"name": "val_within", "tolerance": "0.5"}]
    # The same records, judged on test_loss with a tolerance just under and just over its difference.
    difference = abs(native["summary"]["metrics"]["test_loss"]["difference"])
    assert difference > 0
    runs = [
        Candidate(e["name"], e["precision"], e["command"], Path(e["directory"]), returncode=0, role=e["role"])
        for e in (base, native)
    ]
    tight = Metric("test_loss", difference * 0.99)
    apart = compare_report.build(runs, Tolerance(1, 1), steps=STEPS, argv=[], metrics=[tight])
    assert apart["candidates"][1]["status"] == "apart"
    assert (
        f"test_loss {native['summary']['metrics']['test_loss']['value']:.6g} against the baseline's"
        in (apart["candidates"][1]["reason"])
    )
    loose = Metric("test_loss", None, 1.01 * difference / abs(base["summary"]["metrics"]["test_loss"]["value"]))
    close = compare_report.build(runs, Tolerance(1, 1), steps=STEPS, argv=[], metrics=[loose])
    assert close["candidates"][1]["status"] == "close"


@pytest.mark.parametrize("tolerance", ["1%", "0.01"])
def test_a_metric_tolerance_ending_in_percent_is_relative_and_a_number_absolute(tolerance: str) -> None:
    # --metric val_acc:1% is 1% of the baseline's value; val_acc:0.01 the same here, against a baseline of 1.0: half a
    # percent off is close, one and a half apart.
    metric = Metric.parse(f"val_acc:{tolerance}")
    assert metric.name == "val_acc" and metric.tolerance_text() == tolerance
    assert metric.within(1.005, 1.0) and metric.within(0.995, 1.0)
    assert not metric.within(1.015, 1.0) and not metric.within(0.985, 1.0)
    # Relative to the baseline's own scale: 1% of 50 is 0.5.
    assert metric.within(50.4, 50.0) is (tolerance == "1%")


def test_a_metric_the_baseline_never_logged_stops_compare_before_any_other_run(tmp_path: Path) -> None:
    result = run_compare(
        tmp_path, "32-true", "bf16-mixed", "--steps", "4", "--metric", "val_acc", "--out", "out",
        *script("--val-every", "2"),
    )  # fmt: skip
    assert result.returncode == 2, result.stdout[-3000:]
    assert "compare: the baseline never logged a --metric: no other run is started" in result.stdout
    assert "it logged: val_loss, val_within" in " ".join(result.stdout.split())
    assert "compare [2/2]" not in result.stdout and not (tmp_path / "out" / "2-bf16-mixed").exists()
    assert (tmp_path / "out" / "1-32-true" / "record.json").is_file()
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert [entry["name"] for entry in report["candidates"]] == ["32-true"] and report["problem"]


def test_a_baseline_that_fails_stops_compare_before_any_other_run(tmp_path: Path) -> None:
    result = run_compare(
        tmp_path, "32-true", "bf16-mixed", "--noise-floor", "--out", "out",
        "--", sys.executable, "-c", "raise SystemExit(3)",
    )  # fmt: skip
    output = " ".join(result.stdout.split())
    assert result.returncode == 2, result.stdout[-3000:]
    assert "compare: the baseline 32-true failed: no other run is started" in output
    assert "compare [2/3]" not in output and sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "1-32-true",
        "compare.json",
    ]
    assert "compare: 1 run, baseline 32-true, on " in output  # one run, and no steps it did not take
    assert "32-true: FAILED: the command exited with status 3 (its output is above)" in output
    assert "NOT COMPARED: the baseline 32-true failed, so there is nothing to compare against" in output
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert [(entry["name"], entry["status"]) for entry in report["candidates"]] == [("32-true", "failed")]


def test_a_metric_the_baseline_never_logged_is_a_problem_naming_those_it_did(
    overflows: Overflows, tmp_path: Path
) -> None:
    base = candidate(overflows.report, "32-true")
    runs = [Candidate("32-true", "32-true", ["python"], Path(base["directory"]), returncode=0)]
    runs.append(Candidate("again", "32-true", ["python"], Path(base["directory"]), returncode=0))
    report = compare_report.build(runs, Tolerance(), steps=STEPS, argv=[], metrics=[
        Metric("val_acc")
    ])  # fmt: skip
    assert report["problem"] == (
        "--metric='val_acc': the baseline logged no such metric in validation or test (it logged: test_loss, val_loss,"
        " val_within). Fix: name one of those, or log it with self.log('val_acc', ...) in validation_step or"
        " test_step, and give the run a validation or test loader"
    )
    assert compare_report.write(report, tmp_path) == 2


def test_a_skipped_step_names_the_module_that_overflowed_its_dtype_and_largest_finite_value_and_the_recovery(
    overflows: Overflows,
) -> None:
    for name in ("native-O1", "apex-O1"):
        entry = candidate(overflows.report, name)
        (found,) = entry["overflows"]
        assert (found["step"], found["rank"], found["phase"]) == (5, 0, "forward")
        assert (found["module"], found["tensor"], found["dtype"]) == ("net.2", "output", "torch.float16")
        assert 0 < found["max_finite"] < 1  # the tanh outputs that came back finite from (x * 1e5) / 1e5
        assert found["loss_scale"] == 2.0**16
        summary = entry["summary"]
        assert summary["skipped_steps"] == [5] and summary["final_loss_scale"] == 2.0**15
        assert summary["scale_trend"]["recovered"] and not summary["scale_trend"]["model_problem"]
        lines = block(overflows.result.stdout, name)
        assert "  skipped steps     1 (5); loss scale 32768 at the end; it recovered" in lines
        assert any(
            line.startswith("  overflow          step 5: net.2, forward (output, torch.float16, largest finite")
            for line in lines
        )
    baseline = candidate(overflows.report, "32-true")
    assert baseline["overflows"] == [] and baseline["summary"]["scale_trend"] is None  # float32 holds 1e5


def falling(overflows: Overflows, root: Path) -> list[Candidate]:
    """The fixture's baseline and native-O1 runs, copied; the copy of native-O1 edited into a run that overflowed in
    net.2 at every step, its loss scale halving each time: what torch's AMP records on that model at gain 1e5."""
    runs = []
    for name, copy in (("32-true", "32-true"), ("native-O1", "native-O1#2")):
        entry = candidate(overflows.report, name)
        shutil.copytree(entry["directory"], root / copy)
        runs.append(Candidate(copy, entry["precision"], entry["command"], root / copy, returncode=0))
    (found,) = candidate(overflows.report, "native-O1")["overflows"]
    located = {key: value for key, value in found.items() if key != "rank"}  # the report adds the rank

    def every_step(rank: dict[str, Any]) -> None:
        rank["skipped"] = [True] * STEPS
        rank["loss_scale"] = [2.0 ** (16 - step) for step in range(STEPS)]
        rank["overflows"] = [{**located, "step": step, "loss_scale": 2.0 ** (16 - step)} for step in range(STEPS)]

    edit_record(runs[1], every_step)
    return runs


def test_a_loss_scale_that_keeps_falling_is_called_a_model_problem_naming_the_module_and_the_fixes(
    overflows: Overflows, tmp_path: Path
) -> None:
    report = compare_report.build(falling(overflows, tmp_path), Tolerance(), steps=STEPS, argv=[])
    entry = report["candidates"][1]
    assert entry["status"] == "apart"
    trend = entry["summary"]["scale_trend"]
    assert trend["model_problem"] and not trend["recovered"]
    lowest = 2.0 ** (16 - STEPS + 1)
    assert trend["lowest_loss_scale"] == lowest and trend["lowest_at_step"] == STEPS - 1
    assert trend["advice"].startswith(
        f"the loss scale kept falling (to {lowest:g} at step {STEPS - 1}): a model problem, not fp16's rounding: net.2"
        " (forward: output, torch.float16) overflows even with the loss unscaled. Fix: keep that module in fp32"
    )
    assert "bf16-mixed" in trend["advice"] and trend["advice"] in entry["reason"]
    said = " ".join(terminal.render(report).split())
    assert (
        f"{STEPS} (0, 1, 2, 3, 4, ...); loss scale {lowest:g} at the end; it did not recover (a model problem" in said
    )
    # A scale that fell once and went on is not a problem: the fixture's own native-O1 run.
    assert not candidate(overflows.report, "native-O1")["summary"]["scale_trend"]["model_problem"]


def test_the_noise_floor_run_is_the_baseline_one_ulp_off_reported_beside_every_distance(
    overflows: Overflows,
) -> None:
    report, output = overflows.report, overflows.result.stdout
    noise = candidate(report, "32-true~noise")
    assert (noise["status"], noise["role"]) == ("noise floor", "noise floor")
    assert noise["reason"] == "the baseline run again with every initial weight one ulp up"
    floor = report["noise_floor"]
    assert floor["candidate"] == "32-true~noise" and floor["weight_distance"] == noise["summary"]["weight_distance"]
    assert 0 < floor["weight_distance"] < 1e-4  # one ulp moves it, and by almost nothing
    start = torch.load(Path(candidate(report, "32-true")["directory"]) / "weights-start.pt")
    assert start  # the baseline's; the noise run started from it (comparable) and moved every weight one ulp
    percent = compare_verdict.percent(floor["weight_distance"])
    said = " ".join(output.split())  # the report wraps its lines at 100 columns
    assert (
        f"noise floor (32-true~noise: the baseline again, every initial weight one ulp up): weights {percent}" in said
    )
    for name in ("native-O1", "apex-O1"):
        assert any(f"noise floor {percent})" in line for line in block(output, name)), name


def test_step_time_and_memory_are_called_faster_or_slower_only_outside_their_spread(overflows: Overflows) -> None:
    report = overflows.report
    spread = report["spread"]
    base = candidate(report, "32-true")["summary"]["step_time_s"]
    noise = candidate(report, "32-true~noise")["summary"]
    assert spread["step_time_over_steps"] == pytest.approx((base["p75"] - base["p25"]) / (2 * base["median"]))
    assert spread["step_time_between_baseline_runs"] == pytest.approx(abs(noise["step_time_ratio"] - 1))
    assert spread["step_time"] == max(spread["step_time_over_steps"], spread["step_time_between_baseline_runs"])
    assert spread["peak_memory"] == pytest.approx(abs(noise["peak_memory_ratio"] - 1))
    for entry in report["candidates"][1:]:
        summary = entry["summary"]
        ratio, width = summary["step_time_ratio"], spread["step_time"]
        expected = "above" if ratio > 1 + width else "below" if ratio < 1 - width else "within the spread"
        assert summary["step_time_call"] == expected, entry["name"]
        said = {"above": "slower", "below": "faster", "within the spread": "not faster or slower"}[expected]
        assert any(f"x{ratio:.2f}: {said}" in line for line in block(overflows.result.stdout, entry["name"]))


def test_a_baseline_with_fewer_than_four_timed_steps_has_no_step_time_spread_and_calls_nothing() -> None:
    def entry(times: list[float]) -> dict[str, Any]:
        series = {"step": list(range(len(times))), "step_time_s": times, "slowed_steps": []}
        return {"series": series, "summary": {"step_time_s": compare_summary.step_times(series)}}

    assert compare_summary.spread(entry([0.5, 0.01, 0.01, 0.01]), None)["step_time"] is None  # 3 timed: quartiles 0
    assert compare_summary.call(1.5, None) is None
    spread = compare_summary.spread(entry([0.5, 0.01, 0.01, 0.02, 0.02]), None)["step_time"]
    assert spread == pytest.approx((0.02 - 0.01) / (2 * 0.015))


def test_the_weight_distance_is_measured_at_each_snapshot_against_the_baselines_weights_there(
    overflows: Overflows,
) -> None:
    report = overflows.report
    snapshots = [round(STEPS * i / compare.DEFAULT_SNAPSHOTS) for i in range(1, compare.DEFAULT_SNAPSHOTS)]
    base = Path(candidate(report, "32-true")["directory"])
    for step in snapshots:
        assert (base / f"weights-step{step}.pt").is_file()
    for entry in report["candidates"][1:]:
        steps = [step for step, _ in entry["series"]["weight_distance"]]
        assert steps == [*snapshots, STEPS], entry["name"]
        assert entry["series"]["weight_distance"][-1][1] == entry["summary"]["weight_distance"]
        assert entry["series"]["slowed_steps"] == snapshots  # after N steps done, step N (counted from 0) waits
    # Before step 5 the float16 runs trained as the baseline did, within fp16's rounding; after the skip they lag.
    native = dict(candidate(report, "native-O1")["series"]["weight_distance"])
    assert native[2] < 0.05 and native[STEPS] > native[2]


def test_the_terminal_report_fits_100_columns_with_four_candidates_and_a_noise_floor(
    overflows: Overflows, tmp_path: Path
) -> None:
    report = overflows.result.stdout.split("\ncompare: 4 runs of", 1)[1]
    assert max(len(line) for line in report.splitlines()) <= 100
    assert "net.0" not in report  # the per-submodule distances are in compare.json only
    # Four candidates, one of them a model problem with the longest verdict there is, beside a noise floor.
    runs = falling(overflows, tmp_path)
    for index, name in enumerate(("32-true~noise", "apex-O1", "native-O1")):
        entry = candidate(overflows.report, name)
        shutil.copytree(entry["directory"], tmp_path / name)
        role = "noise floor" if index == 0 else "candidate"
        runs.insert(1 + index, Candidate(name, entry["precision"], [], tmp_path / name, returncode=0, role=role))
    (tmp_path / "crashed").mkdir()
    runs.append(Candidate("crashed", "native-O1", [], tmp_path / "crashed", returncode=1))
    built = compare_report.build(runs, Tolerance(), steps=STEPS, argv=[], metrics=[
        Metric("val_within", 0.001)
    ])  # fmt: skip
    assert [e["role"] for e in built["candidates"]].count("candidate") == 4
    lines = terminal.render(built).splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)


def test_the_overflows_noise_floor_and_metrics_follow_the_documented_schema(overflows: Overflows) -> None:
    assert_matches(overflows.report, SCHEMA)
    assert overflows.report["hardware"].startswith(("CPU ", "NVIDIA", "AMD"))


def test_the_typed_shapes_of_compare_json_have_the_documented_schemas_keys_and_enums() -> None:
    # Every TypedDict and every Literal of commands/compare/schema.py is reached from the report's, at its place in the schema.
    typed_dicts, literals = set(), set()
    assert disagreements(compare_schema.Report, SCHEMA, "compare.json", typed_dicts, literals) == []
    assert typed_dicts == {v for v in vars(compare_schema).values() if typing_extensions.is_typeddict(v)}
    assert literals == {v for v in vars(compare_schema).values() if typing.get_origin(v) is typing.Literal}


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (lambda summary: summary["properties"].update(median=summary["properties"]["final_loss"]), "keys"),
        (lambda summary: summary["required"].remove("final_loss"), "required"),
        (lambda summary: summary["properties"]["step_time_call"]["enum"].remove("below"), "enum"),
        (lambda summary: summary["properties"]["final_loss"].update(type="string"), "type"),
    ],
)
def test_a_key_an_enum_value_or_a_type_on_one_side_only_is_a_disagreement(change: Any, found: str) -> None:
    schema = deepcopy(SCHEMA)
    change(schema["properties"]["candidates"]["items"]["properties"]["summary"])
    (said,) = disagreements(compare_schema.Report, schema, "compare.json", set(), set())
    assert said.startswith("compare.json.candidates[].summary") and f" {found} " in said, said


@pytest.mark.multiprocess
@needs_cpu_fp16
def test_apex_and_native_amp_are_close_on_the_example_under_torchrun(tmp_path: Path) -> None:
    """The pinned defaults: apex-O1 (the double) against torch's AMP at O1 is close, on two ranks. amp-O1 would run
    apex here (the double is installed), so torch's AMP is named native-O1. (A candidate apart, and its exit status:
    the one-process tests above, which cost a process start per candidate where this costs three.)"""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", EXAMPLE]
    result = run_compare(
        tmp_path, "apex-O1", "native-O1", "--steps", "20", "--out", "out", "--", *torchrun, "--", *torchrun,
        apex_double=True,
        timeout=600,
    )  # fmt: skip
    output = result.stdout
    assert result.returncode == 0, output[-4000:]
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert [entry["ran_as"] for entry in report["candidates"]] == ["apex amp O1", "native amp O1"]
    # The apex double's O1 casts as torch.autocast does on this model: the runs may even be identical.
    assert report["candidates"][0]["status"] == "baseline" and report["candidates"][1]["status"] in (
        "identical",
        "close",
    )
    for entry in report["candidates"]:
        assert entry["world_size"] == 2 and len(entry["series"]["loss_by_rank"]) == 2
        assert entry["series"]["step"] == list(range(20))
        assert output.count(f"lightning-ddp-amp compare [{entry['name']}]: this run's Trainer was changed:") == 1
    assert candidate(report, "apex-O1")["series"]["loss_scale"][0] == 2.0**16
    # The example says what ran under compare, not its own --precision (amp-O1).
    assert output.count("trained under apex amp O1 on 2 rank(s)") == output.count("trained under native amp O1") == 1
    assert "amp-O1:" not in output


@needs_cpu_fp16
def test_with_ckpt_every_candidate_continues_an_apex_checkpoint_and_native_amp_starts_from_its_fp32_masters(
    apex_double: ModuleType, tmp_path: Path
) -> None:
    sys.path.insert(0, str(WORKERS))
    try:
        from compare_train import build
    finally:
        sys.path.remove(str(WORKERS))
    model, loader = build(0.1)
    saved = ModelCheckpoint(dirpath=tmp_path, filename="apex")
    pl.Trainer(
        strategy="envddp", accelerator="cpu", devices=1, precision="apex-O2", max_steps=4, callbacks=[saved],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(model, loader)  # fmt: skip
    result = run_compare(
        tmp_path, "apex-O2", "native-O1", "--ckpt", "apex.ckpt", "--steps", "3", "--out", "out",
        *script("--strategy", "envddp"),
        apex_double=True,
    )  # fmt: skip
    output = result.stdout
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert report["comparable"], output[-4000:]  # the same weights after the restore, on both
    assert [entry["series"]["step"] for entry in report["candidates"]] == [[4, 5, 6], [4, 5, 6]]
    crossing = "Resuming a checkpoint of apex amp O2 under AmpPrecision(backend='native', opt_level='O1'): carried"
    assert output.count(crossing) == 1  # the apex candidate resumes under apex: nothing crosses
    assert "carried apex O2's fp32 master weights (the checkpoint's weights), the loss scale" in output


@pytest.mark.multiprocess
def test_a_run_torchrun_restarts_records_each_step_once(learning_rates: LearningRates) -> None:
    output = learning_rates.result.stdout
    assert "RuntimeError: the model crashed at step 2" in output  # the first attempt did crash
    restarted = candidate(learning_rates.report, "32-true#5")
    assert restarted["restarts"] == 1 and restarted["series"]["step"] == list(range(STEPS))
    assert restarted["status"] == "identical" and restarted["summary"]["weight_distance"] == 0
    assert f"  ran as            Precision 32-true, {STEPS} steps, after 1 restart(s)" in block(output, "32-true#5")


@pytest.mark.multiprocess
def test_a_self_launched_lightning_cli_script_is_compared_and_only_rank_zero_says_what_was_replaced(
    tmp_path: Path,
) -> None:
    """``python train.py fit --config ...`` with ``devices: 2``: envddp starts the ranks through torchrun, and the
    process that was started becomes torchrun's agent, which builds a Trainer too but never trains."""
    cli = str(REPO / "examples" / "cli" / "train.py")
    config = str(REPO / "examples" / "cli" / "amp_o1.yaml")
    result = run_compare(
        tmp_path, "32-true", "bf16-mixed", "--steps", "3", "--out", "out",
        "--", sys.executable, cli, "fit", "--config", config, "--seed_everything", "0", "--trainer.devices", "2",
    )  # fmt: skip
    output = result.stdout
    assert result.returncode == 0, output[-4000:]
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert [(entry["status"], entry["world_size"]) for entry in report["candidates"]] == [("baseline", 2), ("close", 2)]
    for entry in report["candidates"]:
        assert output.count(f"lightning-ddp-amp compare [{entry['name']}]: this run's Trainer was changed:") == 1
        assert (Path(entry["directory"]) / "config.yaml").is_file()  # LightningCLI's saved config
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["32-true", "--", "python", "t.py"],
            "PRECISION=['32-true']: compare needs a baseline and at least one candidate",
        ),
        (["32-true", "16-mixed"], "command=None: no training command after `--`"),
        (["32-true", "16-mixed", "bf16-mixed", "--", "x", "--", "y"], "commands=2: there are 3 precisions"),
        (["32-true", "16-mixed", "--steps", "0", "--", "x"], "--steps=0: a run needs at least one step"),
        (["32", "bf16", "--tolerance", "x", "--", "x"], "--tolerance='x': expected one or two positive numbers"),
        (["32-true", "amp-O1", "--ckpt", "missing.ckpt", "--", "x"], "--ckpt='missing.ckpt': no such file"),
        (["apex-O4", "amp-O1", "--", "python", "t.py"], "PRECISION='apex-O4': apex's opt_levels are O0 to O3"),
        (
            ["32-true", "natve-O1", "--", "python", "t.py"],
            "not a precision compare can run. Fix: did you mean 'native-O1'?",
        ),
        (
            ["32-true", "amp-O1", "python", "train.py", "--lr", "0.1"],
            "command='python train.py --lr 0.1': the training command must come after `--`",
        ),
        (
            ["32-true", "amp-O1", "--out", "runs/x", "torchrun", "--nproc-per-node=2", "t.py"],
            "Fix: lightning-ddp-amp compare 32-true amp-O1 --out runs/x -- torchrun --nproc-per-node=2 t.py",
        ),
        (["32", "bf16", "--metric", ":0.1", "--", "x"], "--metric=':0.1': no metric name before the ':'. Fix: e.g."),
        (
            ["32", "bf16", "--metric", "val_acc:high", "--", "x"],
            "--metric='val_acc:high': the tolerance 'high' is not a number of 0 or more. Fix: e.g. --metric val_acc",
        ),
        (
            ["32", "bf16", "--metric", "val_acc", "--metric", "val_acc:1%", "--", "x"],
            "--metric=['val_acc', 'val_acc']: a metric is named twice. Fix: name each metric once",
        ),
        (
            ["32", "bf16", "--snapshots", "0", "--", "x"],
            "--snapshots=0: the end is always one. Fix: pass --snapshots 1",
        ),
        (
            ["32", "bf16", "--grad-norm-every", "0", "--", "x"],
            "--grad-norm-every=0: it counts steps. Fix: pass 1 (every step) or more",
        ),
    ],
)
def test_a_usage_error_names_the_field_the_value_and_the_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        compare.main(argv)
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert message in error and ("Fix:" in error)


def test_an_out_folder_that_holds_files_or_is_a_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "old.ckpt").write_text("")
    with pytest.raises(SystemExit):
        compare.main(["32-true", "amp-O1", "--out", str(tmp_path), "--", "x"])
    assert f"--out={str(tmp_path)!r}: the folder is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        compare.main(["32-true", "amp-O1", "--out", str(tmp_path / "old.ckpt"), "--", "x"])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert f"--out={str(tmp_path / 'old.ckpt')!r}: it is a file, not a folder. Fix: name a new or empty folder" in error


def test_help_has_examples_every_precision_family_and_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        compare.main(["--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    assert "lightning-ddp-amp compare apex-O1 native-O1 -- torchrun --nproc-per-node=8 train.py" in text
    for family in ("apex-O0 ... apex-O3", "amp-O0 ... amp-O3", "native-O0 ... native-O3", "any Trainer precision"):
        assert family in text
    assert "exit status:" in text and "  2  nothing was compared" in text


def test_a_bad_precision_is_refused_before_anything_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        compare.main(["32-true", "apex-O4", "--", "python", "-c", "raise SystemExit(3)"])
    assert list(tmp_path.iterdir()) == []  # no out folder, no run


def test_nothing_of_compare_is_active_outside_it(tmp_path: Path) -> None:
    # With compare's folder on the path but no plan, sitecustomize installs nothing and leaves the Trainer alone.
    probe = (
        "import sys, lightning.pytorch as pl, lightning_ddp_amp;"
        "print(hasattr(pl.Trainer.__init__, '__lightning_ddp_amp_compare__'),"
        " [type(f).__name__ for f in sys.meta_path if 'Lightning' in type(f).__name__], sys.excepthook is sys.__excepthook__)"
    )
    env = worker_env({"PYTHONPATH": str(compare.SITE)})
    env.pop(PLAN_VARIABLE, None)
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False [] True", result.stderr[-2000:]


def test_a_failed_baseline_leaves_nothing_to_compare(learning_rates: LearningRates, tmp_path: Path) -> None:
    recorded = Path(candidate(learning_rates.report, "32-true#2")["directory"])
    shutil.copytree(recorded, tmp_path / "2-ok")
    (tmp_path / "1-broken").mkdir()
    runs = [
        Candidate("broken", "apex-O1", ["python", "t.py"], tmp_path / "1-broken", returncode=1),
        Candidate("ok", "32-true", ["python", "t.py"], tmp_path / "2-ok", returncode=0),
    ]
    report = compare_report.build(runs, Tolerance(), steps=STEPS, argv=[])
    assert report["problem"] == "the baseline broken failed, so there is nothing to compare against"
    assert [(e["status"], e["reason"]) for e in report["candidates"]] == [
        ("failed", "the command exited with status 1 (its output is above)"),
        ("not compared", "the baseline failed"),
    ]
    assert compare_report.write(report, tmp_path) == 2
    assert_matches(json.loads((tmp_path / "compare.json").read_text()), SCHEMA)


def recorded_copies(learning_rates: LearningRates, root: Path) -> list[Candidate]:
    """Two copies of the fixture's baseline run, for reports built from records a test then changes."""
    source = Path(candidate(learning_rates.report, "32-true")["directory"])
    runs = []
    for name in ("base", "other"):
        shutil.copytree(source, root / name)
        runs.append(Candidate(name, "32-true", ["python", "t.py"], root / name, returncode=0))
    return runs


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            lambda record: record["ranks"][0].update(weights_hash="0" * 64),
            "the model's initial weights differ between runs (rank 0: other against the baseline base). Fix: call"
            " `lightning.seed_everything(...)` (or torch.manual_seed) before building the model; with LightningCLI,"
            " set `seed_everything: 42` in the config (its default, true, picks a new seed every run)",
        ),
        (
            lambda record: record["ranks"][0].update(batch_hash="0" * 64),
            "the first training batch differs between runs (rank 0: other against the baseline base). Fix: call"
            " `lightning.seed_everything(...)` before building the DataLoader, or give it a torch.Generator with a"
            " fixed seed; with LightningCLI, set `seed_everything: 42` in the config",
        ),
        (
            lambda record: record.update(world_size=2),
            "the runs trained on different numbers of ranks (base: 1, other: 2). Fix: launch every candidate the same"
            " way",
        ),
    ],
)
def test_runs_that_did_not_start_alike_are_not_compared_and_the_problem_names_the_fix(
    change: Any, problem: str, learning_rates: LearningRates, tmp_path: Path
) -> None:
    runs = recorded_copies(learning_rates, tmp_path)
    path = runs[1].directory / "record.json"
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))
    report = compare_report.build(runs, Tolerance(), steps=STEPS, argv=[])
    assert report["problem"] == problem
    assert [entry["status"] for entry in report["candidates"]] == ["not compared", "not compared"]
    assert all(entry["summary"] is None for entry in report["candidates"])
    shown = terminal.render(report)
    assert f"NOT COMPARED: {problem}" in " ".join(shown.split()) and "final loss" not in shown
    assert compare_report.write(report, tmp_path) == 2


def edit_record(run: Candidate, change: Any) -> None:
    path = run.directory / "record.json"
    record = json.loads(path.read_text())
    change(record["ranks"][0])
    path.write_text(json.dumps(record))


def test_a_first_step_apart_right_after_a_skip_in_one_run_says_so_and_names_the_shifted_lr_schedule(
    learning_rates: LearningRates, tmp_path: Path
) -> None:
    # The baseline's LR decays every step; the other run skips step 3 on overflow, so from there its schedule runs a
    # step behind and its losses leave the tolerance.
    runs = recorded_copies(learning_rates, tmp_path)
    schedule = [0.1 * 0.9**step for step in range(STEPS)]
    edit_record(runs[0], lambda rank: rank.update(lr=schedule))

    def skip_step_3(rank: dict[str, Any]) -> None:
        rank["skipped"][3] = True
        rank["lr"] = schedule[:4] + schedule[3:-1]
        rank["loss"] = rank["loss"][:4] + [loss * 1.5 for loss in rank["loss"][4:]]

    edit_record(runs[1], skip_step_3)
    report = compare_report.build(runs, Tolerance(), steps=STEPS, argv=[])
    other = report["candidates"][1]
    assert other["status"] == "apart" and other["summary"]["first_step_apart"] == 4
    assert other["summary"]["explanation"] == (
        "it leaves the tolerance at step 4, after step 3, which this run alone skipped on overflow: a skipped step"
        " keeps the weights and holds the LR schedule back, so the runs train out of phase from there; its LR"
        " schedule runs 1 step(s) behind the baseline's"
    )
    assert f"; {other['summary']['explanation']}" in other["reason"]
    # A skip in both runs explains nothing.
    edit_record(runs[0], lambda rank: rank["skipped"].__setitem__(3, True))
    again = [Candidate(run.name, run.precision, run.command, run.directory, returncode=0) for run in runs]
    summary = compare_report.build(again, Tolerance(), steps=STEPS, argv=[])["candidates"][1]["summary"]
    assert summary["first_step_apart"] == 4 and summary["explanation"] is None


def test_a_first_step_apart_that_one_run_alone_skipped_on_overflow_says_so_with_its_loss_scale(
    overflows: Overflows,
) -> None:
    # net.2 overflows float16 in the forward at step 5: its loss is not finite there, the baseline's (float32) is.
    said = (
        "it leaves the tolerance at step 5, which this run alone skipped on overflow (loss scale 65536, its loss not"
        " finite) and the baseline trained: a skipped step keeps the weights and holds the LR schedule back, so the"
        " runs train out of phase from there"
    )
    for name in ("native-O1", "apex-O1"):
        entry = candidate(overflows.report, name)
        assert entry["summary"]["first_step_apart"] == 5 and entry["summary"]["skipped_steps"] == [5]
        assert entry["summary"]["explanation"] == said and f"; {said}" in entry["reason"]
        assert f"{name}: APART: " in overflows.result.stdout and said in " ".join(overflows.result.stdout.split())


def test_a_first_step_apart_that_the_baseline_alone_skipped_says_so_and_that_this_run_trained_it(
    learning_rates: LearningRates, tmp_path: Path
) -> None:
    runs = recorded_copies(learning_rates, tmp_path)

    def skip_step_3(rank: dict[str, Any]) -> None:  # as a float16 baseline whose forward overflowed at step 3
        rank["skipped"][3] = True
        rank["loss"][3] = math.inf
        rank["loss_scale"] = [2.0**16] * 4 + [2.0**15] * (STEPS - 4)

    edit_record(runs[0], skip_step_3)
    summary = compare_report.build(runs, Tolerance(), steps=STEPS, argv=[])["candidates"][1]["summary"]
    assert summary is not None and summary["first_step_apart"] == 3
    assert summary["explanation"] == (
        "it leaves the tolerance at step 3, which the baseline alone skipped on overflow (loss scale 65536, its loss"
        " not finite) and this run trained: a skipped step keeps the weights and holds the LR schedule back, so the"
        " runs train out of phase from there"
    )


@pytest.mark.parametrize(
    ("final", "distance", "status"),
    [
        (0.01, 0.04, "close"),
        (0.03, 0.04, "apart"),
        (0.01, 0.06, "apart"),
        (math.nan, 0.0, "apart"),
        (None, 0.0, "apart"),
    ],
)
def test_a_candidate_is_apart_beyond_either_tolerance_and_close_within_both(
    final: float | None, distance: float, status: str
) -> None:
    summary = {"final_loss_relative_difference": final, "weight_distance": distance, "loss_by_id": {}}
    assert compare_verdict.verdict(summary, Tolerance(loss=0.02, weights=0.05))[0] == status


#: A GAN's steps (apex's DCGAN example, num_losses=3): the discriminator's losses on real and fake images (loss_id 0
#: and 1) before its optimizer's step, the generator's (loss_id 2) before the next.
GAN_STEPS = [{0: 0.7, 1: 0.6} if step % 2 == 0 else {2: 1.5} for step in range(20)]


def recorded_losses(root: Path, name: str, *ranks: list[dict[int, float]]) -> Candidate:
    """A run whose ranks' records a Recorder kept, each step given the losses of its ``{loss_id: loss}``: the report's
    input as a run writes it, without a process. Every such run starts and ends in the same weights."""
    folder = root / name
    folder.mkdir()
    recorders, records = [], []
    for rank, steps in enumerate(ranks):
        recorder = compare_recorder.Recorder(Plan(name, "32-true", len(steps), str(folder)), compare_recorder.Changes())
        recorder.weights_hash = recorder.batch_hash = "0" * 64
        weight = torch.nn.Parameter(torch.zeros(1))
        weight.grad = torch.ones(1)
        optimizer = torch.optim.SGD([weight], lr=0.1)
        recorder.use(object(), torch.device("cpu"))  # a plugin without a loss scale
        for index, losses in enumerate(steps):
            for loss_id, loss in losses.items():
                recorder.backward(torch.tensor(loss), loss_id)
            recorder.before_step(optimizer, index, check=False)
            recorder.after_step(index, optimizer, recorder.clock())
        recorders.append(recorder)
        records.append(recorder.rank_record(rank, torch.device("cpu")))
    recorders[0].write_record(recorders[0].header("Precision 32-true", len(ranks)), records)
    torch.save({"w": torch.zeros(1)}, folder / START_WEIGHTS)
    torch.save({"w": torch.ones(1)}, folder / FINAL_WEIGHTS)
    return Candidate(name, "32-true", ["python", "t.py", "--run", name], folder, returncode=0)


def test_a_loss_id_apart_makes_the_run_apart_though_the_sum_of_the_losses_is_close(tmp_path: Path) -> None:
    # The generator's loss (loss_id 2) doubles; the step's loss, whose larger part is the discriminator's, moves 0.5%.
    base = recorded_losses(tmp_path, "base", [{0: 10.0, 1: 10.0, 2: 0.1}] * 10)
    other = recorded_losses(tmp_path, "other", [{0: 10.0, 1: 10.0, 2: 0.2}] * 10)
    report = compare_report.build([base, other], Tolerance(), steps=10, argv=[])
    entry = candidate(report, "other")
    summary = entry["summary"]
    assert summary["final_loss_relative_difference"] == pytest.approx(0.1 / 20.1, rel=1e-5)
    assert summary["loss_by_id"].keys() == {"0", "1", "2"}
    assert summary["loss_by_id"]["2"]["final_loss_relative_difference"] == pytest.approx(1.0, rel=1e-5)
    assert summary["loss_by_id"]["0"]["max_relative_loss_difference"] == 0.0
    assert entry["status"] == "apart"
    assert entry["reason"] == "final loss of loss_id 2 100% from the baseline's (tolerance 2%)"
    assert compare_report.write(report, tmp_path) == 1
    assert_matches(json.loads((tmp_path / "compare.json").read_text()), SCHEMA)


def test_each_loss_id_has_its_row_under_the_final_loss_in_every_block(tmp_path: Path) -> None:
    base = recorded_losses(tmp_path, "base", [{0: 10.0, 1: 10.0, 2: 0.1}] * 10)
    other = recorded_losses(tmp_path, "other", [{0: 10.0, 1: 10.0, 2: 0.2}] * 10)
    shown = terminal.render(compare_report.build([base, other], Tolerance(), steps=10, argv=[]))
    rows = block(shown, "other")
    at = next(i for i, line in enumerate(rows) if line.startswith("  final loss "))
    assert rows[at + 1 : at + 4] == [
        "    loss_id 0       10 (0% from the baseline's; per step max 0%, mean 0%)",
        "    loss_id 1       10 (0% from the baseline's; per step max 0%, mean 0%)",
        "    loss_id 2       0.2 (100% from the baseline's; per step max 100%, mean 100%)",
    ]
    assert block(shown, "base")[2:6] == [
        "  final loss        20.1",
        "    loss_id 0       10",
        "    loss_id 1       10",
        "    loss_id 2       0.1",
    ]


def test_a_step_without_a_loss_id_is_null_where_an_overflowed_loss_of_it_is_nan(tmp_path: Path) -> None:
    overflowed = [dict(losses) for losses in GAN_STEPS]
    overflowed[4][0] = math.nan  # errD_real overflows at step 4, on rank 0
    rank1 = [{loss_id: loss + 1 for loss_id, loss in losses.items()} for losses in GAN_STEPS]
    base = recorded_losses(tmp_path, "base", GAN_STEPS, rank1)
    other = recorded_losses(tmp_path, "other", overflowed, rank1)
    recorded = json.loads((other.directory / RECORD_FILE).read_text())["ranks"][0]["loss_by_id"]
    assert [loss is None for loss in recorded["0"][:5]] == [False, True, False, True, False]
    assert math.isnan(recorded["0"][4]) and recorded["2"][:2] == [None, pytest.approx(1.5)]
    report = compare_report.build([base, other], Tolerance(), steps=20, argv=[])
    series, summary = candidate(report, "other")["series"], candidate(report, "other")["summary"]
    # Each id's loss is the mean over the ranks, None at the steps that gave none of it.
    assert series["loss_by_id"]["2"][:2] == [None, pytest.approx(2.0)]
    assert math.isnan(series["loss_by_id"]["0"][4])
    # The steps without an id are left out of its comparison; its overflowed step is not.
    assert candidate(report, "base")["summary"]["loss_by_id"]["2"]["max_relative_loss_difference"] == 0.0
    assert summary["loss_by_id"]["0"]["max_relative_loss_difference"] == math.inf
    assert summary["loss_by_id"]["1"]["max_relative_loss_difference"] == 0.0
    assert summary["loss_by_id"]["2"]["final_loss"] == pytest.approx(2.0)
    assert candidate(report, "other")["status"] == "close"  # each id's last step (18 for 0 and 1, 19 for 2) agrees


def test_identical_needs_each_loss_id_at_each_step_not_only_their_sum(tmp_path: Path) -> None:
    overflowed = [dict(losses) for losses in GAN_STEPS]
    overflowed[4][0] = math.nan
    swapped = [{0: 2.0, 1: 1.0}] * 10
    runs = [
        recorded_losses(tmp_path, "base", [{0: 1.0, 1: 2.0}] * 10),
        recorded_losses(tmp_path, "swapped", swapped),
        recorded_losses(tmp_path, "gan", overflowed),
        recorded_losses(tmp_path, "gan-again", overflowed),
    ]
    report = compare_report.build(runs, Tolerance(), steps=10, argv=[])
    assert candidate(report, "swapped")["summary"]["final_loss_relative_difference"] == 0.0
    assert candidate(report, "swapped")["status"] == "apart"
    assert candidate(report, "swapped")["reason"] == (
        "final loss of loss_id 0 100%, loss_id 1 50% from the baseline's (tolerance 2%)"
    )
    # A NaN loss of an id, at the same step in both runs, is the same as a NaN; a step without it is the same too.
    again = compare_report.build(runs[2:], Tolerance(), steps=20, argv=[])
    assert candidate(again, "gan-again")["status"] == "identical"


def test_a_run_with_one_loss_id_has_no_loss_id_in_its_record_series_summary_or_block(tmp_path: Path) -> None:
    runs = [recorded_losses(tmp_path, name, [{0: 1.0 + step} for step in range(10)]) for name in ("base", "other")]
    assert "loss_by_id" not in json.loads((runs[0].directory / RECORD_FILE).read_text())["ranks"][0]
    report = compare_report.build(runs, Tolerance(), steps=10, argv=[])
    for entry in report["candidates"]:
        assert entry["series"]["loss_by_id"] == {} and entry["summary"]["loss_by_id"] == {}
    assert "loss_id" not in terminal.render(report)


def test_a_loss_id_that_only_one_run_gave_is_apart_and_said(tmp_path: Path) -> None:
    base = recorded_losses(tmp_path, "base", GAN_STEPS)
    other = recorded_losses(tmp_path, "other", [{0: 0.7, 1: 0.6} if s % 2 == 0 else {3: 1.5} for s in range(20)])
    report = compare_report.build([base, other], Tolerance(), steps=20, argv=[])
    entry = candidate(report, "other")
    assert entry["status"] == "apart"
    assert entry["reason"] == (
        "no step where both runs gave a loss of loss_id 2; no step where both runs gave a loss of loss_id 3"
    )
    assert "    loss_id 3       no step where both runs gave it" in block(terminal.render(report), "other")


def test_a_run_that_ends_without_a_record_says_why_there_may_be_none(
    learning_rates: LearningRates, tmp_path: Path
) -> None:
    runs = recorded_copies(learning_rates, tmp_path)
    (runs[1].directory / "record.json").unlink()
    report = compare_report.build(runs, Tolerance(), steps=STEPS, argv=[])
    assert candidate(report, "other")["reason"] == (  # the run's folder holds the marker of the Trainer it built
        "command='python t.py': the script built a Trainer but never completed a Trainer.fit, so compare recorded no"
        " step. Fix: call trainer.fit(...) in the script; compare records the steps of its first fit"
    )


def test_a_run_that_fails_after_its_fit_keeps_the_fits_steps_and_evaluations(
    learning_rates: LearningRates, tmp_path: Path
) -> None:
    base, other = recorded_copies(learning_rates, tmp_path)
    failed = Candidate("other", "32-true", other.command, other.directory, returncode=1)  # e.g. its trainer.test raised
    report = compare_report.build([base, failed], Tolerance(), steps=STEPS, argv=[])
    entry, baseline = candidate(report, "other"), candidate(report, "base")
    assert entry["status"] == "failed" and entry["reason"].startswith("the command exited with status 1")
    assert entry["series"]["loss"] == baseline["series"]["loss"] and len(entry["series"]["step"]) == STEPS
    assert entry["evaluations"] == baseline["evaluations"]
    assert f"(after {STEPS} steps, kept in compare.json)" in " ".join(terminal.render(report).split())


def test_an_unreadable_ckpt_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "broken.ckpt").write_text("not a checkpoint")
    with pytest.raises(SystemExit):
        compare.main(
            ["32-true", "amp-O1", "--ckpt", str(tmp_path / "broken.ckpt"), "--out", str(tmp_path / "out"), "--", "x"]
        )
    error = capsys.readouterr().err
    assert f"--ckpt={str((tmp_path / 'broken.ckpt').resolve())!r}: torch.load cannot read it (" in error
    assert "Fix: pass a checkpoint a Trainer saved" in error


class RunsCode:
    """What a hostile checkpoint can hold: unpickled, it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def first_step_planned(tmp_path: Path, *options: str) -> int:
    """compare's first run's plan.json, with a command that cannot start (nothing trains)."""
    compare.main(["32-true", "amp-O1", *options, "--out", str(tmp_path / "out"), "--", str(tmp_path / "missing")])
    plan = json.loads((tmp_path / "out" / "1-32-true" / "plan.json").read_text())
    return int(plan["first_step"])


def test_a_ckpt_whose_pickle_would_run_code_is_refused_and_nothing_of_it_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    ckpt = tmp_path / "last.ckpt"
    torch.save({"global_step": 12, "state_dict": {"w": torch.zeros(2)}, "hyper_parameters": RunsCode(marker)}, ckpt)
    with pytest.raises(SystemExit) as exit:
        compare.main(["32-true", "amp-O1", "--ckpt", str(ckpt), "--out", str(tmp_path / "out"), "--", "x"])
    assert exit.value.code == 2
    error = " ".join(capsys.readouterr().err.split())
    assert (
        f"--ckpt={str(ckpt)!r}: it names builtins.exec, which is not a tensor, a plain value or argparse.Namespace:"
        " unpickling it could run any code, so nothing of it was built. Fix: if you trust where the file comes from,"
        " pass --trust-ckpt" in error
    )
    assert not marker.exists()


def test_trust_ckpt_reads_a_ckpt_that_names_more_and_runs_what_its_pickle_says(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    ckpt = tmp_path / "last.ckpt"
    torch.save({"global_step": 12, "hyper_parameters": RunsCode(marker)}, ckpt)
    assert first_step_planned(tmp_path, "--ckpt", str(ckpt), "--trust-ckpt") == 12
    assert marker.read_text() == "ran"


def test_a_lightning_ckpt_with_hyperparameters_and_saved_args_is_read_without_trust(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    torch.save(
        {"global_step": 30, "epoch": 2, "state_dict": {"w": torch.zeros(2)}, "hyper_parameters": {"lr": 0.1},
         "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
         "args": argparse.Namespace(lr=0.1)},
        ckpt,
    )  # fmt: skip
    assert first_step_planned(tmp_path, "--ckpt", str(ckpt)) == 30


def test_a_logger_that_cannot_be_redirected_is_turned_off_named_and_still_callable(tmp_path: Path) -> None:
    class Remote(pl.loggers.Logger):
        name, version = "remote", 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            raise AssertionError("the remote logger was called")

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("the remote logger was called")

    given: dict[str, Any] = {"logger": [pl.loggers.CSVLogger("script_logs", name="mine"), Remote()]}
    changes = compare_recorder.Changes()
    plan = Plan("c", "32-true", 5, str(tmp_path))
    defaults = compare_patching._trainer_defaults(pl.Trainer, inspect.signature(pl.Trainer.__init__), pl)
    compare_patching._replace_arguments(given, defaults, plan, changes, pl)
    csv, dummy = given["logger"]
    assert (csv.save_dir, csv.name) == (str(tmp_path / "logs"), "mine")
    assert changes.turned_off == ["Remote"]
    dummy.experiment.log({"anything": 1})  # what a script calls on its W&B logger, swallowed
    assert dummy.save_dir == str(tmp_path / "logs")  # where LightningCLI saves its config
    assert "turned off Remote: it cannot write into the candidate's folder" in changes.describe("c")


def test_a_csv_logger_whose_constructor_takes_other_arguments_is_turned_off(tmp_path: Path) -> None:
    class RunLogger(pl.loggers.CSVLogger):
        def __init__(self, run: str) -> None:
            super().__init__("script_logs", name=run)

    given: dict[str, Any] = {"logger": RunLogger("mine")}
    changes = compare_recorder.Changes()
    plan = Plan("c", "32-true", 5, str(tmp_path))
    defaults = compare_patching._trainer_defaults(pl.Trainer, inspect.signature(pl.Trainer.__init__), pl)
    compare_patching._replace_arguments(given, defaults, plan, changes, pl)
    [turned_off] = given["logger"]
    assert changes.turned_off == ["RunLogger"]
    assert turned_off.save_dir == str(tmp_path / "logs")


def test_argument_defaults_come_from_the_environment_as_lightning_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    class MyTrainer(pl.Trainer):
        pass

    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "7")
    monkeypatch.setenv("PL_MYTRAINER_MAX_STEPS", "9")
    monkeypatch.setenv("PL_TRAINER_DEFAULT_ROOT_DIR", "")  # empty: Lightning ignores it
    for trainer_class, max_steps in ((pl.Trainer, 7), (MyTrainer, 9)):
        defaults = compare_patching._trainer_defaults(trainer_class, inspect.signature(trainer_class.__init__), pl)
        built = trainer_class(logger=False, enable_checkpointing=False)
        assert defaults["max_steps"] == built.max_steps == max_steps
        assert defaults["default_root_dir"] is None
        assert defaults["precision"] is None  # the signature's default, for an argument no variable sets


def test_a_script_amp_precision_a_level_refuses_keeps_only_models_and_num_losses() -> None:
    changes = compare_recorder.Changes()
    configured = AmpPrecision(opt_level="O2", backend="native", keep_batchnorm_fp32=True, num_losses=2)
    built = run_precision._amp_plugin(compare_patching.trainer_door(pl), "O1", "native", configured, changes)
    assert (built.opt_level, built.settings.num_losses, built.settings.keep_batchnorm_fp32) == ("O1", 2, None)
    assert changes.replaced[0].startswith("kept only models and num_losses of the script's AmpPrecision (")


def test_an_error_other_than_a_precision_setting_refused_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(AmpPrecision):
        """Test double: an AmpPrecision that fails for a reason of its own when given the carried settings."""

        def __init__(self, **settings: Any) -> None:
            if "loss_scale" in settings:
                raise RuntimeError("broken")
            super().__init__(**settings)

    monkeypatch.setattr(lightning_ddp_amp, "AmpPrecision", Broken)
    configured = AmpPrecision(opt_level="O1", backend="native")
    with pytest.raises(RuntimeError, match="broken"):
        run_precision._amp_plugin(
            compare_patching.trainer_door(pl), "O2", "native", configured, compare_recorder.Changes()
        )


class RestoresAfterSetup(SingleDeviceStrategy):
    """Test double: a strategy that restores checkpoints after its setup, as FSDP and DeepSpeed do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def patched_in_process(monkeypatch: pytest.MonkeyPatch, plan: Plan) -> None:
    """This process patched as a run of ``plan`` is (its plan written into its folder), and the Trainer and the Fabric
    put back after the test: an in-process ``patch()`` changes the classes of the process (``patch("lightning")``
    patches ``lightning.fabric.Fabric`` too), and a later test in this worker that builds a Fabric or a Trainer would
    get the plan's precision."""
    for name in ("__init__", "fit"):
        monkeypatch.setattr(pl.Trainer, name, getattr(pl.Trainer, name))
    monkeypatch.setattr(lightning.fabric.Fabric, "__init__", lightning.fabric.Fabric.__init__)
    path = Path(plan.directory) / "plan.json"
    plan.write(path)
    compare_patching.patch("lightning", str(path))


#: A Trainer that prints and logs nothing, on the CPU.
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu"}


def test_a_strategy_that_restores_checkpoints_after_its_setup_is_refused_when_the_trainer_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    patched_in_process(monkeypatch, Plan("c", "32-true", 5, str(tmp_path)))
    pl.Trainer(strategy=SingleDeviceStrategy("cpu"), logger=False)
    with pytest.raises(StrategyConfigurationError) as raised:
        pl.Trainer(strategy=RestoresAfterSetup("cpu"), logger=False)
    assert str(raised.value) == (
        "strategy='RestoresAfterSetup': it restores a checkpoint only after strategy.setup"
        " (restore_checkpoint_after_setup=True), but compare checks that every run starts from the same weights when"
        " strategy.setup begins. Fix: compare under a strategy that restores checkpoints before its setup, e.g."
        " strategy='envddp' or 'ddp'"
    )


def test_lightnings_strategies_that_restore_after_setup_are_refused_and_the_others_pass() -> None:
    compare_patching.check_restores_before_setup(pl.strategies.DDPStrategy())
    compare_patching.check_restores_before_setup(EnvDDPStrategy())
    with pytest.raises(StrategyConfigurationError, match=r"^strategy='FSDPStrategy': "):
        compare_patching.check_restores_before_setup(pl.strategies.FSDPStrategy())


@needs_cpu_fp16
def test_the_final_weights_of_apex_o2_are_its_fp32_masters(apex_double: ModuleType) -> None:
    from test_precision import TwoModels, fit

    trainer = fit(TwoModels(), precision="apex-O2")
    plugin, module = trainer.precision_plugin, trainer.lightning_module
    weights = compare_recorder.trained_weights([("", module)], plugin)
    masters = {id(param): master for param, master in plugin.amp_backend.master_weight_pairs()}
    assert masters and all(param.dtype == torch.float16 for name, param in module.named_parameters())
    for name, param in module.named_parameters():
        master = masters[id(param)]
        assert torch.equal(weights[name], master) and weights[name].data_ptr() == master.data_ptr()  # the master


def test_the_gradient_norm_sums_every_gradients_squares_whatever_its_dtype_or_layout() -> None:
    torch.manual_seed(0)
    shapes, dtypes = [(300, 7), (5, 3), (4, 6)], [torch.float32, torch.bfloat16, torch.float32]
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape, dtype in zip(shapes, dtypes, strict=True)]
    params[0].grad = torch.randn(300, 7)
    params[1].grad = torch.randn(5, 3).to(torch.bfloat16)
    params[2].grad = torch.randn(6, 4).t()  # not contiguous: read as it is, not copied
    expected = torch.cat([p.grad.double().flatten() for p in params]).norm()
    norm = compare_recorder.gradient_norm(torch.optim.SGD(params, lr=0.1), None)
    assert norm.dtype == torch.float32 and float(norm) == pytest.approx(float(expected), rel=1e-6)


@needs_cpu_fp16
def test_a_scaler_not_yet_used_reads_its_initial_scale_so_an_overflow_at_the_first_step_is_a_skip() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    read = compare_recorder.scale_reader(plugin)  # what the recording reads the scale with
    before = read()  # before the first backward
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    plugin.scaler.scale((weight * float("inf")).sum()).backward()
    plugin.scaler.step(optimizer)
    plugin.scaler.update()
    after = read()
    assert isinstance(before, torch.Tensor) and float(before) == 1024.0
    assert isinstance(after, torch.Tensor) and bool(after < before)  # the recording's skip: the scaler backed off
    assert torch.equal(weight.detach(), torch.ones(1))


def test_a_later_trainers_test_joins_the_first_fits_record_and_a_second_fit_records_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sys.path.insert(0, str(WORKERS))
    try:
        from compare_train import build
    finally:
        sys.path.remove(str(WORKERS))
    patched_in_process(monkeypatch, Plan("c", "32-true", 6, str(tmp_path)))
    model, loader = build(0.1)
    test_loader = torch.utils.data.DataLoader(list(loader.dataset)[:16], batch_size=8)
    pl.Trainer(max_epochs=50, default_root_dir=tmp_path, **QUIET).fit(model, loader)
    record = tmp_path / RECORD_FILE
    fitted = json.loads(record.read_text())
    final = (tmp_path / FINAL_WEIGHTS).read_bytes()
    tested = pl.Trainer(devices=1, default_root_dir=tmp_path, **QUIET).test(model, test_loader)  # Lightning's advice
    pl.Trainer(max_epochs=60, default_root_dir=tmp_path, **QUIET).fit(model, loader)  # a fine-tuning fit
    again = json.loads(record.read_text())
    assert again["evaluations"] == [{"stage": "test", "step": 6, "metrics": tested[0]}]
    assert again["ranks"] == fitted["ranks"] and len(again["ranks"][0]["step"]) == 6
    assert (tmp_path / FINAL_WEIGHTS).read_bytes() == final


class TwoOptimizers(pl.LightningModule):
    """Manual optimization stepping two optimizers a batch, as a GAN does: the global step goes up by two."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        for optimizer in self.optimizers():
            optimizer.zero_grad()
            self.manual_backward(self.b(self.a(batch[0])).square().mean())
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)]


def test_snapshots_are_taken_at_the_first_batch_past_them_when_the_step_goes_up_by_two(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = Plan(  # the baseline: it keeps its weights at each snapshot
        "c", "32-true", 6, str(tmp_path), save_start=True, snapshots=(3, 5), baseline_directory=str(tmp_path)
    )
    patched_in_process(monkeypatch, plan)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
    pl.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET).fit(TwoOptimizers(), loader)
    saved = sorted(path.name for path in tmp_path.glob("weights-step*.pt"))
    assert saved == [snapshot_file(4), snapshot_file(6)]
    rank = json.loads((tmp_path / RECORD_FILE).read_text())["ranks"][0]
    assert rank["slowed_steps"] == [4, 6] and rank["step"][-1] == 5


def test_a_shadowed_sitecustomize_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins; builtins.SHADOWED_RAN = True\n")
    env = worker_env({"PYTHONPATH": f"{compare.SITE}:{tmp_path}", PLAN_VARIABLE: str(tmp_path / "plan.json")})
    probe = "import builtins, sys; print(getattr(builtins, 'SHADOWED_RAN', False), sys.excepthook.__name__)"
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["True", "_record_uncaught"], result.stderr[-2000:]


def disagreements(
    hint: Any, schema: dict[str, Any], where: str, typed_dicts: set[Any], literals: set[Any]
) -> list[str]:
    """Where the type ``hint`` and the JSON schema ``schema`` disagree: a TypedDict's keys and required keys against
    the object's ``properties`` and ``required``, a Literal's values against the ``enum``, a plain type against the
    ``type``; lists and mappings item by item. Records each TypedDict and Literal it reached."""
    union = typing.get_origin(hint) in (typing.Union, UnionType)
    nullable = union and type(None) in typing.get_args(hint)
    if union:
        (hint,) = [each for each in typing.get_args(hint) if each is not type(None)]  # every union here is X | None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        literals.add(hint)
        values = {*args, *([None] if nullable else [])}
        return (
            [] if values == set(schema.get("enum", ())) else [f"{where}: the enum {schema.get('enum')} is not {values}"]
        )
    if "enum" in schema:
        return [f"{where}: the enum {schema['enum']} is not a Literal"]
    kinds = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
    kind = "object" if typing_extensions.is_typeddict(hint) else kinds[origin or hint]
    allowed = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    integer_as_number = kind == "integer" and "number" in allowed
    if (kind not in allowed and not integer_as_number) or (nullable and "null" not in allowed):
        return [f"{where}: the type {allowed} is not {kind}{' or null' if nullable else ''}"]
    if origin is list:
        return disagreements(args[0], schema["items"], f"{where}[]", typed_dicts, literals)
    if origin is dict:
        return disagreements(args[1], schema["additionalProperties"], f"{where}.*", typed_dicts, literals)
    if kind != "object":
        return []
    typed_dicts.add(hint)
    keys, properties = typing.get_type_hints(hint), schema.get("properties", {})
    found = []
    if keys.keys() != properties.keys():
        found.append(f"{where}: keys {sorted(keys.keys() ^ properties.keys())} are on one side only")
    if hint.__required_keys__ != set(schema.get("required", ())):
        found.append(f"{where}: required {sorted(hint.__required_keys__ ^ set(schema.get('required', ())))} differ")
    for key in keys.keys() & properties.keys():
        found += disagreements(keys[key], properties[key], f"{where}.{key}", typed_dicts, literals)
    return found


def assert_matches(value: Any, schema: dict[str, Any], where: str = "compare.json") -> None:
    """A small JSON Schema check (type, enum, required, properties, additionalProperties, items): enough for
    docs/compare.schema.json."""
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
        return
    allowed = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]

    def fits(kind: str) -> bool:
        if kind == "integer":
            return isinstance(value, int) and not isinstance(value, bool)
        if kind == "number":
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return isinstance(value, types[kind])

    assert any(fits(kind) for kind in allowed), f"{where}: {value!r} is not {allowed}"
    if isinstance(value, dict):
        missing = set(schema.get("required", ())) - set(value)
        assert not missing, f"{where}: lacks {sorted(missing)}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                assert_matches(value[key], sub, f"{where}.{key}")
        for key in value.keys() - schema.get("properties", {}).keys():
            if "additionalProperties" in schema:
                assert_matches(value[key], schema["additionalProperties"], f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            assert_matches(item, schema["items"], f"{where}[{index}]")


def test_curves_apart_by_less_than_a_line_of_their_panel_take_turns_too() -> None:
    # 200 steps of loss curves a 1e-5 apart hide each other as surely as equal ones: on a linear (or log) panel, within
    # SAME_LINE of its span is one line; on the symlog panel of the differences, only SAME_CURVE counts.
    def curve(run: str, ys: list[float]) -> Any:
        return compare_picture.Curve(run, "", run, [0, 1, 2], ys, "C0", {})

    one, near, far = curve("a", [2.0, 2.1, 2.3]), curve("b", [2.0002, 2.1, 2.3]), curve("c", [2.01, 2.1, 2.3])
    placed = compare_picture._resolution([one, near, far], "loss")
    assert compare_picture._coincide(one, near, placed)
    assert not compare_picture._coincide(one, far, placed)
    assert compare_picture._resolution([one, near], "relative_loss_difference") is None
    assert not compare_picture._coincide(one, near, None)


class SkipsItsThirdBatch(pl.LightningModule):
    """A finite loss whose gradients are NaN at batch 2 (``sqrt(0)``'s backward times 0): the loss scaler skips it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch).float().pow(2).mean()
        return loss + torch.sqrt((self.net.weight * 0).sum()) if batch_idx == 2 else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@needs_cpu_fp16
def test_a_step_the_scaler_skips_on_a_finite_loss_is_located_after_it_from_the_weights_it_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    patched_in_process(monkeypatch, Plan("c", "native-O1", 4, str(tmp_path)))
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.randn(64, 4) / 100, batch_size=8)  # no float16 overflow of its own
    pl.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET).fit(SkipsItsThirdBatch(), loader)
    (rank,) = json.loads((tmp_path / RECORD_FILE).read_text())["ranks"]
    assert rank["skipped"] == [False, False, True, False] and all(math.isfinite(loss) for loss in rank["loss"])
    (found,) = rank["overflows"]
    assert (found["step"], found["phase"], found["module"], found["tensor"]) == (
        2,
        "backward",
        "net",
        "weight gradient",
    )
