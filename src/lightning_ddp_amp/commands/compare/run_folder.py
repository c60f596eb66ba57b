"""A compared run's folder: what ``compare`` writes there for the run, what the run writes back, and their names.

One folder per run, under ``--out``:

* ``plan.json``: the run's :class:`Plan`, written by ``compare`` and named in :data:`PLAN_VARIABLE`; the run's
  Trainer is changed by it (:mod:`~lightning_ddp_amp.commands.compare.patching`);
* ``stdout.log``, ``stderr.log``: what the run printed; ``errors/``: each process's uncaught exception, written by
  ``commands/compare/_site/sitecustomize.py``;
* ``record.json``: the recording of the run's first ``fit`` (:mod:`~lightning_ddp_amp.commands.compare.recording`), written
  by rank 0 when it ends, and again for each evaluation after it; a Fabric run's ranks each write their own
  (:func:`rank_file`, :mod:`~lightning_ddp_amp.commands.compare.fabric_recording`), merged into it by ``compare``;
  a run that raised leaves one partial record per rank instead (:func:`partial_file`);
* the weights, in fp32: the final ones; the baseline's also before its first step and at each snapshot
  (:func:`snapshot_file`), where every other run measures its distance to them.

The report reads the records and weights back (:mod:`~lightning_ddp_amp.commands.compare.report`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

#: The environment variable naming a run's plan file (``commands/compare/_site/sitecustomize.py`` reads it too).
PLAN_VARIABLE = "LIGHTNING_DDP_AMP_COMPARE"
PLAN_FILE = "plan.json"
#: Each run's own output, kept in its folder (and shown as it comes): its standard output and error.
OUTPUT_FILES = ("stdout.log", "stderr.log")
#: The folder of uncaught exceptions, one file per process (``commands/compare/_site/sitecustomize.py`` names it too).
ERRORS = "errors"
RECORD_FILE = "record.json"
FINAL_WEIGHTS = "weights-final.pt"
START_WEIGHTS = "weights-start.pt"
#: ``--grad-norm-every``: the gradient norm at one step in 20 (10 points along compare's default 200 steps). At every step
#: it is one more read of every gradient: on the bench MLP on 2 CPU cores about 250 µs, 8% of the step
#: (benchmarks/compare_overhead.py); at one step in 20, 0.4%.
DEFAULT_GRAD_NORM_EVERY = 20


def snapshot_file(step: int) -> str:
    """The baseline's weights after ``step`` steps."""
    return f"weights-step{step}.pt"


def rank_file(rank: int) -> str:
    """One rank's record of a Fabric run (no ``fit`` gathers the ranks): merged into ``record.json`` after the run
    (:func:`merge_rank_records`)."""
    return f"record-rank{rank}.json"


def partial_file(rank: int | str) -> str:
    """What a rank of a crashed run wrote: its steps, up to the crash (``"*"``: every rank's, as a glob)."""
    return f"record-rank{rank}.partial.json"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one candidate run changes, written by ``compare`` as ``plan.json`` in the candidate's folder.

    Args:
        candidate: The candidate's name in messages and the report.
        precision: The ``Trainer(precision=...)`` value to train with.
        steps: The most optimizer steps to take.
        directory: The candidate's folder, for checkpoints, logs and the record.
        ckpt: The checkpoint ``fit`` starts from when the script passes none.
        save_start: Also save the weights as they are before the first step (the baseline does, for distances).
        first_step: The global step ``ckpt`` was saved at: the run takes ``steps`` more.
        snapshots: The global steps after which the weights are compared with the baseline's as training goes: the
            baseline saves its weights there, every other run measures its distance to them.
        baseline_directory: The baseline's folder, where those weights are.
        perturb: Move every initial weight one ulp up after the starting weights are hashed: the noise-floor run.
        grad_norm_every: The gradient norm is measured at the global steps it divides (1: every step).
    """

    candidate: str
    precision: str
    steps: int
    directory: str
    ckpt: str | None = None
    save_start: bool = False
    first_step: int = 0
    snapshots: tuple[int, ...] = ()
    baseline_directory: str | None = None
    perturb: bool = False
    grad_norm_every: int = DEFAULT_GRAD_NORM_EVERY

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def read(cls, path: str | Path) -> Plan:
        fields = json.loads(Path(path).read_text())
        return cls(**{**fields, "snapshots": tuple(fields.get("snapshots", ()))})


def write_record(folder: Path, document: dict[str, Any]) -> None:
    """Replace ``record.json`` whole, so that the report never reads half of one."""
    temporary = folder / f"{RECORD_FILE}.tmp"
    temporary.write_text(json.dumps(document))
    temporary.replace(folder / RECORD_FILE)


def read_record(folder: Path) -> dict[str, Any] | None:
    """The run's ``record.json``; None when it wrote none."""
    path = folder / RECORD_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def merge_rank_records(folder: Path) -> bool:
    """Write ``record.json`` from the ranks' own records (:func:`rank_file`) where the run wrote none: rank 0's header,
    every rank's record in rank order. Only when every rank of the header's ``world_size`` wrote one; returns whether
    it wrote."""
    if (folder / RECORD_FILE).is_file():
        return False
    paths = [path for path in folder.glob("record-rank*.json") if re.fullmatch(r"record-rank\d+\.json", path.name)]
    documents = sorted((json.loads(path.read_text()) for path in paths), key=lambda d: d["ranks"][0]["rank"])
    if not documents or len(documents) != documents[0]["world_size"]:
        return False
    write_record(folder, {**documents[0], "ranks": [document["ranks"][0] for document in documents]})
    return True


def read_partial(folder: Path) -> list[dict[str, Any]]:
    """What the ranks of a crashed run wrote of their steps (each rank's own record), rank by rank."""
    ranks = []
    for path in sorted(folder.glob(partial_file("*"))):
        ranks += json.loads(path.read_text())["ranks"]
    return sorted(ranks, key=lambda rank: rank["rank"])
