"""``compare.png``: the runs' series in eight panels, under a title that says what ran where, with each verdict.

The loss panel draws a step's loss, the sum of its losses: each ``loss_id``'s own (``series.loss_by_id``) is given only
at the steps of its optimizer, a point every other step, and is in the terminal report and ``compare.json`` instead.

Differences are drawn in percent, as the terminal says them, from 0 up; the step-time panel leaves out each run's first
step (warm-up) and the steps slowed by the weight-distance measurement, as the step-time statistics do. A panel draws
only the runs that have something there, and curves that lie on each other take turns, so that none hides another
(:func:`_draw`).
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_ddp_amp.commands.compare.schema import BASELINE, CandidateEntry, Report, Series
from lightning_ddp_amp.commands.compare.summary import timed_steps

#: The panels, in order: title, and the series key each plots (``metrics``: every validation and test metric).
PANELS = (
    ("Loss", "loss"),
    ("Loss difference to the baseline (%)", "relative_loss_difference"),
    ("Weight distance to the baseline (% of its travel)", "weight_distance"),
    ("Loss scale (X: skipped step)", "loss_scale"),
    ("Gradient norm (after unscaling)", "grad_norm"),
    ("Learning rate", "lr"),
    ("Step time (ms), without warm-up", "step_time_s"),
    ("Validation and test metrics", "metrics"),
)
#: The loss-scale panel's text where no run scaled its loss (float32 and bfloat16 runs, for example).
NO_LOSS_SCALE = "no run has a loss scale: none trained in float16 with loss scaling"
#: Characters of the command per title line: about what 14 inches hold at the title's 10 points.
TITLE_WIDTH = 175
#: The marker of a step skipped on overflow, on its run's loss-scale line.
SKIPPED_MARKER = "X"
#: The length of a dash, in points, where equal curves take turns (:func:`_draw`).
DASH = 4.0
#: Values closer than this, relative to the larger, lie on each other in any panel: their curves take turns.
SAME_CURVE = 1e-6
#: On a linear or log axis, values closer than this part of the panel's span are one line in the picture (a panel is
#: about 270 pixels high): their curves take turns too. A symlog panel (the loss differences) uses SAME_CURVE alone.
SAME_LINE = 1 / 400
#: Multiplies a series for drawing: fractions are drawn in percent, seconds in milliseconds.
SCALE = {"relative_loss_difference": 100.0, "weight_distance": 100.0, "step_time_s": 1000.0}


def points(entry: CandidateEntry, key: str) -> tuple[list[float], list[float]]:
    """The (x, y) a panel draws for one run: a missing or non-finite value is a gap (NaN); the gradient norm's steps
    are those it was measured at."""
    series = _series(entry)
    by_key: Mapping[str, Any] = series  # the panel's key, one of the series'
    factor = SCALE.get(key, 1.0)
    if key == "weight_distance":
        pairs = [(step, value) for step, value in by_key[key]]
    elif key == "step_time_s":
        pairs = timed_steps(series)
    elif key == "grad_norm":  # measured at every --grad-norm-every-th step: the line joins those
        pairs = [
            (step, value) for step, value in zip(series["step"], series["grad_norm"], strict=True) if value is not None
        ]
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
    tolerances = {
        "relative_loss_difference": report["tolerance"]["loss"],
        "weight_distance": report["tolerance"]["weights"],
    }
    for axis, (title, key) in zip(axes.flat, PANELS, strict=True):
        axis.set_title(title)
        axis.set_xlabel("step")
        if key == "metrics":
            _metrics(axis, entries, colours)
            continue
        if key == "loss_scale" and not any(_has_a_loss_scale(entry) for entry in entries):
            axis.text(0.5, 0.5, NO_LOSS_SCALE, ha="center", transform=axis.transAxes)
            axis.set_xticks([])
            axis.set_yticks([])
            continue
        curves = [curve for entry in entries if (curve := _curve(entry, key, colours[entry["name"]]))]
        _draw(axis, curves, _resolution(curves, key))
        if key in tolerances:  # a legend entry, not a label on the line, which a legend could cover
            value = tolerances[key]
            axis.axhline(100 * value, color="black", linestyle=":", label=f"tolerance {100 * value:.3g}%")
        if key == "relative_loss_difference":  # symlog: rounding's 0.001% and the tolerance's 2% both readable
            axis.set_yscale("symlog", linthresh=1e-3)
        if key in ("loss_scale", "grad_norm"):
            axis.set_yscale("log", base=2 if key == "loss_scale" else 10)
        if key in tolerances:
            axis.set_ylim(bottom=0)  # a difference is never negative: no half of the panel for what cannot happen
        _legend(axis)
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
    return figure


@dataclasses.dataclass(eq=False)  # each curve is itself: two runs' may hold equal values
class Curve:
    """One line of a panel: the run it belongs to and what of it (a metric's name; empty in a run's own panel), its
    legend entry, points, colour and marker."""

    run: str
    of: str
    label: str
    xs: list[float]
    ys: list[float]
    colour: str
    style: dict[str, Any]


def _curve(entry: CandidateEntry, key: str, colour: str) -> Curve | None:
    """A run's curve in a panel; None where it has nothing to draw there (and so no legend entry): the baseline's or
    an uncompared run's differences, a run without a loss scale."""
    if key in ("relative_loss_difference", "weight_distance") and (
        entry["status"] == BASELINE or entry["summary"] is None
    ):
        return None
    xs, ys = points(entry, key)
    if not any(math.isfinite(y) for y in ys):
        return None
    style: dict[str, Any] = {"marker": "o"} if key == "weight_distance" else {}
    if key == "loss_scale":  # the skipped steps marked on the run's own line
        style = {"marker": SKIPPED_MARKER, "markevery": [i for i, flag in enumerate(_series(entry)["skipped"]) if flag]}
    return Curve(entry["name"], "", _label(entry), xs, ys, colour, style)


