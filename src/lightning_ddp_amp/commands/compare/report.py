"""The report of ``lightning-ddp-amp compare``: are the runs comparable, and how far is each from the baseline.

A candidate is **identical** when it took the baseline's steps with the baseline's loss at each and ended in its
weights, bit for bit; else **close** when its final loss is within the loss tolerance of the baseline's, its weight
distance within the weight tolerance and each ``--metric`` within its own
(:mod:`~lightning_ddp_amp.commands.compare.tolerance`); otherwise **apart**, with the reason. The numbers the verdict rests
on, and their definitions, are :mod:`~lightning_ddp_amp.commands.compare.summary`'s; the shape of ``compare.json`` is
:mod:`~lightning_ddp_amp.commands.compare.schema`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from lightning_ddp_amp.amp import apex_loader
from lightning_ddp_amp.commands.compare import picture, run_folder
from lightning_ddp_amp.commands.compare.run_folder import ERRORS, FINAL_WEIGHTS, START_WEIGHTS
from lightning_ddp_amp.commands.compare.schema import (
    APART,
    BASELINE,
    CANDIDATE,
    CLOSE,
    FAILED,
    IDENTICAL,
    NOISE_FLOOR,
    NOT_COMPARED,
    SCHEMA,
    Apex,
    CandidateEntry,
    Evaluation,
    Overflow,
    Report,
    Role,
    Series,
    Status,
    Summary,
    Versions,
)
from lightning_ddp_amp.commands.compare.summary import call, last_values, noise_floor, spread, summarize
from lightning_ddp_amp.commands.compare.tolerance import Metric, Tolerance
from lightning_ddp_amp.versions import installed

JSON_FILE = "compare.json"
PNG_FILE = "compare.png"


@dataclasses.dataclass
class Candidate:
    """One precision's run: what ran, and how it ended.

    ``role`` is ``baseline``, ``candidate`` or ``noise floor`` (the baseline's second run, ``--noise-floor``).
    """

    name: str
    precision: str
    command: list[str]
    directory: Path
    returncode: int | None = None
    error: str | None = None
    role: Role = CANDIDATE

    _record: dict[str, Any] | None = dataclasses.field(default=None, init=False, repr=False)

    def record(self) -> dict[str, Any] | None:
        """The run's ``record.json``, read once the run has ended."""
        if self._record is None:
            self._record = run_folder.read_record(self.directory)
        return self._record

    def failure(self) -> str | None:
        """Why the run failed, preferring the error a rank raised; None when it finished with a record.

        Error files count only for a run that failed: a helper process of a good run may have raised one.
        """
        if self.error is not None:
            return self.error
        if not self.returncode and self.record() is not None:
            return None
        errors = sorted((self.directory / ERRORS).glob("*.json"), key=lambda p: (not p.name.startswith("rank"), p.name))
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


def build(
    candidates: list[Candidate],
    tolerance: Tolerance,
    *,
    steps: int,
    argv: list[str],
    metrics: Sequence[Metric] = (),
) -> Report:
    """The report as ``compare.json`` holds it."""
    baseline = candidates[0]
    entries = [_entry(candidate) for candidate in candidates]
    entries[0]["role"] = BASELINE  # whatever the caller named it: the first run is what the others are held to
    report: Report = {
        "schema": SCHEMA,
        "command": ["lightning-ddp-amp", "compare", *argv],
        "steps": steps,
        "tolerance": {"loss": tolerance.loss, "weights": tolerance.weights},
        "metrics": [{"name": m.name, "tolerance": m.tolerance_text()} for m in metrics],
        "versions": _versions(),
        "hardware": _hardware(),
        "apex": _apex(),
        "baseline": baseline.name,
        "comparable": False,
        "problem": None,
        "noise_floor": None,
        "spread": None,
        "candidates": entries,
    }
    if entries[0]["status"] == FAILED:
        report["problem"] = f"the baseline {baseline.name} failed, so there is nothing to compare against"
        for entry in entries[1:]:
            if entry["status"] != FAILED:
                entry["reason"] = "the baseline failed"
        return report
    records = [
        candidate.record() if entry["status"] != FAILED else None
        for candidate, entry in zip(candidates, entries, strict=True)
    ]
    problem = _incomparable(candidates, records)
    if problem is not None:
        report["problem"] = problem
        for entry in entries:
            if entry["status"] != FAILED:
                entry["reason"] = "the runs did not start alike"
        return report
    report["comparable"] = True
    base_entry, base_series = entries[0], entries[0]["series"]
    assert base_series is not None
    start = torch.load(baseline.directory / START_WEIGHTS)
    base_weights = torch.load(baseline.directory / FINAL_WEIGHTS)
    compared = [(c, e) for c, e in zip(candidates, entries, strict=True) if e["status"] != FAILED]
    final_weights = {}
    for candidate, entry in compared:
        weights = final_weights[candidate.name] = torch.load(candidate.directory / FINAL_WEIGHTS)
        entry["summary"] = summarize(entry, base_entry, weights, base_weights, start)
    noise = next((e for c, e in compared if c.role == NOISE_FLOOR), None)
    report["noise_floor"] = None if noise is None else noise_floor(noise)
    report["spread"] = widths = spread(base_entry, noise)
    report["problem"] = _missing_metric(base_entry["evaluations"], metrics)
    for candidate, entry in compared:
        summary, series = entry["summary"], entry["series"]
        assert summary is not None and series is not None
        summary["step_time_call"] = call(summary["step_time_ratio"], widths["step_time"])
        summary["peak_memory_call"] = call(summary["peak_memory_ratio"], widths["peak_memory"])
        if candidate is baseline:
            entry["status"], entry["reason"] = BASELINE, "the baseline"
            continue
        if candidate.role == NOISE_FLOOR:
            entry["status"] = NOISE_FLOOR
            entry["reason"] = "the baseline run again with every initial weight one ulp up"
            continue
        summary["first_step_apart"] = _first_apart(series, tolerance)
        summary["explanation"] = _explain(entry, base_entry)
        status, reason = _verdict(summary, tolerance, metrics)
        if summary["explanation"]:
            reason += f"; {summary['explanation']}"
        if summary["scale_trend"] and summary["scale_trend"]["model_problem"]:
            reason += f"; {summary['scale_trend']['advice']}"
        if _identical(series, base_series, final_weights[candidate.name], base_weights):
            status, reason = IDENTICAL, "the baseline's loss at every step and its final weights, bit for bit"
        if entry["ran_as"] == base_entry["ran_as"] and candidate.command == baseline.command:
            reason += f"; it trained as the baseline did ({entry['ran_as']}), so this compares a run with itself"
            if candidate.precision.startswith("amp-"):
                reason += f" (amp-O* runs apex where apex is installed: name native-{candidate.precision[4:]} for torch's AMP)"
        entry["status"], entry["reason"] = status, reason
    return report


def _entry(candidate: Candidate) -> CandidateEntry:
    """The run as far as its folder tells, before any comparison: ``failed``, or ``not compared`` yet."""
    failure = candidate.failure()
    record = None if failure is not None else candidate.record()
    entry: CandidateEntry = {
        "name": candidate.name,
        "precision": candidate.precision,
        "role": candidate.role,
        "command": candidate.command,
        "directory": str(candidate.directory),
        "returncode": candidate.returncode,
        "status": FAILED if record is None else NOT_COMPARED,
        "reason": failure,
        "world_size": None,
        "ran_as": None,
        "restarts": None,
        "replaced": [],
        "turned_off": [],
        "series": None,
        "evaluations": [],
        "overflows": [],
        "summary": None,
    }
    if record is None:  # a crash keeps the steps taken before it: the fit's record when it came after the fit
        finished = candidate.record()
        ranks = finished["ranks"] if finished is not None else run_folder.read_partial(candidate.directory)
        if ranks:
            entry["series"] = _series(ranks)
            entry["overflows"] = _overflows(ranks)
        if finished is not None:
            entry["evaluations"] = finished.get("evaluations", [])
        return entry
    entry["world_size"] = record["world_size"]
    entry["ran_as"] = record["ran_as"]
    entry["restarts"] = record["restarts"]
    entry["replaced"] = record["replaced"]
    entry["turned_off"] = record["turned_off"]
    entry["evaluations"] = record.get("evaluations", [])
    entry["series"] = series = _series(record["ranks"])
    entry["overflows"] = _overflows(record["ranks"])
    series["weight_distance"] = [[step, d] for step, d in record.get("weight_distances", [])]
    entry["peak_memory_bytes"] = max(rank["peak_memory_bytes"] for rank in record["ranks"])
    entry["peak_memory_kind"] = record["ranks"][0]["peak_memory_kind"]
    return entry


def _series(ranks: list[dict[str, Any]]) -> Series:
    """The run's series from its ranks' records: the loss averaged over ranks, the step time the slowest rank's, the
    rest rank 0's; as long as the shortest rank's (a crash may stop ranks a step apart)."""
    first = ranks[0]
    count = min(len(rank["step"]) for rank in ranks)
    return {
        "step": first["step"][:count],
        "loss": [math.fsum(rank["loss"][i] for rank in ranks) / len(ranks) for i in range(count)],
        "loss_by_rank": [rank["loss"][:count] for rank in ranks],
        "skipped": first["skipped"][:count],
        "loss_scale": first["loss_scale"][:count],
        "grad_norm": first["grad_norm"][:count],
        "lr": first["lr"][:count],
        "step_time_s": [max(rank["step_time_s"][i] for rank in ranks) for i in range(count)],
        "slowed_steps": first.get("slowed_steps", []),
        "relative_loss_difference": [],
        "weight_distance": [],
    }


def _overflows(ranks: list[dict[str, Any]]) -> list[Overflow]:
    """Each located overflow once, per step the rank that found the most (a place before "not reproduced")."""
    found: dict[int, Overflow] = {}
    for rank in ranks:
        for overflow in rank.get("overflows", []):
            step, known = overflow["step"], overflow["module"] is not None
            if step not in found or (known and found[step]["module"] is None):
                found[step] = cast(Overflow, {**overflow, "rank": rank["rank"]})  # record.json's, and its rank
    return [found[step] for step in sorted(found)]


def _incomparable(candidates: list[Candidate], records: Sequence[dict[str, Any] | None]) -> str | None:
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


def stop_after_baseline(baseline: Candidate, metrics: Sequence[Metric]) -> str | None:
    """Why no other run should start once the baseline has ended, in a few words: it failed, or it never logged a
    ``--metric``; the other runs would be for nothing, and the report says the rest. None when they should run."""
    if baseline.failure() is not None:
        return f"the baseline {baseline.name} failed"
    record = baseline.record()
    assert record is not None  # a run that did not fail has its record
    if _missing_metric(record.get("evaluations", []), metrics) is not None:
        return "the baseline never logged a --metric"
    return None


def _missing_metric(evaluations: list[Evaluation], metrics: Sequence[Metric]) -> str | None:
    """A ``--metric`` the baseline never logged: the verdict cannot use it."""
    logged = sorted(last_values(evaluations))
    for metric in metrics:
        if metric.name not in logged:
            return (
                f"--metric={metric.name!r}: the baseline logged no such metric in validation or test (it logged:"
                f" {', '.join(logged) or 'none'}). Fix: name one of those, or log it with self.log({metric.name!r}, ...)"
                " in validation_step or test_step, and give the run a validation or test loader"
            )
    return None


def _identical(
    series: Series,
    base: Series,
    weights: dict[str, torch.Tensor],
    base_weights: dict[str, torch.Tensor],
) -> bool:
    """Whether a run trained exactly as the baseline did: the same steps and losses, the same final weights."""
    if series["step"] != base["step"] or series["loss"] != base["loss"] or weights.keys() != base_weights.keys():
        return False
    return all(torch.equal(weights[name], base_weights[name]) for name in weights)


def _verdict(summary: Summary, tolerance: Tolerance, metrics: Sequence[Metric] = ()) -> tuple[Status, str]:
    reasons = []
    final, distance = summary["final_loss_relative_difference"], summary["weight_distance"]
    if final is None or not math.isfinite(final) or final > tolerance.loss:
        reasons.append(f"final loss {percent(final)} from the baseline's (tolerance {percent(tolerance.loss)})")
    if distance is None or not math.isfinite(distance) or distance > tolerance.weights:
        reasons.append(
            f"weights {percent(distance)} of the baseline's travel away (tolerance {percent(tolerance.weights)})"
        )
    held = []
    for metric in metrics:
        found = summary.get("metrics", {}).get(metric.name)
        if found is None or found["baseline"] is None:
            continue  # the baseline never logged it: the report's problem says so
        if found["value"] is None:
            reasons.append(f"it logged no {metric.name}")
        elif not metric.within(found["value"], found["baseline"]):
            reasons.append(
                f"{metric.name} {found['value']:.6g} against the baseline's {found['baseline']:.6g}"
                f" (tolerance {metric.tolerance_text()})"
            )
        else:
            held.append(f"{metric.name} {found['value']:.6g} against {found['baseline']:.6g}")
    if reasons:
        return APART, "; ".join(reasons)
    return CLOSE, (
        f"final loss {percent(final)} from the baseline's, weights {percent(distance)} of its travel away"
        f" (tolerances {percent(tolerance.loss)}, {percent(tolerance.weights)})" + "".join(f"; {text}" for text in held)
    )


def _first_apart(series: Series, tolerance: Tolerance) -> int | None:
    for step, difference in zip(series["step"], series["relative_loss_difference"], strict=True):
        if difference is None:
            continue
        if not math.isfinite(difference) or difference > tolerance.loss:
            return int(step)
    return None


def _explain(entry: CandidateEntry, base: CandidateEntry) -> str | None:
    """Why a run leaves the tolerance where it does, when a step skipped in one run only explains it: the step apart
    itself (the skipping run's loss there is often not finite: the overflow), or the last such step before it.

    A step skipped on overflow leaves the weights as they were and holds the LR schedule back one step, so from there
    the two runs train out of phase: a difference that is not the precision's rounding.
    """
    summary, base_summary = entry["summary"], base["summary"]
    series, base_series = entry["series"], base["series"]
    assert summary is not None and base_summary is not None and series is not None and base_series is not None
    first = summary["first_step_apart"]
    if first is None:
        return None
    ours, theirs = set(summary["skipped_steps"]), set(base_summary["skipped_steps"])
    alone = sorted(step for step in ours ^ theirs if step <= first)
    if not alone:
        return None
    step = alone[-1]
    who, other = ("this run", "the baseline") if step in ours else ("the baseline", "this run")
    if step == first:
        skipping = series if step in ours else base_series
        at = skipping["step"].index(step)
        scale, loss = skipping["loss_scale"][at], skipping["loss"][at]
        details = ([] if scale is None else [f"loss scale {scale:g}"]) + (
            [] if math.isfinite(loss) else ["its loss not finite"]
        )
        which = f" ({', '.join(details)})" if details else ""
        said = (
            f"it leaves the tolerance at step {first}, which {who} alone skipped on overflow{which} and {other} trained"
        )
    else:
        said = f"it leaves the tolerance at step {first}, after step {step}, which {who} alone skipped on overflow"
    said += (
        ": a skipped step keeps the weights and holds the LR schedule back, so the runs train out of phase from there"
    )
    shift = _lr_shift(series, base_series, after=step)
    if shift:
        said += f"; its LR schedule runs {abs(shift)} step(s) {'behind' if shift > 0 else 'ahead of'} the baseline's"
    return said


def _lr_shift(series: Series, base: Series, after: int) -> int:
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


def percent(value: float | None) -> str:
    """A fraction as the report says it: ``0.0123`` is ``"1.23%"``; None or not finite is ``"not finite"``."""
    if value is None or not math.isfinite(value):
        return "not finite"
    return f"{100 * value:.3g}%"


def _versions() -> Versions:
    apex = _apex()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": installed("lightning"),
        "pytorch_lightning": installed("pytorch_lightning"),
        "lightning_ddp_amp": installed("lightning_ddp_amp"),
        "apex": None if apex is None else apex["version"],
    }


