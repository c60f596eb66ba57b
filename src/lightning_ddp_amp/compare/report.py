"""The report of ``lightning-ddp-amp compare``: are the runs comparable, and how far is each from the baseline.

Definitions (``docs/compare.md`` explains how to read them):

* The loss of a step is the mean over ranks of what each rank gave to backward since its previous step.
* The *relative loss difference* of a step is ``|loss - baseline loss| / |baseline loss|``, over the steps both
  runs took. The *final loss* is the mean over the last tenth of those steps (at least one).
* The *weight distance* is ``‖w - w_baseline‖ / ‖w_baseline - w_start‖``: how far the candidate's final weights are
  from the baseline's, as a fraction of how far the baseline moved from the common start. It is 1 for a candidate
  that never moved (every step skipped), and about 0.1 for the same precision at a learning rate 10% off. Per
  submodule (the module that holds each parameter) the same ratio uses that submodule's own weights.
* A candidate is **identical** when it took the baseline's steps with the baseline's loss at each and ended in its
  weights, bit for bit; else **close** when its final loss is within the loss tolerance of the baseline's and its
  weight distance within the weight tolerance; otherwise **apart**, with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_ddp_amp.amp import apex_loader
from lightning_ddp_amp.compare.recorder import FINAL_WEIGHTS, RECORD_FILE, START_WEIGHTS

#: The ``schema`` value of ``compare.json`` (documented in ``docs/compare.md`` and ``docs/compare.schema.json``).
SCHEMA = "lightning-ddp-amp/compare/1"
JSON_FILE = "compare.json"
PNG_FILE = "compare.png"
#: The panels of ``compare.png``, in order, with the series each plots.
PANELS = (
    ("Loss", "loss"),
    ("Relative loss difference to the baseline", "relative_loss_difference"),
    ("Loss scale (x: skipped step)", "loss_scale"),
    ("Step time (s)", "step_time_s"),
)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Beyond these a candidate is apart: the relative final-loss difference, and the relative weight distance.

    The defaults were measured on ``examples/two_models_one_optimizer.py`` (``docs/compare.md``): ``apex-O1`` against
    ``amp-O1`` differ by a fraction of these, the same precision at a learning rate 10% off by several times them.
    """

    loss: float = 0.02
    weights: float = 0.05

    @classmethod
    def parse(cls, text: str) -> Tolerance:
        """``"0.05"`` (both) or ``"0.02,0.05"`` (loss, weights); an argparse ``type``."""
        parts = text.split(",")
        try:
            values = [float(part) for part in parts]
        except ValueError:
            values = []
        if len(values) not in (1, 2) or not all(math.isfinite(v) and v > 0 for v in values):
            raise argparse.ArgumentTypeError(
                f"--tolerance={text!r}: expected one or two positive numbers. Fix: e.g. --tolerance 0.05 (both) or"
                " --tolerance 0.02,0.05 (final loss, weights)"
            )
        return cls(values[0], values[-1])


@dataclasses.dataclass
class Candidate:
    """One precision's run: what ran, and how it ended."""

    name: str
    precision: str
    command: list[str]
    directory: Path
    returncode: int | None = None
    error: str | None = None

    _record: dict[str, Any] | None = dataclasses.field(default=None, init=False, repr=False)

    def record(self) -> dict[str, Any] | None:
        """The run's ``record.json``, read once the run has ended."""
        if self._record is None:
            path = self.directory / RECORD_FILE
            self._record = json.loads(path.read_text()) if path.is_file() else None
        return self._record

    def failure(self) -> str | None:
        """Why the run failed, preferring the error a rank raised; None when it finished with a record.

        Error files count only for a run that failed: a helper process of a good run may have raised one.
        """
        if self.error is not None:
            return self.error
        if not self.returncode and self.record() is not None:
            return None
        errors = sorted(
            (self.directory / "errors").glob("*.json"), key=lambda p: (not p.name.startswith("rank"), p.name)
        )
        if errors:
            error = json.loads(errors[0].read_text())
            where = f"on rank {error['rank']}" if error["rank"] is not None else "in the script"
            return f"{error['type']} {where}: {error['message']}"
        if self.returncode:
            return f"the command exited with status {self.returncode} (its output is above)"
        return (
            "the command finished without a record: it never completed a Trainer.fit of lightning or"
            " pytorch_lightning, or its Python ignored PYTHONPATH (python -E or -I)"
        )


