"""The report of ``lightning-ddp-amp compare``: ``compare.json``, built from the runs' folders and written.

Building it reads, in order: each run's entry from its folder (:mod:`~lightning_ddp_amp.commands.compare.candidate`);
whether the runs can be compared at all (:mod:`~lightning_ddp_amp.commands.compare.comparable`); each finished run's
numbers against the baseline's (:mod:`~lightning_ddp_amp.commands.compare.summary`); each candidate's verdict
(:mod:`~lightning_ddp_amp.commands.compare.verdict`). The shape of ``compare.json`` is
:mod:`~lightning_ddp_amp.commands.compare.schema`'s.
"""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_ddp_amp.amp import apex_loader
from lightning_ddp_amp.commands.compare import picture
from lightning_ddp_amp.commands.compare.candidate import Candidate, entry_of
from lightning_ddp_amp.commands.compare.comparable import incomparable, missing_metric
from lightning_ddp_amp.commands.compare.run_folder import FINAL_WEIGHTS, START_WEIGHTS
from lightning_ddp_amp.commands.compare.schema import (
    APART,
    BASELINE,
    FAILED,
    IDENTICAL,
    NOISE_FLOOR,
    SCHEMA,
    Apex,
    CandidateEntry,
    Report,
    Series,
    Status,
    Summary,
    Versions,
)
from lightning_ddp_amp.commands.compare.summary import call, noise_floor, spread, summarize
from lightning_ddp_amp.commands.compare.tolerance import Metric, Tolerance
from lightning_ddp_amp.commands.compare.verdict import explain, first_apart, identical, verdict
from lightning_ddp_amp.versions import gathered

JSON_FILE = "compare.json"
PNG_FILE = "compare.png"


def build(
    candidates: list[Candidate],
    tolerance: Tolerance,
    *,
    steps: int,
    argv: list[str],
    metrics: Sequence[Metric] = (),
) -> Report:
    """The report as ``compare.json`` holds it.

    Args:
        candidates: The runs, the baseline first, each ended.
        tolerance: How close a candidate's final loss and weights must be to the baseline's.
        steps: The optimizer steps each run trained (``--steps``).
        argv: ``compare``'s arguments, as the report names its command.
        metrics: The ``--metric`` s each candidate is also held to.
    """
    entries = [entry_of(candidate) for candidate in candidates]
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
        "baseline": candidates[0].name,
        "comparable": False,
        "problem": None,
        "noise_floor": None,
        "spread": None,
        "candidates": entries,
    }
    refusal = _refusal(candidates, entries)
    if refusal is not None:
        report["problem"], reason = refusal
        for entry in entries:
            if entry["status"] != FAILED:
                entry["reason"] = reason
        return report
    report["comparable"] = True
    compared = [(c, e) for c, e in zip(candidates, entries, strict=True) if e["status"] != FAILED]
    _compare(report, compared, tolerance, metrics)
    return report


def _compare(
    report: Report, compared: list[tuple[Candidate, CandidateEntry]], tolerance: Tolerance, metrics: Sequence[Metric]
) -> None:
    """Each finished run's numbers against the baseline's (the first of ``compared``), the noise floor and the
    spread they are read against, then each run's status and its reason."""
    baseline, base_entry = compared[0]
    start = torch.load(baseline.directory / START_WEIGHTS)
    final = {candidate.name: torch.load(candidate.directory / FINAL_WEIGHTS) for candidate, _ in compared}
    for candidate, entry in compared:
        entry["summary"] = summarize(entry, base_entry, final[candidate.name], final[baseline.name], start)
    noise = next((entry for _, entry in compared if entry["role"] == NOISE_FLOOR), None)
    report["noise_floor"] = None if noise is None else noise_floor(noise)
    report["spread"] = widths = spread(base_entry, noise)
    base_record = baseline.record()
    assert base_record is not None  # a compared run has its record
    report["problem"] = missing_metric(base_entry["evaluations"], metrics, base_record["door"])
    for candidate, entry in compared:
        summary = _summary(entry)
        summary["step_time_call"] = call(summary["step_time_ratio"], widths["step_time"])
        summary["peak_memory_call"] = call(summary["peak_memory_ratio"], widths["peak_memory"])
        if entry is base_entry:
            entry["status"], entry["reason"] = BASELINE, "the baseline"
        elif entry["role"] == NOISE_FLOOR:
            entry["status"] = NOISE_FLOOR
            entry["reason"] = "the baseline run again with every initial weight one ulp up"
        else:
            bit_for_bit = identical(_series(entry), _series(base_entry), final[candidate.name], final[baseline.name])
            entry["status"], entry["reason"] = _judged(entry, base_entry, bit_for_bit, tolerance, metrics)


