"""``compare.png``: the runs' series in eight panels, under a title that says what ran where, with each verdict.

Differences are drawn in percent, as the terminal says them; the step-time panel leaves out each run's first step
(warm-up) and the steps slowed by the weight-distance measurement, as the step-time statistics do.
"""

from __future__ import annotations

import math
import shlex
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_ddp_amp.compare.schema import BASELINE, CandidateEntry, Report, Series
from lightning_ddp_amp.compare.summary import timed_steps

#: The panels, in order: title, and the series key each plots (``metrics``: every validation and test metric).
PANELS = (
    ("Loss", "loss"),
    ("Loss difference to the baseline (%)", "relative_loss_difference"),
    ("Weight distance to the baseline (% of its travel)", "weight_distance"),
    ("Loss scale (x: skipped step)", "loss_scale"),
    ("Gradient norm (after unscaling)", "grad_norm"),
    ("Learning rate", "lr"),
    ("Step time (ms), without warm-up", "step_time_s"),
    ("Validation and test metrics", "metrics"),
)
#: The loss-scale panel's text where no run scaled its loss (float32 and bfloat16 runs, for example).
NO_LOSS_SCALE = "no run has a loss scale: none trained in float16 with loss scaling"
#: Characters of the command per title line: about what 14 inches hold at the title's 10 points.
TITLE_WIDTH = 175
#: Multiplies a series for drawing: fractions are drawn in percent, seconds in milliseconds.
SCALE = {"relative_loss_difference": 100.0, "weight_distance": 100.0, "step_time_s": 1000.0}


def points(entry: CandidateEntry, key: str) -> tuple[list[float], list[float]]:
    """The (x, y) a panel draws for one run: a missing or non-finite value is a gap (NaN)."""
    series = _series(entry)
    by_key: Mapping[str, Any] = series  # the panel's key, one of the series'
    factor = SCALE.get(key, 1.0)
    if key == "weight_distance":
        pairs = [(step, value) for step, value in by_key[key]]
    elif key == "step_time_s":
        pairs = timed_steps(series)
    else:
        pairs = list(zip(series["step"], by_key[key], strict=True))
    xs = [float(step) for step, _ in pairs]
    ys = [math.nan if v is None or not math.isfinite(v) else v * factor for _, v in pairs]
    return xs, ys


def plot(report: Report, path: Path) -> Any:
    """Draw :data:`PANELS` into ``path``; returns the figure, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return None
    figure, axes = pyplot.subplots(4, 2, figsize=(14, 16), constrained_layout=True)
    figure.suptitle(_title(report), fontsize=10)
    entries = [entry for entry in report["candidates"] if entry["series"] is not None]
    colours = {entry["name"]: f"C{index}" for index, entry in enumerate(entries)}  # a run's colour in every panel
    for axis, (title, key) in zip(axes.flat, PANELS, strict=True):
        axis.set_title(title)
        axis.set_xlabel("step")
        if key == "metrics":
            _metrics(axis, entries, colours)
            continue
        if key == "loss_scale" and not any(_has_a_loss_scale(entry) for entry in entries):
            axis.text(0.5, 0.5, NO_LOSS_SCALE, ha="center", transform=axis.transAxes)
            axis.set_yticks([])
            continue
        for entry in entries:
            if key in ("relative_loss_difference", "weight_distance") and (
                entry["status"] == BASELINE or entry["summary"] is None
            ):
                continue  # nothing to draw: the baseline itself, or a run never compared
            xs, ys = points(entry, key)
            colour = colours[entry["name"]]
            marker = "o" if key == "weight_distance" else None
            axis.plot(xs, ys, label=_label(entry), color=colour, marker=marker)
            if key == "loss_scale":
                skipped = [(x, y) for x, y, flag in zip(xs, ys, _series(entry)["skipped"], strict=True) if flag]
                if skipped:
                    axis.plot(*zip(*skipped, strict=True), "x", color=colour, label=f"_{entry['name']} skipped")
        if key == "weight_distance":
            axis.axhline(100 * report["tolerance"]["weights"], color="red", linestyle="--", label="_tolerance")
            axis.annotate(
                "tolerance", (1, 100 * report["tolerance"]["weights"]), xycoords=("axes fraction", "data"),
                ha="right", va="bottom", color="red",
            )  # fmt: skip
        if key == "relative_loss_difference":  # symlog: rounding's 0.001% and the tolerance's 2% both readable
            axis.axhline(100 * report["tolerance"]["loss"], color="red", linestyle="--", label="_tolerance")
            axis.set_yscale("symlog", linthresh=1e-3)
        if key in ("loss_scale", "grad_norm"):
            axis.set_yscale("log", base=2 if key == "loss_scale" else 10)
        if axis.get_lines():
            axis.legend(fontsize=8)
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
    return figure


def _series(entry: CandidateEntry) -> Series:
    """The series of a run the picture draws: only those that have one are drawn."""
    assert entry["series"] is not None
    return entry["series"]


def _has_a_loss_scale(entry: CandidateEntry) -> bool:
    return any(value is not None and math.isfinite(value) for value in _series(entry)["loss_scale"])


def _metrics(axis: Any, entries: list[CandidateEntry], colours: dict[str, str]) -> None:
    """Each logged metric over the evaluation runs' steps: a colour per run, a marker per metric."""
    names = sorted({name for entry in entries for e in entry["evaluations"] for name in e["metrics"]})
    if not names:
        axis.text(0.5, 0.5, "no metric was logged in validation or test", ha="center", transform=axis.transAxes)
        return
    markers = "osd^v<>p*h"
    for entry in entries:
        for n, name in enumerate(names):
            found = [(e["step"], e["metrics"][name]) for e in entry["evaluations"] if name in e["metrics"]]
            if found:
                axis.plot(
                    *zip(*found, strict=True), marker=markers[n % len(markers)], color=colours[entry["name"]],
                    label=f"{entry['name']}: {name}",
                )  # fmt: skip
    axis.legend(fontsize=8)


def _label(entry: CandidateEntry) -> str:
    return f"{entry['name']} ({entry['status']})"


def _title(report: Report) -> str:
    versions = report["versions"]
    lightning = versions.get("lightning") or versions.get("pytorch_lightning")
    apex = f", apex {versions['apex']}" if versions.get("apex") else ""
    return (
        f"{textwrap.fill(shlex.join(report['command']), TITLE_WIDTH)}\n{report.get('hardware', '')} · torch"
        f" {versions['torch']} · Lightning {lightning} · lightning-ddp-amp {versions.get('lightning_ddp_amp')}{apex}"
    )