def build(candidates: list[Candidate], tolerance: Tolerance, *, steps: int, argv: list[str]) -> dict[str, Any]:
    """The report as ``compare.json`` holds it."""
    baseline = candidates[0]
    entries = [_entry(candidate) for candidate in candidates]
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "command": ["lightning-ddp-amp", "compare", *argv],
        "steps": steps,
        "tolerance": dataclasses.asdict(tolerance),
        "versions": _versions(),
        "apex": _apex(),
        "baseline": baseline.name,
        "comparable": False,
        "problem": None,
        "candidates": entries,
    }
    if entries[0]["status"] == "failed":
        report["problem"] = f"the baseline {baseline.name} failed, so there is nothing to compare against"
        for entry in entries[1:]:
            if entry["status"] != "failed":
                entry["status"], entry["reason"] = "not compared", "the baseline failed"
        return report
    records = [
        candidate.record() if entry["status"] != "failed" else None
        for candidate, entry in zip(candidates, entries, strict=True)
    ]
    problem = _incomparable(candidates, records)
    if problem is not None:
        report["problem"] = problem
        for entry in entries:
            if entry["status"] != "failed":
                entry["status"], entry["reason"] = "not compared", "the runs did not start alike"
        return report
    report["comparable"] = True
    base_series = entries[0]["series"]
    start = torch.load(baseline.directory / START_WEIGHTS)
    base_weights = torch.load(baseline.directory / FINAL_WEIGHTS)
    for candidate, entry in zip(candidates, entries, strict=True):
        if entry["status"] == "failed":
            continue
        weights = torch.load(candidate.directory / FINAL_WEIGHTS)
        entry["summary"] = _summary(
            entry["series"], base_series, weights, base_weights, start, entries[0], entry["peak_memory_bytes"]
        )
        if candidate is baseline:
            entry["status"], entry["reason"] = "baseline", "the baseline"
        else:
            entry["summary"]["first_step_apart"] = _first_apart(entry, tolerance)
            entry["summary"]["explanation"] = _explain(entry, entries[0])
            entry["status"], entry["reason"] = _verdict(entry["summary"], tolerance)
            if entry["summary"]["explanation"]:
                entry["reason"] += f"; {entry['summary']['explanation']}"
            if _identical(entry["series"], base_series, weights, base_weights):
                entry["status"] = "identical"
                entry["reason"] = "the baseline's loss at every step and its final weights, bit for bit"
            if entry["ran_as"] == entries[0]["ran_as"] and candidate.command == baseline.command:
                entry["reason"] += (
                    f"; it trained as the baseline did ({entry['ran_as']}), so this compares a run with itself"
                )
                if candidate.precision.startswith("amp-"):
                    entry["reason"] += (
                        f" (amp-O* runs apex where apex is installed: name native-{candidate.precision[4:]} for torch's AMP)"
                    )
    return report


def _entry(candidate: Candidate) -> dict[str, Any]:
    failure = candidate.failure()
    record = None if failure is not None else candidate.record()
    entry: dict[str, Any] = {
        "name": candidate.name,
        "precision": candidate.precision,
        "command": candidate.command,
        "directory": str(candidate.directory),
        "returncode": candidate.returncode,
        "status": "failed" if record is None else "recorded",
        "reason": failure,
        "world_size": None,
        "ran_as": None,
        "restarts": None,
        "replaced": [],
        "turned_off": [],
        "series": None,
        "summary": None,
    }
    if record is not None:
        ranks = record["ranks"]
        first = ranks[0]
        entry.update(
            world_size=record["world_size"],
            ran_as=record["ran_as"],
            restarts=record["restarts"],
            replaced=record["replaced"],
            turned_off=record["turned_off"],
        )
        entry["series"] = {
            "step": first["step"],
            "loss": [_mean([rank["loss"][i] for rank in ranks]) for i in range(len(first["step"]))],
            "loss_by_rank": [rank["loss"] for rank in ranks],
            "skipped": first["skipped"],
            "loss_scale": first["loss_scale"],
            "grad_norm": first["grad_norm"],
            "lr": first["lr"],
            "step_time_s": [max(rank["step_time_s"][i] for rank in ranks) for i in range(len(first["step"]))],
            "relative_loss_difference": [],
        }
        entry["peak_memory_bytes"] = max(rank["peak_memory_bytes"] for rank in ranks)
        entry["peak_memory_kind"] = first["peak_memory_kind"]
    return entry


