"""The one place where lightning_ddp_amp touches Lightning's private API.

Each function and name here says why it is needed. The package's subclasses of Lightning's classes also use
the protected members they inherit, as any subclass does (``EnvDDPStrategy`` overrides ``_configure_launcher``,
``_setup_model`` and ``_register_ddp_hooks``, and reads ``_ddp_kwargs``, ``_launcher``, ...); :data:`INHERITED`
lists every one. ``tests/test_lightning_internals.py`` exercises each function here, checks that each inherited
member still exists and that each override keeps Lightning's parameters, and CI runs it against the lowest and
the highest Lightning release declared in ``pyproject.toml``. ``tests/test_imports.py`` checks that no other
module imports a private Lightning name.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import lightning
import torch
from lightning.fabric.connector import _Connector
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy  # type: ignore[attr-defined]
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.wrappers import _FabricOptimizer

# Lightning's logger that swallows whatever is logged through it, from a module outside ``loggers.__all__``;
# re-exported for commands/compare/patching.py, which turns off the loggers it cannot point into a run's folder.
from lightning.pytorch.loggers.logger import DummyLogger as DummyLogger

# Lightning's samplers that shard an evaluation set without padding (it uses them for prediction), from a module
# outside its documented API; re-exported for trainer/sharding.py.
from lightning.pytorch.overrides.distributed import (
    UnrepeatedDistributedSampler as UnrepeatedDistributedSampler,
)
from lightning.pytorch.overrides.distributed import (
    UnrepeatedDistributedSamplerWrapper as UnrepeatedDistributedSamplerWrapper,
)
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from lightning.pytorch.utilities.argparse import _parse_env_variables
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
from packaging.version import Version
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Sampler

from lightning_ddp_amp.errors import StrategyConfigurationError, nearest

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: Lightning releases CI tests against: lowest included, highest excluded.
TESTED_LIGHTNING = (Version("2.5.0"), Version("2.7.0"))

#: Protected members of Lightning's classes that the package's subclasses override, call or read as subclasses.
INHERITED: dict[type[Any], tuple[str, ...]] = {
    DDPStrategy: (
        "_checkpoint_io",
        "_configure_launcher",
        "_ddp_comm_hook",
        "_ddp_comm_state",
        "_ddp_comm_wrapper",
        "_ddp_kwargs",
        "_get_process_group_backend",
        "_launcher",
        "_layer_sync",
        "_process_group_backend",
        "_register_ddp_hooks",
        "_setup_model",
    ),
    FabricDDPStrategy: (
        "_backward_sync_control",
        "_configure_launcher",
        "_ddp_kwargs",
        "_get_process_group_backend",
        "_launcher",
        "_process_group_backend",
        "_set_world_ranks",
        "_setup_distributed",
    ),
}

#: The type of Lightning's ``StrategyRegistry`` (Lightning exports only the instance), for annotations.
StrategyRegistryType = _StrategyRegistry

_MARK = "__lightning_ddp_amp_hook__"

#: ``(precision, plugins)`` as given to the Trainer -> ``(precision, plugins)`` as Lightning should see them.
PrecisionResolver = Callable[[object, Any], tuple[object, Any]]


def install_trainer_hook(
    resolve_precision: PrecisionResolver,
    strategy_class: type[Any],
    precision_class: type[Any],
    fabric_strategy_class: type[Any],
) -> None:
    """Hook this package into ``Trainer.__init__``, which builds an ``_AcceleratorConnector`` from its arguments.

    Why: Lightning has no public extension point for either of these.

    * ``Trainer(precision="apex-O1")`` / ``"amp-O1"``: Lightning validates precision strings against a fixed list,
      so the wrapper turns ours into an :class:`~lightning_ddp_amp.AmpPrecision` plugin before Lightning sees them,
      and refuses a string that is neither ours nor Lightning's with the nearest named (``resolve_precision``).
      Any other value reaches Lightning unchanged, and the connector is then called with exactly the Trainer's
      arguments.
    * A strategy name that nothing is registered under and that is nearer envddp's names than any other (``"env_ddp"``)
      is refused with envddp named (:func:`_refuse_mistyped_strategy`); any other name is Lightning's to judge.
    * By the time a strategy is built, ``devices="auto"`` has become a device count, so "left at auto" and
      "explicitly 1" look the same; when the strategy is ``strategy_class`` the wrapper hands it the raw ``devices``
      and ``num_nodes`` (``check_trainer_flags``), then calls its ``start_missing_ranks`` (envddp without a launcher
      starts its ranks there). When the precision plugin is ``precision_class``, it is handed the finished strategy
      and accelerator (``check_trainer_setup``).
    * ``strategy_class(accelerator=...)``: its accelerator is handed to the connector as ``Trainer(accelerator=...)``
      (:func:`_hand_over_accelerator` says why).
    * ``fabric_strategy_class`` (Fabric's envddp) is refused with the import of the Trainer's; Lightning's own refusal
      does not say which class to use.

    Any other Trainer is built by Lightning alone: its strategy, precision plugin and environment are Lightning's.
    Idempotent. The package hands over its resolver and classes, so that this module imports none of its own but
    :mod:`lightning_ddp_amp.errors`.

    Args:
        resolve_precision: Turns the Trainer's ``precision`` and ``plugins`` into what Lightning accepts
            (:func:`lightning_ddp_amp.trainer.precision.resolve_precision_flag`).
        strategy_class: The strategy that checks the Trainer's flags (:class:`~lightning_ddp_amp.EnvDDPStrategy`).
        precision_class: The precision plugin that checks the finished Trainer
            (:class:`~lightning_ddp_amp.AmpPrecision`).
        fabric_strategy_class: Fabric's envddp (:class:`lightning_ddp_amp.fabric.EnvDDPStrategy`), refused.

    Raises:
        StrategyConfigurationError: ``Trainer(strategy=fabric_strategy_class(...))``, or a mistyped envddp.
        PrecisionConfigurationError: a precision string neither Lightning nor this package knows.
    """
    if getattr(_AcceleratorConnector.__init__, _MARK, False):
        return
    version = Version(lightning.__version__)
    if not TESTED_LIGHTNING[0] <= version < TESTED_LIGHTNING[1]:
        warnings.warn(
            f"lightning_ddp_amp is tested with Lightning >={TESTED_LIGHTNING[0]},<{TESTED_LIGHTNING[1]}; found"
            f" {version}. Install a tested release if Trainer construction fails.",
            stacklevel=2,
        )
    original = _AcceleratorConnector.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: _AcceleratorConnector, *args: Any, **kwargs: Any) -> None:
        arguments = signature.bind(self, *args, **kwargs)
        arguments.apply_defaults()
        given = arguments.arguments
        _refuse_other_front(given["strategy"], fabric_strategy_class, strategy_class, "Trainer")
        _refuse_mistyped_strategy(given["strategy"], StrategyRegistry, strategy_class)
        precision, plugins = resolve_precision(given["precision"], given["plugins"])
        unchanged = precision is given["precision"] and plugins is given["plugins"]
        given["precision"], given["plugins"] = precision, plugins
        with _hand_over_accelerator(given, strategy_class) as handed_over:
            if unchanged and not handed_over:
                original(self, *args, **kwargs)
            else:
                original(*arguments.args, **arguments.kwargs)
        strategy: Any = self.strategy
        if isinstance(strategy, strategy_class):
            strategy.check_trainer_flags(
                devices=given["devices"],
                num_nodes=given["num_nodes"],
                use_distributed_sampler=given["use_distributed_sampler"],
            )
            # envddp without a launcher starts its ranks here, before the script goes on (EnvDDPStrategy says why).
            strategy.start_missing_ranks()
        plugin: Any = self.precision_plugin
        if isinstance(plugin, precision_class):
            plugin.check_trainer_setup(strategy, self.accelerator)

    setattr(__init__, _MARK, True)
    _AcceleratorConnector.__init__ = __init__  # type: ignore[method-assign]


def install_fabric_hook(
    resolve_precision: PrecisionResolver,
    strategy_class: type[Any],
    precision_class: type[Any],
    trainer_strategy_class: type[Any],
) -> None:
    """Hook this package into ``Fabric.__init__``, which builds a ``_Connector`` from its arguments.

    Why: Fabric has no precision registry and validates precision strings against a fixed list, refusing a plugin
    instance as ``precision=`` too. ``Fabric(precision="apex-O1")`` is turned into an AmpPrecision in ``plugins``
    before Fabric sees it, and a string that is neither ours nor Lightning's is refused with the nearest named, as is
    a mistyped envddp (:func:`_refuse_mistyped_strategy`); any other value reaches Fabric unchanged. When the
    strategy is ``strategy_class`` it gets Fabric's raw ``devices`` and ``num_nodes`` (``check_fabric_flags``: Fabric
    overwrites a strategy's ``num_nodes`` with its own), and a ``precision_class`` plugin gets the finished strategy
    and device (``check_fabric_setup``).
    A ``strategy_class`` built with its accelerator hands it to the connector as ``Fabric(accelerator=...)``
    (:func:`_hand_over_accelerator`), and the Trainer's envddp is refused with the import of Fabric's. Idempotent.

    Args:
        resolve_precision: :func:`lightning_ddp_amp.fabric.precision.resolve_precision_flag`.
        strategy_class: :class:`lightning_ddp_amp.fabric.EnvDDPStrategy`.
        precision_class: :class:`lightning_ddp_amp.fabric.AmpPrecision`.
        trainer_strategy_class: The Trainer's envddp (:class:`lightning_ddp_amp.EnvDDPStrategy`), refused.

    Raises:
        StrategyConfigurationError: ``Fabric(strategy=trainer_strategy_class(...))``, or a mistyped envddp.
        PrecisionConfigurationError: a precision string neither Lightning nor this package knows.
    """
    if getattr(_Connector.__init__, _MARK, False):
        return
    original = _Connector.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: _Connector, *args: Any, **kwargs: Any) -> None:
        arguments = signature.bind(self, *args, **kwargs)
        arguments.apply_defaults()
        given = arguments.arguments
        _refuse_other_front(given["strategy"], trainer_strategy_class, strategy_class, "Fabric")
        _refuse_mistyped_strategy(given["strategy"], FABRIC_STRATEGY_REGISTRY, strategy_class)
        given["precision"], given["plugins"] = resolve_precision(given["precision"], given["plugins"])
        with _hand_over_accelerator(given, strategy_class):
            original(*arguments.args, **arguments.kwargs)
        strategy: Any = self.strategy
        if isinstance(strategy, strategy_class):
            strategy.check_fabric_flags(devices=given["devices"], num_nodes=given["num_nodes"])
        plugin: Any = self.precision
        if isinstance(plugin, precision_class):
            plugin.check_fabric_setup(strategy, self.accelerator)

    setattr(__init__, _MARK, True)
    _Connector.__init__ = __init__  # type: ignore[method-assign]


@contextlib.contextmanager
def _hand_over_accelerator(given: dict[str, Any], strategy_class: type[Any]) -> Iterator[bool]:
    """Hand the accelerator of ``strategy_class(accelerator=...)`` to the connector as its ``accelerator`` argument,
    while the connector runs; yield whether there was one to hand over.

    Why: the connector refuses a strategy that has both an accelerator and ``parallel_devices`` ("CPU parallel_devices
    set through EnvDDPStrategy class, but accelerator set to <CPUAccelerator ...>": it compares the accelerator to
    device names only), and envddp's devices answer from the launcher as soon as the accelerator is known, where
    Lightning's ``DDPStrategy`` has none until the connector sets them. As the connector's argument the same
    accelerator takes Lightning's own path, and the connector sets it back on the strategy (so does this function
    when the connector fails). An ``accelerator=`` given beside it is left for Lightning to refuse ("set through
    both").
    """
    strategy = given["strategy"]
    accelerator = strategy.accelerator if isinstance(strategy, strategy_class) else None
    if accelerator is None or not (isinstance(given["accelerator"], str) and given["accelerator"] == "auto"):
        yield False
        return
    given["accelerator"], strategy.accelerator = accelerator, None
    try:
        yield True
    finally:
        if strategy.accelerator is None:
            strategy.accelerator = accelerator


def _refuse_other_front(strategy: object, other_class: type[Any], own_class: type[Any], front: str) -> None:
    """Refuse the other front door's envddp (the Trainer's given to Fabric, or Fabric's to the Trainer), naming the
    import of this one's. Why: Lightning's own refusal ("You selected an invalid strategy name") does not say which.

    Raises:
        StrategyConfigurationError: ``strategy`` is an ``other_class``.
    """
    if isinstance(strategy, other_class):
        the = {"Trainer": "the Trainer", "Fabric": "Fabric"}
        other = "Fabric" if front == "Trainer" else "Trainer"
        raise StrategyConfigurationError(
            "strategy",
            f"{_exported_by(other_class)}.{other_class.__name__}(...)",
            f"it is {the[other]}'s envddp, built on {the[other]}'s strategy classes, which {the[front]} cannot run",
            f"use {the[front]}'s: `from {_exported_by(own_class)} import {own_class.__name__}`, or"
            f' {front}(strategy="envddp")',
        )


def _refuse_mistyped_strategy(strategy: object, registry: StrategyRegistryType, strategy_class: type[Any]) -> None:
    """Refuse a strategy name that nothing is registered under and that is nearer a name of ``strategy_class`` than
    any other (``"env_ddp"``, ``"envdpp"``), naming it. Why: Lightning's own refusal lists a few of its strategies and
    never envddp, so the user believes the package did not register. Lightning ignores the case of a name, as here.

    Raises:
        StrategyConfigurationError: ``strategy`` is such a name.
    """
    if not isinstance(strategy, str) or strategy.lower() in ("auto", *registry):
        return
    near = nearest(strategy, ("auto", *registry))
    if near is None or near == "auto" or registry[near]["strategy"] is not strategy_class:
        return
    ours = " and ".join(repr(name) for name, entry in registry.items() if entry["strategy"] is strategy_class)
    raise StrategyConfigurationError(
        "strategy",
        strategy,
        "no strategy is registered under this name",
        f"did you mean {near!r}? lightning_ddp_amp registers {ours}",
    )


def _exported_by(cls: type[Any]) -> str:
    """The shortest package path that exports ``cls``: ``lightning_ddp_amp`` for the Trainer's envddp,
    ``lightning_ddp_amp.fabric`` for Fabric's, and their ``pytorch_lightning`` flavour's likewise."""
    parts = cls.__module__.split(".")
    for end in range(1, len(parts)):
        package = ".".join(parts[:end])
        if getattr(sys.modules.get(package), cls.__name__, None) is cls:
            return package
    return cls.__module__


def is_fabric_optimizer(value: object) -> bool:
    """Whether ``value`` is the optimizer wrapper ``fabric.setup`` returns.

    Why: Fabric's ``_FabricOptimizer`` is private; a script that hands it to apex by hand must be told.
    """
    return isinstance(value, _FabricOptimizer)


def keep_fabric_zero_grad(optimizer: Optimizer) -> None:
    """Make ``fabric_optimizer.zero_grad()`` call a ``zero_grad`` patched on the optimizer itself (apex O2's).

    Why: Fabric's ``_FabricOptimizer`` derives from the optimizer's class and forwards only the attributes it lacks,
    so it finds the class's ``zero_grad`` (torch's) before an instance's patch. The optimizer gets a subclass of its
    class, of the same name, whose ``zero_grad`` calls the patch; on the optimizer itself the patch still wins.
    """
    patched = vars(optimizer).get("zero_grad")
    if patched is None:
        return
    base = type(optimizer)

    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        return patched(*args, **kwargs)

    optimizer.__class__ = type(base.__name__, (base,), {"zero_grad": zero_grad, "__module__": base.__module__})


def trainer_env_defaults(trainer_class: type[pl.Trainer]) -> dict[str, Any]:
    """The arguments environment variables give a ``trainer_class(...)`` that leaves them out, by name.

    ``PL_TRAINER_MAX_STEPS=5`` for ``Trainer``, ``PL_MYTRAINER_MAX_STEPS=5`` for a subclass ``MyTrainer``, each
    value parsed as a Python literal where it is one. Why: Lightning reads them in a private decorator of
    ``Trainer.__init__``, and offers no public way to ask.
    """
    return dict(vars(_parse_env_variables(trainer_class)))


def sampler_injection(trainer: pl.Trainer) -> bool:
    """Whether Lightning injects distributed samplers (``Trainer(use_distributed_sampler=...)``).

    Why: the Trainer keeps this flag only on its private accelerator connector.
    """
    return bool(trainer._accelerator_connector.use_distributed_sampler)


def set_sampler_injection(trainer: pl.Trainer, enabled: bool) -> None:
    """Turn Lightning's own sampler injection on or off for the Trainer's next loop.

    Why: Lightning's injection forces ``shuffle=True`` on the training set; the strategy shards DataLoaders
    itself (:mod:`lightning_ddp_amp.trainer.sharding`) and leaves only prediction to Lightning.
    """
    trainer._accelerator_connector.use_distributed_sampler = enabled


def launched_with_ckpt_path(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the fit a strategy's launcher is asked to run was given a ``ckpt_path``.

    Why: ``trainer.fit`` hands the launcher its private ``Trainer._fit_impl`` and ``fit``'s arguments, positional
    ones among them; only that method's signature tells which of them is ``ckpt_path``.

    Args:
        function: What the launcher was handed to run.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
    """
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get("ckpt_path") is not None


def optimizers_to_device(optimizers: list[Optimizer], device: torch.device) -> None:
    """Move any state the optimizers already hold to ``device``, as Lightning's own DDP strategy does in setup.

    Why: Lightning's helper also handles the optimizer-state layouts of its other strategies.
    """
    _optimizers_to_device(optimizers, device)


def disable_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Stop the training loop from broadcasting rank 0's SIGTERM flag at every step (Lightning ≥ 2.5.2).

    Why: that broadcast makes every rank wait for the others at every step, which costs as much as a tenth of a
    small model's step, and EnvDDPStrategy handles SIGTERM itself. The loop's method is shadowed on this one loop.
    """
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        setattr(loop, "_broadcast_sigterm_tensor", lambda: None)  # noqa: B010  (instance attribute, not the class)


def rebuild_dataloader(
    dataloader: DataLoader[Any], sampler: Sampler[Any] | Iterable[Any], *, batch_size: int | None = None
) -> DataLoader[Any]:
    """A copy of ``dataloader`` (of the same class, with the same arguments) that reads from ``sampler``.

    Why: only Lightning knows how to re-create an arbitrary DataLoader subclass, or a custom batch sampler, with
    the arguments the user passed; it records them when it calls the ``*_dataloader`` hooks.

    Args:
        dataloader: The user's DataLoader.
        sampler: The sampler to read from; it is put inside a custom batch sampler when there is one.
        batch_size: A new batch size, or None to keep the user's.
    """
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, sampler)
    if batch_size is not None:
        positional = list(getattr(dataloader, "__pl_saved_arg_names", ()))
        if "batch_size" in positional:
            index = positional.index("batch_size")
            args = (*args[:index], batch_size, *args[index + 1 :])
        else:
            kwargs["batch_size"] = batch_size
    rebuilt: DataLoader[Any] = _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)
    return rebuilt


def epoch_progress(trainer: pl.Trainer) -> tuple[int, int]:
    """How many training batches of the current epoch have finished their step, and how many the epoch has.

    Why: Lightning counts them only in its fit loop's progress tracking, which it does not document.
    """
    current: Any = trainer.fit_loop.epoch_loop.batch_progress.current  # typed as its base, which lacks the count
    return int(current.processed), int(trainer.num_training_batches)


def move_epoch_batches(trainer: pl.Trainer, by: int) -> None:
    """Move the fit loop's count of the current epoch's trained batches by ``by`` (its current and total counts).

    Why: Lightning ends an epoch, validates and accumulates gradients by these counters of its undocumented
    progress tracking; a resumed epoch on another number of ranks has another number of batches
    (:func:`lightning_ddp_amp.trainer.position.align_resumed_epoch`).
    """
    progress: Any = trainer.fit_loop.epoch_loop.batch_progress
    for counts in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            setattr(counts, name, getattr(counts, name) + by)


def after_closure(plugin: Precision, model: pl.LightningModule, optimizer: Optimizer) -> None:
    """Run what Lightning runs between a step's closure and ``optimizer.step()``.

    That is the ``on_before_optimizer_step`` hooks and gradient clipping. Why: a precision plugin that runs the
    closure itself (to unscale between backward and step) must run them too, as Lightning's ``MixedPrecision``
    does through this protected method.
    """
    plugin._after_closure(model, optimizer)


def make_stateful(
    loader: DataLoader[Any],
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
) -> None:
    """Have Lightning save ``state_dict()`` in checkpoints and hand it to ``load_state_dict`` on resume.

    Why: Lightning saves a DataLoader's position only when the loader itself has these two methods (its private
    ``_Stateful`` protocol); the loader must stay the user's own class, so they go on this one instance.
    """
    loader.state_dict = state_dict
    loader.load_state_dict = load_state_dict


def saved_mid_epoch(checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` was saved after some, but not all, training batches of its epoch had finished.

    Why: only the fit loop's progress counters, in Lightning's undocumented ``"loops"`` entry, tell.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    epoch = fit_loop.get("epoch_progress", {}).get("current", {})
    trained = int(batches.get("current", {}).get("processed", 0))
    epoch_open = int(epoch.get("processed", 0)) < int(epoch.get("started", 0))
    return trained > 0 and epoch_open and not batches.get("is_last_batch", False)


def saved_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The states of the training DataLoaders that ``checkpoint`` holds (see :func:`make_stateful`), in order.

    Why: Lightning keeps them in its fit loop's entry of the undocumented ``"loops"`` format.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return list(fit_loop.get("state_dict", {}).get("combined_loader", []))


def is_loader_state_mismatch(exception: BaseException) -> bool:
    """Whether ``exception`` is Lightning's refusal of a checkpoint that holds more DataLoader states than the run.

    Why: Lightning raises a plain ``RuntimeError`` for it, told apart from others only by its text.
    """
    return isinstance(exception, RuntimeError) and "stateful loaders, but found" in str(exception)


def epoch_boundary_loops(epochs: int, global_step: int) -> dict[str, Any]:
    """The ``"loops"`` entry of a checkpoint saved after ``epochs`` whole epochs and ``global_step`` optimizer steps,
    from which ``fit`` continues at the start of epoch ``epochs`` (a converted classic checkpoint's).

    Why: the epoch and the step a fit continues at are Lightning's fit loop progress counters, in its undocumented
    ``"loops"`` format. The entries come from this Lightning's own loops (a Trainer that never runs), so each
    release gets its own layout; only the counters of epochs, trained batches and optimizer steps are set.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import SingleDeviceStrategy

    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the Trainer's "GPU available" lines and tips
    try:
        trainer = Trainer(
            accelerator="cpu", strategy=SingleDeviceStrategy(torch.device("cpu")), plugins=[LightningEnvironment()],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
    finally:
        quiet.setLevel(level)
    loops = {
        name: getattr(trainer, name).state_dict() for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop")
    }
    fit = loops["fit_loop"]
    counts = {"ready": epochs, "started": epochs, "processed": epochs, "completed": epochs}
    for part in ("total", "current"):
        fit["epoch_progress"][part].update(counts)
    fit["epoch_loop.batch_progress"]["total"].update({name: global_step for name in counts})
    optimizer = fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    optimizer["step"]["total"].update(ready=global_step, completed=global_step)
    optimizer["zero_grad"]["total"].update(ready=global_step, started=global_step, completed=global_step)
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] = global_step  # the step loggers are given
    return loops


def version() -> str:
    """This Lightning's version, as its checkpoints record it (``"pytorch-lightning_version"``)."""
    import lightning.pytorch

    return str(lightning.pytorch.__version__)  # type: ignore[attr-defined]


def precision_values() -> tuple[str, ...]:
    """The strings ``Trainer(precision=...)`` accepts (``"32-true"``, ``"16-mixed"``, ``"bf16"``, ...).

    Why: Lightning lists them only in private ``Literal`` types; ``compare`` checks every name before any run.
    """
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

    return (*typing.get_args(_PRECISION_INPUT_STR), *typing.get_args(_PRECISION_INPUT_STR_ALIAS))


def evaluation_metrics(trainer: pl.Trainer) -> dict[str, float]:
    """What the script logged in the validation or test run that is ending, by the names ``callback_metrics`` uses.

    Why: ``callback_metrics`` mixes them with training's; only the running evaluation loop's results tell which were
    logged in this run. Read in ``on_validation_end`` / ``on_test_end``, after Lightning computed (and synced) them.
    """
    results = trainer._results
    if results is None:
        return {}
    values = results.metrics(on_step=False)["callback"]
    return {name: float(value) for name, value in values.items() if value.numel() == 1}