def _resolution(curves: list[Curve], key: str) -> Callable[[float], float] | None:
    """How ``key``'s panel places a value (a log panel: its logarithm), for :func:`_coincide` to measure distances in
    :data:`SAME_LINE` of the panel's span; None on the symlog panel, where curves coincide only within SAME_CURVE."""
    if key == "relative_loss_difference":
        return None
    log = key in ("loss_scale", "grad_norm")
    ys = [y for curve in curves for y in curve.ys if math.isfinite(y) and (y > 0 or not log)]
    if not ys:
        return None
    place: Callable[[float], float] = math.log10 if log else float
    span = place(max(ys)) - place(min(ys))
    return None if span <= 0 else lambda y: place(y) / span


def _draw(axis: Any, curves: list[Curve], placed: Callable[[float], float] | None = None) -> list[str | None]:
    """Draw ``curves``; returns, for each, the run whose curve it covers (None: it covers none).

    A curve that :func:`_coincide` with one drawn before it would hide it, so the curves of such a group take turns,
    dashed, along each stretch of ``n * DASH`` points (the first is drawn whole, under the others), a later one's
    marker is smaller than the one it lies on, and its legend entry names the run it covers.
    """
    groups: list[list[Curve]] = []
    for curve in curves:
        same = next((group for group in groups if _coincide(group[0], curve, placed)), None)
        if same is None:
            groups.append([curve])
        else:
            same.append(curve)
    group_of = {curve: group for group in groups for curve in group}
    covers: list[str | None] = []
    for curve in curves:  # in the runs' order, which the legend keeps; a group's first comes first
        group = group_of[curve]
        index = group.index(curve)
        style, label = dict(curve.style), curve.label
        if "marker" not in style and sum(math.isfinite(y) for y in curve.ys) == 1:
            style["marker"] = "o"  # a line of one point is not drawn: a run that failed at its first step
        size = 12.0 if style.get("marker") == SKIPPED_MARKER else 6.0
        if index:
            style["linestyle"] = ((len(group) - index) * DASH, (DASH, (len(group) - 1) * DASH))
            size = max(2.0, size * (1 - index / len(group)))
            label += "" if label.startswith("_") else f", same curve as {group[0].run}"
        if style.get("marker") == SKIPPED_MARKER:
            style.update(markeredgecolor="black", markeredgewidth=0.8)
        axis.plot(curve.xs, curve.ys, color=curve.colour, label=label, markersize=size, **style)
        covers.append(group[0].run if index else None)
    return covers


