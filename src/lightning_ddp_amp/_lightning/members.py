"""Lightning's private classes, helpers and flags that the package uses as they are, and the protected members its
subclasses of Lightning's classes use (:data:`INHERITED`).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
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
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.argparse import _parse_env_variables
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Sampler

if TYPE_CHECKING:
    import lightning.pytorch as pl

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


def after_closure(plugin: Precision, model: pl.LightningModule, optimizer: Optimizer) -> None:
    """Run what Lightning runs between a step's closure and ``optimizer.step()``.

    That is the ``on_before_optimizer_step`` hooks and gradient clipping. Why: a precision plugin that runs the
    closure itself (to unscale between backward and step) must run them too, as Lightning's ``MixedPrecision``
    does through this protected method.
    """
    plugin._after_closure(model, optimizer)


def silenced_callback_hooks(*names: str) -> dict[str, None]:
    """Class attributes that keep the Trainer from calling these hooks of a callback: ``_call_callback_hooks`` calls a
    callback's hook only where it is callable, so a hook set to None costs no call and no profiler context.

    Why: a callback that does nothing at ``on_before_backward`` still costs a call through the profiler at every step
    (about 1.4 µs a hook on 2 CPU cores); ``compare``'s recording would pay it at the three of the six hooks of a
    training step that it does not use.
    """
    return dict.fromkeys(names)


def version() -> str:
    """This Lightning's version, as its checkpoints record it (``"pytorch-lightning_version"``)."""
    import lightning.pytorch

    return str(lightning.pytorch.__version__)


def precision_values() -> tuple[str, ...]:
    """The strings ``Trainer(precision=...)`` accepts (``"32-true"``, ``"16-mixed"``, ``"bf16"``, ...).

    Why: Lightning lists them only in private ``Literal`` types; ``compare`` checks every name before any run.
    """
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

    return (*typing.get_args(_PRECISION_INPUT_STR), *typing.get_args(_PRECISION_INPUT_STR_ALIAS))