def _refusal(candidates: list[Candidate], entries: list[CandidateEntry]) -> tuple[str, str] | None:
    """Why no run is compared, as the report's problem and as each run's reason; None when they all can be."""
    baseline = candidates[0]
    if entries[0]["status"] == FAILED:
        return f"the baseline {baseline.name} failed, so there is nothing to compare against", "the baseline failed"
    records = [
        candidate.record() if entry["status"] != FAILED else None
        for candidate, entry in zip(candidates, entries, strict=True)
    ]
    problem = incomparable(candidates, records)
    return None if problem is None else (problem, "the runs did not start alike")


def _judged(
    entry: CandidateEntry,
    base_entry: CandidateEntry,
    bit_for_bit: bool,
    tolerance: Tolerance,
    metrics: Sequence[Metric],
) -> tuple[Status, str]:
    """A candidate's status and the reasons for it, in one sentence: the verdict with the step that explains it and
    the model's advice, or identical; then a warning when the candidate trained as the baseline did.

    Args:
        bit_for_bit: Whether it took the baseline's steps with the baseline's losses and ended in its weights.
    """
    summary = _summary(entry)
    summary["first_step_apart"] = first_apart(_series(entry), tolerance)
    summary["explanation"] = explain(entry, base_entry)
    reasons: list[str | None]
    if bit_for_bit:
        status, reasons = IDENTICAL, ["the baseline's loss at every step and its final weights, bit for bit"]
    else:
        status, reason = verdict(summary, tolerance, metrics)
        trend = summary["scale_trend"]  # its advice only where the loss scale kept falling: a model problem
        reasons = [reason, summary["explanation"], None if trend is None else trend["advice"]]
    reasons.append(_with_itself(entry, base_entry))
    return status, "; ".join(reason for reason in reasons if reason)


def _with_itself(entry: CandidateEntry, base_entry: CandidateEntry) -> str | None:
    """A warning when the candidate ran the baseline's command and trained as it did: the same run twice."""
    if entry["ran_as"] != base_entry["ran_as"] or entry["command"] != base_entry["command"]:
        return None
    said = f"it trained as the baseline did ({entry['ran_as']}), so this compares a run with itself"
    if entry["precision"].startswith("amp-"):
        said += f" (amp-O* runs apex where apex is installed: name native-{entry['precision'][4:]} for torch's AMP)"
    return said


def _summary(entry: CandidateEntry) -> Summary:
    summary = entry["summary"]
    assert summary is not None  # a compared run's
    return summary


def _series(entry: CandidateEntry) -> Series:
    series = entry["series"]
    assert series is not None  # a compared run's
    return series


def _versions() -> Versions:
    """The versions :func:`~lightning_ddp_amp.versions.gathered` reads that ``compare.json`` names, and apex's."""
    found, apex = gathered(), _apex()
    return {
        "python": found["python"],
        "torch": found["torch"],
        "lightning": found["lightning"],
        "pytorch_lightning": found["pytorch_lightning"],
        "lightning_ddp_amp": found["lightning_ddp_amp"],
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
