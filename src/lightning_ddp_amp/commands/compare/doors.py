"""How far a compared run's script got towards a door: the markers it leaves in the run's folder, read back when the
run ends without a record, so that :meth:`~lightning_ddp_amp.commands.compare.candidate.Candidate.failure` can say
which step the script missed.

``doors/`` in the run's folder holds an empty file per event, by any process of the run:

* ``imported-{namespace}``: compare's ``sitecustomize`` saw the script import ``lightning``, ``pytorch_lightning`` or
  ``lightning_fabric`` (:data:`NAMESPACES`), and patched it;
* ``trainer-{pid}``, ``fabric-{pid}``: a patched ``Trainer(...)`` or ``Fabric(...)`` was built
  (:mod:`~lightning_ddp_amp.commands.compare.patching`, :mod:`~lightning_ddp_amp.commands.compare.fabric_patching`).

A marker is a file, not a message: a run may end anywhere (``--steps``, a crash, ``os._exit``), and whatever it wrote
before stays.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

FOLDER = "doors"
#: The Lightning namespaces compare patches, in the order a message names them when a script imported several
#: (``pytorch_lightning`` imports ``lightning_fabric`` first).
NAMESPACES = ("lightning", "pytorch_lightning", "lightning_fabric")
TRAINER = "trainer"
FABRIC = "fabric"


def imported(directory: str | Path, namespace: str) -> None:
    """Mark that the script imported ``namespace``, one of :data:`NAMESPACES`."""
    _mark(directory, f"imported-{namespace}")


def built(directory: str | Path, door: str) -> None:
    """Mark that this process built a ``door``: :data:`TRAINER` or :data:`FABRIC`."""
    _mark(directory, f"{door}-{os.getpid()}")


@dataclasses.dataclass(frozen=True)
class Reached:
    """What a run's script got to: the namespaces it imported (in :data:`NAMESPACES`' order) and the doors it built."""

    imported: tuple[str, ...]
    trainer: bool
    fabric: bool


def reached(directory: Path) -> Reached:
    """The markers the run left in ``directory``."""
    folder = directory / FOLDER
    names = {path.name for path in folder.iterdir()} if folder.is_dir() else set()
    return Reached(
        imported=tuple(namespace for namespace in NAMESPACES if f"imported-{namespace}" in names),
        trainer=any(name.startswith(f"{TRAINER}-") for name in names),
        fabric=any(name.startswith(f"{FABRIC}-") for name in names),
    )


def _mark(directory: str | Path, name: str) -> None:
    folder = Path(directory) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).touch()
