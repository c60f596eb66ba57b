"""Inside each run of ``lightning-ddp-amp compare``: the Trainer the script builds, changed by the run's plan.

:mod:`lightning_ddp_amp.commands.compare` starts the user's command with ``commands/compare/_site/`` first on ``PYTHONPATH`` and a
plan file named in ``LIGHTNING_DDP_AMP_COMPARE`` (:mod:`~lightning_ddp_amp.commands.compare.run_folder`); that folder's
``sitecustomize`` calls :func:`patch` as soon as the script imports ``lightning``, ``pytorch_lightning`` or
``lightning_fabric`` (a kept loop: only its Fabric is patched). From then
on every ``Trainer(...)`` of the script is built with these changes, which rank 0 lists once when ``fit`` starts:

* ``precision`` becomes the candidate's, and any precision plugin in ``plugins`` is removed (Lightning refuses
  both at once);
* ``max_steps`` becomes the plan's number of steps (after the plan's checkpoint's own), unless the script asks for
  fewer;
* ``default_root_dir``, every ``ModelCheckpoint`` with a ``dirpath``, and CSV and TensorBoard loggers point into the
  candidate's folder; any other logger is turned off, since it cannot be pointed elsewhere
  (:mod:`~lightning_ddp_amp.commands.compare.run_files`, which Fabric's loggers share). LightningCLI saves its config
  in the log directory, so it lands there too;
* ``fit`` starts from the plan's checkpoint when the script passes no ``ckpt_path``;
* a :class:`~lightning_ddp_amp.commands.compare.recording.Recording` callback is added: what each step did;
* a ``doors/trainer-{pid}`` marker says that a Trainer was built (:mod:`~lightning_ddp_amp.commands.compare.doors`).

A strategy that restores a checkpoint only after its ``setup`` (``restore_checkpoint_after_setup``: FSDP, DeepSpeed)
is refused when the Trainer is built: the starting weights are compared where ``setup`` begins.

The module imports no Lightning namespace itself: :func:`patch` is given one, and what it needs of Lightning's
private API comes from that namespace's flavour of :mod:`lightning_ddp_amp._lightning`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any

from lightning_ddp_amp._standalone import FLAVOUR
from lightning_ddp_amp.commands.compare import doors, fabric_patching, run_files
from lightning_ddp_amp.commands.compare.recording import Changes, Recording
from lightning_ddp_amp.commands.compare.run_folder import Plan
from lightning_ddp_amp.commands.compare.run_precision import Door, replace_precision
from lightning_ddp_amp.errors import StrategyConfigurationError

_MARK = "__lightning_ddp_amp_compare__"


def trainer_door(pl: Any) -> Door:
    """The Trainer of ``pl`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    return Door(
        "Trainer", pl.plugins.precision.Precision, lambda: _amp_precision(pl), lambda plugin: {"models": plugin.models}
    )


def patch(namespace: str, plan_file: str) -> None:
    """Patch ``Trainer.__init__`` and ``Trainer.fit`` of ``namespace`` (``"lightning"`` or ``"pytorch_lightning"``),
    and the Fabric that comes with it (:mod:`~lightning_ddp_amp.commands.compare.fabric_patching`); of
    ``"lightning_fabric"``, its Fabric only.

    Importing :mod:`lightning_ddp_amp` first registers ``"envddp"`` and the ``"apex-O*"`` / ``"amp-O*"`` values, so
    a script that never imports the package can be compared under them. Idempotent.
    """
    import lightning_ddp_amp  # noqa: F401  (registers the strategy and the precision values)

    module = sys.modules[namespace]
    plan = Plan.read(plan_file)
    if namespace == "lightning_fabric":  # a kept loop on the standalone Fabric: no Trainer of its own
        importlib.import_module(FLAVOUR)  # registers "envddp" and the precision values with the standalone Fabric
        fabric_patching.patch_fabric(module, plan)
        return
    pl: Any = module.pytorch if namespace == "lightning" else module  # lightning.pytorch, or pytorch_lightning
    # lightning.fabric, or the standalone lightning_fabric that pytorch_lightning imports first.
    fabric_patching.patch_fabric(module.fabric if namespace == "lightning" else sys.modules["lightning_fabric"], plan)
    trainer_class = pl.Trainer
    if getattr(trainer_class.__init__, _MARK, False):
        return
    # The per-batch hooks the recording does not use are not called at all: each would cost a call at every step.
    unused = _fence(pl).silenced_callback_hooks(*Recording.UNUSED_HOOKS)
    recording_class = type("CompareRecording", (Recording, pl.Callback), unused)
    init, fit = trainer_class.__init__, trainer_class.fit
    init_signature, fit_signature = inspect.signature(init), inspect.signature(fit)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        doors.built(plan.directory, doors.TRAINER)
        given = init_signature.bind(self, *args, **kwargs).arguments
        changes = Changes()
        _replace_arguments(given, _trainer_defaults(type(self), init_signature, pl), plan, changes, pl)
        redirect = functools.partial(_redirect_checkpoints, plan=plan, changes=changes, pl=pl)
        recording = recording_class(plan, changes, redirect, _fence(pl).evaluation_metrics)
        given["callbacks"] = [*_as_list(given.get("callbacks")), recording]
        init(given.pop("self"), **given)
        check_restores_before_setup(self.strategy)
        redirect(self)

    @functools.wraps(fit)
    def fit_from_plan(self: Any, *args: Any, **kwargs: Any) -> Any:
        given = fit_signature.bind(self, *args, **kwargs).arguments
        if plan.ckpt is not None and given.get("ckpt_path") is None:
            given["ckpt_path"] = plan.ckpt
        return fit(given.pop("self"), **given)

    setattr(__init__, _MARK, True)
    trainer_class.__init__ = __init__
    trainer_class.fit = fit_from_plan


def check_restores_before_setup(strategy: Any) -> None:
    """Refuse a strategy that restores a checkpoint after its ``setup``, where compare hashes the starting weights.

    Raises:
        StrategyConfigurationError: ``strategy.restore_checkpoint_after_setup`` is True (FSDP, DeepSpeed).
    """
    if strategy.restore_checkpoint_after_setup:
        raise StrategyConfigurationError(
            "strategy",
            type(strategy).__name__,
            "it restores a checkpoint only after strategy.setup (restore_checkpoint_after_setup=True), but compare"
            " checks that every run starts from the same weights when strategy.setup begins",
            "compare under a strategy that restores checkpoints before its setup, e.g. strategy='envddp' or 'ddp'",
        )


def _trainer_defaults(trainer_class: type[Any], signature: inspect.Signature, pl: Any) -> dict[str, Any]:
    """The value each argument left out of ``Trainer(...)`` takes: ``PL_TRAINER_*`` environment variables as Lightning
    reads them, else the signature's default."""
    defaults = {
        name: parameter.default
        for name, parameter in signature.parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    return {**defaults, **_fence(pl).trainer_env_defaults(trainer_class)}


def _replace_arguments(
    given: dict[str, Any], defaults: Mapping[str, Any], plan: Plan, changes: Changes, pl: Any
) -> None:
    """Change the Trainer's arguments as the module docstring lists; only given names are passed on, so Lightning's
    ``PL_TRAINER_*`` environment defaults still apply to the rest.

    Args:
        given: The arguments the script passed, by name; changed in place.
        defaults: The value of each argument left out (:func:`_trainer_defaults`).
        plan: This run's plan.
        changes: Where the changes are listed.
        pl: The Lightning namespace of the Trainer.
    """

    def value(name: str) -> Any:
        return given[name] if name in given else defaults[name]

    replace_precision(given, value("precision"), _as_list(value("plugins")), plan.precision, changes, trainer_door(pl))
    max_steps, last = value("max_steps"), plan.first_step + plan.steps
    if max_steps is None or max_steps < 0 or max_steps > last:
        changes.replaced.append(f"max_steps={max_steps!r} -> {last}")
        given["max_steps"] = last
    changes.replaced.append(f"default_root_dir={value('default_root_dir')!r} -> {plan.directory!r}")
    given["default_root_dir"] = plan.directory
    logger = value("logger")
    if logger not in (None, True, False):
        logs = run_files.logs_folder(plan.directory)
        given["logger"] = [_redirected(each, logs, changes, pl) for each in _as_list(logger)]


def _redirected(logger: Any, logs: str, changes: Changes, pl: Any) -> Any:
    """``logger`` writing into ``logs``: a CSV or TensorBoard logger built again there, any other turned off."""

    def turned_off() -> Any:
        # A logger of its own kind cannot be pointed elsewhere. Lightning's dummy swallows what the script logs through
        # it (`self.logger.experiment.log(...)`); its folder is the candidate's, where LightningCLI saves its config.
        return type("TurnedOffLogger", (_fence(pl).DummyLogger,), {"save_dir": property(lambda _: logs)})()

    kinds = (pl.loggers.CSVLogger, pl.loggers.TensorBoardLogger)
    return run_files.redirected_logger(logger, logs, changes, kinds, turned_off)


def _amp_precision(pl: Any) -> Any:
    """AmpPrecision of the namespace the Trainer belongs to."""
    return importlib.import_module(_flavour(pl)).AmpPrecision


def _fence(pl: Any) -> Any:
    """:mod:`lightning_ddp_amp._lightning` of the namespace the Trainer belongs to."""
    return importlib.import_module(f"{_flavour(pl)}._lightning")


def _flavour(pl: Any) -> str:
    """This package, or its ``pytorch_lightning`` flavour, for the Lightning namespace ``pl``."""
    return FLAVOUR if pl.__name__ == "pytorch_lightning" else "lightning_ddp_amp"


def _redirect_checkpoints(trainer: Any, plan: Plan, changes: Changes, pl: Any) -> None:
    """Every ModelCheckpoint with its own ``dirpath`` saves into the candidate's folder instead (so ``auto_resume``,
    which reads those directories, only ever finds this candidate's checkpoints)."""
    inside = os.path.realpath(plan.directory) + os.sep
    callbacks = [
        cb
        for cb in trainer.callbacks
        if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.dirpath and not (cb.dirpath + os.sep).startswith(inside)
    ]
    for index, callback in enumerate(callbacks):
        folder = os.path.join(plan.directory, "checkpoints" if len(callbacks) == 1 else f"checkpoints-{index}")
        changes.replaced.append(f"ModelCheckpoint(dirpath={callback.dirpath!r}) -> {folder!r}")
        callback.dirpath = folder


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