def _incomparable(candidates: list[Candidate], records: list[dict[str, Any] | None]) -> str | None:
    """What makes the recorded runs unlike the baseline's, with the fix; None when they all started alike."""
    baseline, base = candidates[0], records[0]
    assert base is not None
    for candidate, record in zip(candidates[1:], records[1:], strict=True):
        if record is None:
            continue
        if record["world_size"] != base["world_size"]:
            return (
                f"the runs trained on different numbers of ranks ({baseline.name}: {base['world_size']},"
                f" {candidate.name}: {record['world_size']}). Fix: launch every candidate the same way"
            )
        for ours, theirs in zip(base["ranks"], record["ranks"], strict=True):
            where = f"rank {ours['rank']}: {candidate.name} against the baseline {baseline.name}"
            if ours["weights_hash"] != theirs["weights_hash"]:
                return (
                    f"the model's initial weights differ between runs ({where}). Fix: call"
                    " `lightning.seed_everything(...)` (or torch.manual_seed) before building the model; with"
                    " LightningCLI, set `seed_everything: 42` in the config (its default, true, picks a new seed"
                    " every run)"
                )
            if ours["batch_hash"] != theirs["batch_hash"]:
                return (
                    f"the first training batch differs between runs ({where}). Fix: call"
                    " `lightning.seed_everything(...)` before building the DataLoader, or give it a"
                    " torch.Generator with a fixed seed; with LightningCLI, set `seed_everything: 42` in the config"
                )
    return None


