"""The hooks around the construction of a Trainer and of a Fabric: Lightning's private connectors build the strategy,
the precision plugin and the accelerator from their arguments, and have no public extension point.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning
from lightning.fabric.connector import _Connector
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from packaging.version import Version

from lightning_ddp_amp.errors import StrategyConfigurationError, nearest

#: Lightning releases CI tests against: lowest included, highest excluded.
TESTED_LIGHTNING = (Version("2.5.0"), Version("2.7.0"))

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
      and ``num_nodes`` (``check_trainer_flags``, which starts nothing: the strategy's launcher starts any missing ranks
      when ``fit`` begins). When the precision plugin is ``precision_class``, it is handed the finished strategy and
      accelerator (``check_trainer_setup``), unless the strategy's launcher ``starts_ranks``: this process then only
      supervises them, and each rank checks the plugin it trains with.
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
        # A process that starts the ranks when fit begins only supervises them (envddp without a launcher).
        supervises = isinstance(strategy, strategy_class) and getattr(strategy.launcher, "starts_ranks", False)
        plugin: Any = self.precision_plugin
        if isinstance(plugin, precision_class) and not supervises:
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


def _refuse_mistyped_strategy(strategy: object, registry: _StrategyRegistry, strategy_class: type[Any]) -> None:
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
