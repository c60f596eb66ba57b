"""Inside each run of ``lightning-ddp-amp compare``: the Fabric a kept loop builds, changed by the run's plan.

The Fabric door's side of :mod:`~lightning_ddp_amp.commands.compare.patching`, which calls :func:`patch_fabric` with
the Fabric of the namespace the script imported (``lightning.fabric``, or the standalone ``lightning_fabric`` that
``pytorch_lightning`` imports). From then on every ``Fabric(...)`` of the script is built with these changes:

* ``precision`` becomes the candidate's and any precision plugin in ``plugins`` is removed, as on the Trainer
  (:func:`~lightning_ddp_amp.commands.compare.run_precision.replace_precision`): one of ours becomes Fabric's
  AmpPrecision, carrying the settings of the script's own AmpPrecision;
* ``LT_PRECISION``, which ``fabric run`` sets and Fabric takes over its ``precision`` argument, is removed from the
  environment;
* CSV and TensorBoard loggers in ``loggers`` write into the run's folder, and any other logger is turned off; every
  Fabric's ``save``, ``load`` and ``load_raw`` use the run's copies of their paths
  (:mod:`~lightning_ddp_amp.commands.compare.run_files`).

The changes are kept for the run's record (:func:`changes_of`). The process's first Fabric is then recorded: its
setup, backward, optimizers' steps and ``fabric.log`` (:mod:`~lightning_ddp_amp.commands.compare.fabric_recording`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import weakref
from typing import Any

from lightning_ddp_amp.commands.compare import doors, fabric_recording, run_files
from lightning_ddp_amp.commands.compare.recorder import Changes
from lightning_ddp_amp.commands.compare.run_folder import Plan
from lightning_ddp_amp.commands.compare.run_precision import Door, replace_precision
from lightning_ddp_amp.errors import CompareScriptError

_MARK = "__lightning_ddp_amp_compare__"
#: What each Fabric built in this process had changed, for its recording.
_CHANGES: weakref.WeakKeyDictionary[Any, Changes] = weakref.WeakKeyDictionary()
#: What ``fabric run`` passes its ``--precision`` in; Fabric's connector prefers it to ``Fabric(precision=...)``.
PRECISION_VARIABLE = "LT_PRECISION"


def fabric_door(fabric_namespace: Any) -> Door:
    """Fabric of ``fabric_namespace`` (``lightning.fabric`` or ``lightning_fabric``)."""
    standalone = fabric_namespace.__name__ == "lightning_fabric"
    flavour = "lightning_ddp_amp.pytorch_lightning" if standalone else "lightning_ddp_amp"
    return Door(
        "Fabric",
        fabric_namespace.plugins.Precision,
        lambda: importlib.import_module(f"{flavour}.fabric").AmpPrecision,
        lambda plugin: {},
    )


def patch_fabric(fabric_namespace: Any, plan: Plan) -> None:
    """Patch ``Fabric.__init__`` of ``fabric_namespace`` as the module docstring lists. Idempotent."""
    fabric_class = fabric_namespace.Fabric
    if getattr(vars(fabric_class).get("__init__"), _MARK, False):  # its own: a subclass of a patched Fabric too
        return
    door = fabric_door(fabric_namespace)
    init = fabric_class.__init__
    signature = inspect.signature(init)
    recordings: list[fabric_recording.FabricRecording] = []  # the first Fabric of the process records

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        doors.built(plan.directory, doors.FABRIC)
        if plan.ckpt is not None:
            raise CompareScriptError(
                "--ckpt",
                plan.ckpt,
                "a Fabric script loads its own checkpoints with fabric.load, so compare cannot start it from one",
                "pass the checkpoint to the script's own option in the command (e.g. -- python train.py --resume PATH)",
            )
        given = signature.bind(self, *args, **kwargs).arguments
        changes = Changes(door=door.name)
        replace_fabric_precision(given, plan, changes, door)
        run_files.redirect_fabric_loggers(given, fabric_namespace.loggers, plan.directory, changes)
        init(given.pop("self"), **given)
        run_files.redirect_saves(self, plan.directory, changes)
        _CHANGES[self] = changes
        fabric_recording.attach(self, plan, changes, recordings)

    setattr(__init__, _MARK, True)
    fabric_class.__init__ = __init__


def changes_of(fabric: Any) -> Changes:
    """What the patch changed of ``fabric``'s arguments."""
    return _CHANGES[fabric]


def replace_fabric_precision(given: dict[str, Any], plan: Plan, changes: Changes, door: Door) -> None:
    """Give Fabric the plan's precision in place of the script's, which ``LT_PRECISION`` overrides as Fabric reads it.

    Args:
        given: The arguments the script passed to ``Fabric(...)``, by name; changed in place.
        plan: This run's plan.
        changes: Where the changes are listed.
        door: Fabric's classes (:func:`fabric_door`).
    """
    precision = given.get("precision")
    from_environment = os.environ.pop(PRECISION_VARIABLE, None)
    if from_environment is not None:
        changes.replaced.append(f"removed {PRECISION_VARIABLE}={from_environment!r}, which Fabric takes over precision")
        precision = from_environment
    plugins = given.get("plugins")
    listed = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    replace_precision(given, precision, listed, plan.precision, changes, door)
