"""Whether the runs of ``lightning-ddp-amp compare`` can be compared at all: the same number of ranks, the same
initial weights and the same first batch as the baseline, and every ``--metric`` logged by it; each refusal with its
fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_ddp_amp.commands.compare.candidate import Candidate
from lightning_ddp_amp.commands.compare.schema import Evaluation
from lightning_ddp_amp.commands.compare.summary import last_values
from lightning_ddp_amp.commands.compare.tolerance import Metric


def incomparable(candidates: list[Candidate], records: Sequence[dict[str, Any] | None]) -> str | None:
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
    if missing_metric(record.get("evaluations", []), metrics, record["door"]) is not None:
        return "the baseline never logged a --metric"
    return None


def missing_metric(evaluations: list[Evaluation], metrics: Sequence[Metric], door: str) -> str | None:
    """A ``--metric`` the baseline never logged: the verdict cannot use it. ``door``: the baseline's record's
    (``"Trainer"`` or ``"Fabric"``), which says where the metric is logged."""
    logged = sorted(last_values(evaluations))
    for metric in metrics:
        if metric.name not in logged:
            if door == "Fabric":
                return (
                    f"--metric={metric.name!r}: the baseline logged no such metric with fabric.log (it logged:"
                    f" {', '.join(logged) or 'none'}). Fix: name one of those, or log it with"
                    f" fabric.log({metric.name!r}, value) in the loop, within the steps compare runs (--steps)"
                )
            return (
                f"--metric={metric.name!r}: the baseline logged no such metric in validation or test (it logged:"
                f" {', '.join(logged) or 'none'}). Fix: name one of those, or log it with self.log({metric.name!r}, ...)"
                " in validation_step or test_step, and give the run a validation or test loader"
            )
    return None