def _summary(
    series: dict[str, Any],
    base: dict[str, Any],
    weights: dict[str, torch.Tensor],
    base_weights: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
    base_entry: dict[str, Any],
    entry_memory: int,
) -> dict[str, Any]:
    common = [step for step in base["step"] if step in set(series["step"])]
    ours = dict(zip(series["step"], series["loss"], strict=True))
    theirs = dict(zip(base["step"], base["loss"], strict=True))
    differences: list[float] = [_relative(ours[step], theirs[step]) for step in common]  # type: ignore[misc]
    series["relative_loss_difference"] = [
        dict(zip(common, differences, strict=True)).get(step) for step in series["step"]
    ]
    tail = max(1, len(common) // 10)
    final = _mean([ours[step] for step in common[-tail:]])
    base_final = _mean([theirs[step] for step in common[-tail:]])
    skipped = [step for step, flag in zip(series["step"], series["skipped"], strict=True) if flag]
    submodules = _submodule_distances(weights, base_weights, start)
    times, base_times = series["step_time_s"], base["step_time_s"]
    median = statistics.median(times) if times else None
    return {
        "final_loss": final,
        "final_loss_relative_difference": _relative(final, base_final),
        "max_relative_loss_difference": max(differences, default=None),
        "mean_relative_loss_difference": _mean(differences) if differences else None,
        "first_step_apart": None,
        "explanation": None,
        "weight_distance": _distance(list(weights), weights, base_weights, start),
        "submodule_distances": sorted(submodules, key=lambda s: -_order(s["distance"]))[:3],
        "skipped_steps": skipped,
        "final_loss_scale": series["loss_scale"][-1] if series["loss_scale"] else None,
        "median_step_time_s": median,
        "step_time_ratio": _ratio(median, statistics.median(base_times)) if median and base_times else None,
        "peak_memory_bytes": entry_memory,
        "peak_memory_ratio": _ratio(entry_memory, base_entry["peak_memory_bytes"]),
    }


def _identical(
    series: dict[str, Any],
    base: dict[str, Any],
    weights: dict[str, torch.Tensor],
    base_weights: dict[str, torch.Tensor],
) -> bool:
    """Whether a run trained exactly as the baseline did: the same steps and losses, the same final weights."""
    if series["step"] != base["step"] or series["loss"] != base["loss"] or weights.keys() != base_weights.keys():
        return False
    return all(torch.equal(weights[name], base_weights[name]) for name in weights)


def _verdict(summary: dict[str, Any], tolerance: Tolerance) -> tuple[str, str]:
    reasons = []
    final, distance = summary["final_loss_relative_difference"], summary["weight_distance"]
    if final is None or not math.isfinite(final) or final > tolerance.loss:
        reasons.append(f"final loss {_percent(final)} from the baseline's (tolerance {_percent(tolerance.loss)})")
    if distance is None or not math.isfinite(distance) or distance > tolerance.weights:
        reasons.append(
            f"weights {_percent(distance)} of the baseline's travel away (tolerance {_percent(tolerance.weights)})"
        )
    if reasons:
        return "apart", "; ".join(reasons)
    return "close", (
        f"final loss {_percent(final)} from the baseline's, weights {_percent(distance)} of its travel away"
        f" (tolerances {_percent(tolerance.loss)}, {_percent(tolerance.weights)})"
    )


def _first_apart(entry: dict[str, Any], tolerance: Tolerance) -> int | None:
    for step, difference in zip(entry["series"]["step"], entry["series"]["relative_loss_difference"], strict=True):
        if difference is None:
            continue
        if not math.isfinite(difference) or difference > tolerance.loss:
            return int(step)
    return None


def _explain(entry: dict[str, Any], base: dict[str, Any]) -> str | None:
    """Why a run leaves the tolerance where it does, when a step skipped in one run only explains it.

    A step skipped on overflow leaves the weights as they were and holds the LR schedule back one step, so from there
    the two runs train out of phase: a difference that is not the precision's rounding.
    """
    first = entry["summary"]["first_step_apart"]
    if first is None:
        return None
    ours, theirs = set(entry["summary"]["skipped_steps"]), set(base["summary"]["skipped_steps"])
    alone = sorted(step for step in ours ^ theirs if step < first)
    if not alone:
        return None
    step = alone[-1]
    who = "this run" if step in ours else "the baseline"
    said = (
        f"it leaves the tolerance at step {first}, after step {step}, which {who} alone skipped on overflow: a skipped"
        " step keeps the weights and holds the LR schedule back, so the runs train out of phase from there"
    )
    shift = _lr_shift(entry["series"], base["series"], after=step)
    if shift:
        said += f"; its LR schedule runs {abs(shift)} step(s) {'behind' if shift > 0 else 'ahead of'} the baseline's"
    return said


def _lr_shift(series: dict[str, Any], base: dict[str, Any], after: int) -> int:
    """How many steps this run's LR lags the baseline's after step ``after`` (negative: leads); 0 when it does not,
    or when the LR does not change there."""
    ours = {step: lr for step, lr in zip(series["step"], series["lr"], strict=True) if step > after}
    theirs = dict(zip(base["step"], base["lr"], strict=True))
    if len(set(ours.values())) < 2:
        return 0
    for shift in (1, -1, 2, -2, 3, -3):
        pairs = [(lr, theirs[step - shift]) for step, lr in ours.items() if step - shift in theirs]
        if len(pairs) >= 2 and all(a == b for a, b in pairs) and any(ours[s] != theirs.get(s) for s in ours):
            return shift
    return 0


def _submodule_distances(
    weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> list[dict[str, Any]]:
    groups: dict[str, list[str]] = {}
    for name in weights:
        groups.setdefault(name.rpartition(".")[0] or name, []).append(name)
    return [{"name": module, "distance": _distance(names, weights, base, start)} for module, names in groups.items()]


def _distance(
    names: list[str], weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> float | None:
    names = [name for name in names if name in base and name in start]
    if not names:
        return None
    apart = math.sqrt(sum(float((weights[n] - base[n]).double().square().sum()) for n in names))
    travel = math.sqrt(sum(float((base[n] - start[n]).double().square().sum()) for n in names))
    if travel == 0:
        return 0.0 if apart == 0 else math.inf
    return apart / travel


def _relative(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    if reference == 0:
        return 0.0 if value == 0 else math.inf
    return abs(value - reference) / abs(reference)


def _ratio(value: float, reference: float) -> float | None:
    return value / reference if reference else None


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def _order(value: float | None) -> float:
    return -1.0 if value is None else math.inf if math.isnan(value) else value


def _percent(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "not finite"
    return f"{100 * value:.3g}%"


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("lightning", "pytorch-lightning", "lightning-ddp-amp"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    apex = _apex()
    found["apex"] = None if apex is None else apex["version"]
    return found


def _apex() -> dict[str, Any] | None:
    """The apex the runs import: where, its version (``"unknown"`` for a build without package metadata, as a
    source checkout on the path), and whether it is this repository's CPU test double; None without apex."""
    found = apex_loader.installation()
    if found is None:
        return None
    version = found["version"] or ("test double" if found["test_double"] else "unknown")
    return {"location": found["location"], "version": version, "test_double": found["test_double"]}


def render(report: dict[str, Any]) -> str:
    """The terminal table: one column per candidate, the baseline first, then each verdict with its reason."""
    entries = report["candidates"]
    lines = [f"\ncompare: {len(entries)} runs of {report['steps']} steps at most; baseline {report['baseline']}"]
    for entry in entries:
        if entry["turned_off"]:
            lines.append(
                f"  {entry['name']}: turned off {', '.join(entry['turned_off'])} (it cannot write into the run's folder)"
            )
    if not report["comparable"]:
        lines += [f"  {e['name']}: FAILED: {e['reason']}" for e in entries if e["status"] == "failed"]
        lines.append(f"NOT COMPARED: {report['problem']}")
        return "\n".join(lines)
    compared = [e for e in entries if e["summary"] is not None]
    Cell = Callable[[dict[str, Any], dict[str, Any]], str]
    rows: list[tuple[str, Cell]] = [
        ("ran as", lambda e, s: str(e["ran_as"])),
        ("steps", lambda e, s: _steps(e)),
        ("final loss", lambda e, s: f"{s['final_loss']:.6g}"),
        ("final loss difference", lambda e, s: _percent(s["final_loss_relative_difference"])),
        (
            "max / mean loss difference",
            lambda e, s: (
                f"{_percent(s['max_relative_loss_difference'])} / {_percent(s['mean_relative_loss_difference'])}"
            ),
        ),
        ("first step apart", lambda e, s: "-" if s["first_step_apart"] is None else str(s["first_step_apart"])),
        ("weight distance", lambda e, s: _percent(s["weight_distance"])),
        (
            "furthest submodules",
            lambda e, s: ", ".join(f"{m['name']} {_percent(m['distance'])}" for m in s["submodule_distances"]),
        ),
        ("skipped steps", lambda e, s: _skips(s["skipped_steps"])),
        ("final loss scale", lambda e, s: "-" if s["final_loss_scale"] is None else f"{s['final_loss_scale']:g}"),
        (
            "median step time",
            lambda e, s: (
                f"{s['median_step_time_s'] * 1000:.3g} ms (x{s['step_time_ratio']:.2f})"
                if s["median_step_time_s"] and s["step_time_ratio"]
                else "-"
            ),
        ),
        (
            "peak memory",
            lambda e, s: (
                f"{s['peak_memory_bytes'] / 2**20:.0f} MiB (x{s['peak_memory_ratio']:.2f})"
                if s["peak_memory_ratio"]
                else "-"
            ),
        ),
        ("verdict", lambda e, s: e["status"]),
    ]
    table = [["", *(e["name"] for e in compared)]] + [
        [label, *(cell(e, e["summary"]) for e in compared)] for label, cell in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in table]
    for entry in entries:
        if entry["status"] in ("identical", "close", "apart"):
            lines.append(f"{entry['name']}: {entry['status'].upper()}: {entry['reason']}")
        elif entry["status"] == "failed":
            lines.append(f"{entry['name']}: FAILED: {entry['reason']}")
    return "\n".join(lines)


def _steps(entry: dict[str, Any]) -> str:
    steps = entry["series"]["step"]
    text = f"{len(steps)}" + (f" (from step {steps[0]})" if steps and steps[0] else "")
    return text + (f", after {entry['restarts']} restart(s)" if entry["restarts"] else "")


def _skips(steps: list[int]) -> str:
    if not steps:
        return "0"
    shown = ", ".join(str(step) for step in steps[:5])
    return f"{len(steps)} ({shown}{', ...' if len(steps) > 5 else ''})"


def write(report: dict[str, Any], out: Path) -> int:
    """Write ``compare.json`` and, with matplotlib, ``compare.png``; returns the exit status of ``compare``."""
    (out / JSON_FILE).write_text(json.dumps(_finite(report), indent=2))
    print(f"compare: wrote {out / JSON_FILE}")
    if report["comparable"]:
        if plot(report, out / PNG_FILE) is None:
            print('compare: no picture: matplotlib is not installed (pip install "lightning-ddp-amp[compare]")')
        else:
            print(f"compare: wrote {out / PNG_FILE}")
    statuses = {entry["status"] for entry in report["candidates"]}
    if not report["comparable"]:
        return 2
    return 1 if statuses & {"apart", "failed"} else 0


def _finite(value: Any) -> Any:
    """JSON has no inf or NaN: a value that is not finite is written as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def plot(report: dict[str, Any], path: Path) -> Any:
    """Draw the four panels of :data:`PANELS` into ``path``; returns the figure, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return None
    figure, axes = pyplot.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    entries = [entry for entry in report["candidates"] if entry["summary"] is not None]
    for axis, (title, key) in zip(axes.flat, PANELS, strict=True):
        axis.set_title(title)
        axis.set_xlabel("step")
        for entry in entries:
            series = entry["series"]
            values = [math.nan if v is None else v for v in series[key]]
            (line,) = axis.plot(series["step"], values, label=entry["name"])
            if key == "loss_scale":
                skipped = [
                    (step, v) for step, v, flag in zip(series["step"], values, series["skipped"], strict=True) if flag
                ]
                if skipped:
                    axis.plot(
                        *zip(*skipped, strict=True), "x", color=line.get_color(), label=f"_{entry['name']} skipped"
                    )
        if key == "loss_scale":
            axis.set_yscale("log", base=2)
        axis.legend()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return figure