def _hardware() -> str:
    """What the runs trained on, in a few words: the GPU's name, else the CPU's."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu}"


def _apex() -> Apex | None:
    """The apex the runs import: where, its version (``"unknown"`` for a build without package metadata, as a
    source checkout on the path), and whether it is this repository's CPU test double; None without apex."""
    found = apex_loader.installation()
    if found is None:
        return None
    version = found["version"] or ("test double" if found["test_double"] else "unknown")
    return {"location": found["location"], "version": version, "test_double": found["test_double"]}


def write(report: Report, out: Path) -> int:
    """Write ``compare.json`` and, with matplotlib, ``compare.png``; returns the exit status of ``compare``."""

    (out / JSON_FILE).write_text(json.dumps(_finite(report), indent=2))
    print(f"compare: wrote {out / JSON_FILE}")
    if report["comparable"]:
        if picture.plot(report, out / PNG_FILE) is None:
            print('compare: no picture: matplotlib is not installed (pip install "lightning-ddp-amp[compare]")')
        else:
            print(f"compare: wrote {out / PNG_FILE}")
    statuses = {entry["status"] for entry in report["candidates"]}
    if not report["comparable"] or report["problem"]:
        return 2
    return 1 if statuses & {APART, FAILED} else 0


def _finite(value: Any) -> Any:
    """JSON has no inf or NaN: a value that is not finite is written as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value
