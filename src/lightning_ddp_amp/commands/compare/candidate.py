"""A run of ``lightning-ddp-amp compare`` as its folder tells it: what ran, how it ended, and its entry in
``compare.json`` before any comparison (``failed``, or ``not compared`` yet), its series read from its ranks' records.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path
from typing import Any, cast

from lightning_ddp_amp.commands.compare import doors, run_folder
from lightning_ddp_amp.commands.compare.run_folder import ERRORS
from lightning_ddp_amp.commands.compare.schema import (
    CANDIDATE,
    FAILED,
    NOT_COMPARED,
    CandidateEntry,
    Overflow,
    Role,
    Series,
)


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
        return self._why_no_record()

    def _why_no_record(self) -> str:
        """A run that exited 0 without a record: how far its script got, from the markers it left (:mod:`~lightning_ddp_amp.commands.compare.doors`)."""
        command, reached = f"command={shlex.join(self.command)!r}", doors.reached(self.directory)
        if reached.trainer:
            return (
                f"{command}: the script built a Trainer but never completed a Trainer.fit, so compare recorded no"
                " step. Fix: call trainer.fit(...) in the script; compare records the steps of its first fit"
            )
        if reached.fabric:
            return (
                f"{command}: the script built a Fabric but no optimizer set up with fabric.setup /"
                " fabric.setup_optimizers stepped. Fix: set the optimizer up with Fabric and step it in the loop"
            )
        if reached.imported:
            return (
                f"{command}: the script imported {reached.imported[0]} but built neither a Trainer nor a Fabric, so"
                " compare had no precision to change. Fix: run the script that builds Trainer(...) or Fabric(...)"
            )
        return (
            f"{command}: the script never imported lightning, pytorch_lightning or lightning_fabric, so it built"
            " neither a Trainer nor a Fabric to compare. Fix: run the script that builds the Trainer or the Fabric"
            " (or its Python ignored PYTHONPATH: drop python -E / -I)"
        )


def entry_of(candidate: Candidate) -> CandidateEntry:
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
    """The run's series from its ranks' records: the loss (and each ``loss_id``'s) averaged over ranks, the step time
    the slowest rank's, the rest rank 0's; as long as the shortest rank's (a crash may stop ranks a step apart)."""
    first = ranks[0]
    count = min(len(rank["step"]) for rank in ranks)
    return {
        "step": first["step"][:count],
        "loss": [math.fsum(rank["loss"][i] for rank in ranks) / len(ranks) for i in range(count)],
        "loss_by_rank": [rank["loss"][:count] for rank in ranks],
        "loss_by_id": _loss_by_id(ranks, count),
        "skipped": first["skipped"][:count],
        "loss_scale": first["loss_scale"][:count],
        "grad_norm": first["grad_norm"][:count],
        "lr": first["lr"][:count],
        "step_time_s": [max(rank["step_time_s"][i] for rank in ranks) for i in range(count)],
        "slowed_steps": first.get("slowed_steps", []),
        "relative_loss_difference": [],
        "weight_distance": [],
    }


def _loss_by_id(ranks: list[dict[str, Any]], count: int) -> dict[str, list[float | None]]:
    """Each ``loss_id``'s loss per step, where the ranks' records keep several: the mean over the ranks that gave it
    at that step, None where none did (the record's None; its NaN is an overflowed loss, and stays NaN)."""
    kept = [rank["loss_by_id"] for rank in ranks if rank.get("loss_by_id")]
    by_id: dict[str, list[float | None]] = {}
    for loss_id in sorted({loss_id for each in kept for loss_id in each}, key=int):
        columns = [each[loss_id] for each in kept if loss_id in each]
        given = [[column[i] for column in columns if column[i] is not None] for i in range(count)]
        by_id[loss_id] = [math.fsum(values) / len(values) if values else None for values in given]
    return by_id


def _overflows(ranks: list[dict[str, Any]]) -> list[Overflow]:
    """Each located overflow once, per step the rank that found the most (a place before "not reproduced")."""
    found: dict[int, Overflow] = {}
    for rank in ranks:
        for overflow in rank.get("overflows", []):
            step, known = overflow["step"], overflow["module"] is not None
            if step not in found or (known and found[step]["module"] is None):
                found[step] = cast(Overflow, {**overflow, "rank": rank["rank"]})  # record.json's, and its rank
    return [found[step] for step in sorted(found)]