def _coincide(one: Curve, other: Curve, placed: Callable[[float], float] | None = None) -> bool:
    """Whether two curves of the same thing lie on each other: the same steps, each value within
    :data:`SAME_CURVE` of the other's (or, ``placed`` as the panel places values, within :data:`SAME_LINE` of its
    span), a gap (not finite) where the other has one."""

    def close(a: float, b: float) -> bool:
        if abs(a - b) <= SAME_CURVE * max(abs(a), abs(b)) or (math.isnan(a) and math.isnan(b)):
            return True
        if placed is None or not (math.isfinite(a) and math.isfinite(b)):
            return False
        try:
            return abs(placed(a) - placed(b)) <= SAME_LINE
        except ValueError:  # a value a log panel cannot place (0)
            return False

    return one.of == other.of and one.xs == other.xs and all(close(a, b) for a, b in zip(one.ys, other.ys, strict=True))


def _legend(axis: Any) -> None:
    """The panel's legend, where it has something labelled to say (matplotlib warns otherwise); its lines long
    enough to show each dashed curve's turn, in two columns where it is long."""
    handles, _ = axis.get_legend_handles_labels()
    if handles:
        axis.legend(fontsize=8, handlelength=4, ncols=2 if len(handles) > 8 else 1)


def _series(entry: CandidateEntry) -> Series:
    """The series of a run the picture draws: only those that have one are drawn."""
    assert entry["series"] is not None
    return entry["series"]


def _has_a_loss_scale(entry: CandidateEntry) -> bool:
    return any(value is not None and math.isfinite(value) for value in _series(entry)["loss_scale"])


def _metrics(axis: Any, entries: list[CandidateEntry], colours: dict[str, str]) -> None:
    """Each logged metric over the evaluation runs' steps: a colour per run, a marker per metric, each said once in
    the legend (a run whose every curve covers another run's names it)."""
    from matplotlib.lines import Line2D

    names = sorted({name for entry in entries for e in entry["evaluations"] for name in e["metrics"]})
    if not names:
        axis.text(0.5, 0.5, "no metric was logged in validation or test", ha="center", transform=axis.transAxes)
        return
    markers = {name: "osd^v<>p*h"[n % 10] for n, name in enumerate(names)}
    curves = []
    for entry in entries:
        for name in names:
            found = [(float(e["step"]), e["metrics"][name]) for e in entry["evaluations"] if name in e["metrics"]]
            if found:
                xs, ys = (list(values) for values in zip(*found, strict=True))
                label, style = f"_{entry['name']}: {name}", {"marker": markers[name]}
                curves.append(Curve(entry["name"], name, label, xs, ys, colours[entry["name"]], style))
    covers = _draw(axis, curves)
    handles = []
    for entry in entries:
        covered = {cover for curve, cover in zip(curves, covers, strict=True) if curve.run == entry["name"]}
        if covered:  # a run that logged nothing has no curve
            same = f", same curves as {covered.pop()}" if len(covered) == 1 and None not in covered else ""
            handles.append(Line2D([], [], color=colours[entry["name"]], label=f"{entry['name']}{same}"))
    handles += [Line2D([], [], color="grey", marker=markers[name], linestyle="", label=name) for name in names]
    axis.legend(handles=handles, fontsize=8, handlelength=4)


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
