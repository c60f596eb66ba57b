"""The options of the DistributedDataParallel wrapper, declared once.

torch's defaults are read from ``DistributedDataParallel``'s signature, and only the options that differ from them
are passed on, as Accelerate's ``DistributedDataParallelKwargs.to_kwargs()`` does. Where envddp's default differs
from torch's on purpose, :data:`DEVIATIONS` holds it with the reason. ``ddp_impl="apex"`` swaps in
``apex.parallel.DistributedDataParallel``, which has none of torch's options. The communication hook is an option
too: named by a string (:data:`COMM_HOOKS`), and checked against the process group's backend and the precision
plugin (:func:`check_precision_plugin`). This module imports nothing from Lightning: a precision plugin is asked for
its ``master_weights`` and ``model_dtype``, whichever Lightning flavour or front door built it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_localSGD
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_amp.amp.apex_loader import load_apex_module
from lightning_ddp_amp.errors import StrategyConfigurationError, nearest

#: torch's ``DistributedDataParallel`` defaults, as its signature declares them.
TORCH_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(DistributedDataParallel).parameters.items()
    if parameter.default is not inspect.Parameter.empty
}

#: Gradient-compression hooks that can be named by a string (e.g. in a YAML config).
COMM_HOOKS: dict[str, Callable[..., Any]] = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


@dataclass(frozen=True)
class Deviation:
    """envddp's own default for one of torch's DDP options.

    Attributes:
        value: envddp's default.
        reason: Why it differs from torch's.
        not_under_apex: Why torch's default stays under apex amp, whose loss scaling holds the model's gradients
            itself; None when the deviation holds there too.
    """

    value: Any
    reason: str
    not_under_apex: str | None = None


#: Where envddp's defaults differ from torch's, and why. An option the user sets always wins.
DEVIATIONS: dict[str, Deviation] = {
    "gradient_as_bucket_view": Deviation(
        value=True,
        reason="gradients live in DDP's communication buckets instead of being copied into them: faster, less"
        " memory, the same numerics (benchmarks/)",
        not_under_apex="apex holds the model's gradients itself: under O0, O1 and O3 each amp.scale_loss stashes the"
        " gradients accumulated so far and adds them back after the backward, and on bucket views the next synchronised"
        " backward overwrites the stash (accumulation under no_sync would lose its earlier micro-batches); under O2"
        " optimizer.zero_grad() detaches every model gradient in place (param.grad.detach_()), which torch refuses on"
        " DDP's bucket views (\"Can't detach views in-place\")",
    ),
}


class DDPOptions:
    """The DDP wrapper envddp builds, and the options the user gave it.

    Args:
        impl: ``"torch"`` or ``"apex"`` (``EnvDDPStrategy(ddp_impl=...)``).
        named: The DDP options ``EnvDDPStrategy`` takes by name; None means not given.
        extra: Any other argument of the wrapper (``**ddp_kwargs``), passed through untouched.
        comm_state: ``EnvDDPStrategy(ddp_comm_state=...)``.
        comm_hook: Whether a communication hook was given (apex's wrapper takes none).

    Raises:
        StrategyConfigurationError: An unknown ``impl``, a torch option or hook with apex's wrapper, an argument the
            wrapper does not take, one the strategy sets itself, or post-localSGD model averaging.
    """

    def __init__(
        self, impl: str, named: dict[str, Any], extra: dict[str, Any], comm_state: object, comm_hook: bool
    ) -> None:
        _refuse_model_averaging(extra, comm_state)
        self.given = {name: value for name, value in named.items() if value is not None}
        #: apex's wrapper for ``impl="apex"``; None for torch's. Any torch option given is refused there, even at
        #: torch's default: that default differs between torch releases.
        self.apex = _apex_ddp(impl, [*self.given, *(["ddp_comm_hook"] if comm_hook else [])])
        _check_ddp_kwargs(self.apex.wrapper if self.apex else DistributedDataParallel, extra)
        self.extra = extra

    def to_kwargs(self, apex_amp: bool) -> dict[str, Any]:
        """What the wrapper receives: the options that differ from torch's defaults, envddp's deviations included.

        Args:
            apex_amp: Whether the precision plugin runs apex amp (:func:`holds_gradients`).
        """
        if self.apex is not None:
            return dict(self.extra)
        options = {**self.deviations(apex_amp), **self.given}
        changed = {name: value for name, value in options.items() if value != TORCH_DEFAULTS[name]}
        return {**changed, **self.extra}

    def deviations(self, apex_amp: bool) -> dict[str, Any]:
        """envddp's defaults that apply under this precision plugin, for options the user left unset."""
        return {
            name: deviation.value
            for name, deviation in DEVIATIONS.items()
            if name not in self.given and not (apex_amp and deviation.not_under_apex)
        }

    def kept_under_apex(self) -> dict[str, str]:
        """The options left at torch's default under apex amp, with the reason (for the log)."""
        return {
            name: deviation.not_under_apex
            for name, deviation in DEVIATIONS.items()
            if self.apex is None and name not in self.given and deviation.not_under_apex
        }

    def refused_with_master_weights(self) -> dict[str, str]:
        """Options the user set to a deviation that apex O2's fp32 master weights rule out, with the reason."""
        return {
            name: deviation.not_under_apex
            for name, deviation in DEVIATIONS.items()
            if self.apex is None and self.given.get(name) == deviation.value and deviation.not_under_apex
        }


def _refuse_model_averaging(extra: dict[str, Any], comm_state: object) -> None:
    # Post-localSGD needs Lightning's periodic model averager, which envddp does not run; without it the replicas
    # would drift apart silently after start_localSGD_iter.
    if "model_averaging_period" in extra:
        field, value = "model_averaging_period", extra["model_averaging_period"]
    elif isinstance(comm_state, post_localSGD.PostLocalSGDState):
        field, value = "ddp_comm_state", type(comm_state).__name__
    else:
        return
    raise StrategyConfigurationError(
        field,
        value,
        "envddp does not run post-localSGD model averaging (a PostLocalSGDState ddp_comm_state needs it)",
        "drop model_averaging_period and the PostLocalSGDState, or use Trainer(strategy='ddp') for post-localSGD",
    )


class ApexDDP:
    """``apex.parallel.DistributedDataParallel``, as apex-era scripts wrapped with it: where it differs from torch's.

    It is not a torch DDP, so the strategy asks it the three things it does differently: wrapping, accumulating
    gradients locally (it has no ``no_sync()``) and recognising its own wrapper at teardown.
    """

    def __init__(self, wrapper: type[Module]) -> None:
        self.wrapper = wrapper

    def wrap(self, module: Module, kwargs: dict[str, Any]) -> Any:
        """``module`` in apex's wrapper, given apex's own options."""
        return self.wrapper(module, **kwargs)

    def wraps(self, model: object) -> bool:
        """Whether ``model`` is apex's wrapper."""
        return isinstance(model, self.wrapper)

    @contextlib.contextmanager
    def no_sync(self, model: Any) -> Iterator[None]:
        """Accumulate gradients locally: pausing its allreduce is apex's way."""
        model.disable_allreduce()
        try:
            yield
        finally:
            model.enable_allreduce()


def _apex_ddp(ddp_impl: str, torch_options: list[str]) -> ApexDDP | None:
    if ddp_impl == "torch":
        return None
    if ddp_impl != "apex":
        raise StrategyConfigurationError(
            "ddp_impl", ddp_impl, "it must be 'torch' or 'apex'", "use one of those values"
        )
    if torch_options:
        raise StrategyConfigurationError(
            "ddp_impl",
            "apex",
            f"{', '.join(torch_options)} belong to torch's DistributedDataParallel, which apex's does not have",
            "drop them, or pass apex's own options (message_size=..., delay_allreduce=...) as keyword arguments",
        )
    return ApexDDP(load_apex_module("apex.parallel", "ddp_impl", "apex").DistributedDataParallel)


def _check_ddp_kwargs(ddp_class: type[Module], ddp_kwargs: dict[str, Any]) -> None:
    # Checked here: in a single process DDP is never built, so a typo would only surface under the launcher.
    accepted = set(inspect.signature(ddp_class.__init__).parameters) - {"self", "module"}
    for name in ddp_kwargs:
        if name in ("device_ids", "output_device"):
            raise StrategyConfigurationError(
                name, ddp_kwargs[name], "the strategy sets it from LOCAL_RANK", f"drop {name}"
            )
        if name not in accepted:
            close = nearest(name, sorted(accepted))
            hint = f"did you mean {close!r}?" if close else f"known: {', '.join(sorted(accepted))}"
            raise StrategyConfigurationError(
                name, ddp_kwargs[name], f"{ddp_class.__qualname__} has no such argument", hint
            )


def resolve_comm_hook(hook: str | Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The DDP communication hook ``EnvDDPStrategy(ddp_comm_hook=...)`` names: a function, or a name in
    :data:`COMM_HOOKS`.

    Raises:
        StrategyConfigurationError: An unknown name.
    """
    if hook is None or callable(hook):
        return hook
    if hook not in COMM_HOOKS:
        raise StrategyConfigurationError(
            "ddp_comm_hook",
            hook,
            f"it is not a known hook name (known: {', '.join(sorted(COMM_HOOKS))})",
            "use one of those names, or pass the hook function itself",
        )
    return COMM_HOOKS[hook]


def compression_dtype(hook: Callable[..., Any] | None, wrapper: Callable[..., Any] | None) -> torch.dtype | None:
    """The dtype torch's compression hook or wrapper casts gradients to; None for any other hook."""
    for candidate in (wrapper, hook):
        if candidate in (default_hooks.fp16_compress_hook, default_hooks.fp16_compress_wrapper):
            return torch.float16
        if candidate in (default_hooks.bf16_compress_hook, default_hooks.bf16_compress_wrapper):
            return torch.bfloat16
    return None


def check_comm_hook_backend(hook: Callable[..., Any] | None, wrapper: Callable[..., Any] | None, backend: str) -> None:
    """Refuse torch's bfloat16 compression on a process group that cannot run it.

    Raises:
        StrategyConfigurationError: The bfloat16 hook or wrapper on another backend than NCCL.
    """
    bf16 = hook is default_hooks.bf16_compress_hook or wrapper is default_hooks.bf16_compress_wrapper
    if bf16 and backend != "nccl":
        raise StrategyConfigurationError(
            "ddp_comm_hook",
            "bf16",
            f"torch's bfloat16 compression hook needs NCCL (CUDA), but the process group runs {backend}",
            'use ddp_comm_hook="fp16" on the CPU, or train on GPUs',
        )


def register_comm_hook(
    model: DistributedDataParallel, hook: Callable[..., Any] | None, wrapper: Callable[..., Any] | None, state: object
) -> None:
    """Register the communication hook (wrapped by ``wrapper``) on ``model``: on gloo too, where Lightning registers
    hooks on CUDA only."""
    if hook is not None:
        model.register_comm_hook(state=state, hook=wrapper(hook) if wrapper is not None else hook)


def check_precision_plugin(
    plugin: object,
    ddp: DDPOptions,
    comm_hook: Callable[..., Any] | None,
    comm_wrapper: Callable[..., Any] | None,
) -> None:
    """Refuse DDP options that the precision plugin's half-precision model or master weights cannot train with.

    Raises:
        StrategyConfigurationError: An option set to one of envddp's deviations that fp32 master weights rule
            out (``gradient_as_bucket_view=True`` under apex O2), or a gradient
            compression hook on a model whose gradients are already half precision.
    """
    refused = ddp.refused_with_master_weights() if master_weights(plugin) else {}
    for name, reason in refused.items():
        value = ddp.given[name]
        raise StrategyConfigurationError(
            name,
            value,
            f"under {plugin} {reason}",
            f"drop {name}={value!r} (envddp leaves it at torch's default under fp32 master weights), or use"
            " opt_level='O1'",
        )
    half = getattr(plugin, "model_dtype", None)
    compression = compression_dtype(comm_hook, comm_wrapper)
    if half is not None and compression is not None:
        name = "ddp_comm_wrapper" if comm_wrapper is not None else "ddp_comm_hook"
        effect = (
            "compresses nothing"
            if compression == half
            else f"would round them to {_dtype_name(compression)}, losing precision without saving any bytes"
        )
        raise StrategyConfigurationError(
            name,
            "fp16" if compression == torch.float16 else "bf16",
            f"under {plugin} the model's gradients are already {_dtype_name(half)}, so the hook {effect}",
            f"drop {name}: DDP already communicates these gradients in {_dtype_name(half)}",
        )


#: What torch's DDP says when a parameter got no gradient in a backward, and what Lightning's ddp replaces it by.
_UNUSED_PARAMETERS = ("Expected to have finished reduction in the prior iteration", "ddp_find_unused_parameters_true")


def explain_unused_parameters(exception: BaseException, ddp_kwargs: dict[str, Any]) -> None:
    """Replace, in DDP's error about parameters that got no gradient, the advice to use Lightning's
    ``ddp_find_unused_parameters_true`` (where apex cannot run: Lightning's ddp wraps the model before
    ``amp.initialize``) by envddp's own setting; with the search already on, the error is left as it is."""
    if ddp_kwargs.get("find_unused_parameters", False):
        return
    message = (
        "find_unused_parameters=False: a backward in training_step left parameters of the LightningModule without a"
        " gradient, and DistributedDataParallel (one wrapper around the LightningModule) needs every parameter's"
        " gradient in every backward unless it searches for the unused ones: several losses a step, as a GAN's, each"
        " reaching only some of its models, or a sub-module that does not run in every step. Fix: keep envddp and let"
        ' it search: Trainer(strategy="envddp_find_unused_parameters_true"), or EnvDDPStrategy(find_unused_parameters'
        "=True) beside its other arguments (Lightning's 'ddp_find_unused_parameters_true' wraps the model before"
        " amp.initialize, so apex cannot run there)"
    )
    exception.args = tuple(
        message if isinstance(arg, str) and any(text in arg for text in _UNUSED_PARAMETERS) else arg
        for arg in exception.args
    )


def master_weights(plugin: object) -> bool:
    """Whether ``plugin`` keeps fp32 master weights (AmpPrecision under apex O2); asked of any precision plugin."""
    return bool(getattr(plugin, "master_weights", False))


def holds_gradients(plugin: object) -> bool:
    """Whether ``plugin`` runs apex amp, whose loss scaling holds references to the model's gradients across
    backward passes (AmpPrecision's ``backend == "apex"``); asked of any precision plugin."""
    return getattr(plugin, "backend", None) == "apex"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
