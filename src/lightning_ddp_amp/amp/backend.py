"""The interface :class:`~lightning_ddp_amp.AmpPrecision` delegates to, and the registry of its backends.

``AmpPrecision`` validates its arguments (:mod:`~lightning_ddp_amp.amp.settings`), picks a backend by name and hands each Lightning hook to it. A backend
answers those hooks for one AMP implementation: :class:`~lightning_ddp_amp.amp.apex_backend.ApexAmp` (NVIDIA apex amp) or
:class:`~lightning_ddp_amp.amp.native_backend.NativeAmp` (torch.amp). Hooks a backend does not need keep the defaults here.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_ddp_amp.amp.settings import AmpSettings
from lightning_ddp_amp.errors import LightningDDPAmpError, PrecisionConfigurationError

#: The backends by name, as ``module:class``, in the order ``backend="auto"`` tries them. A backend is imported
#: only when it is asked for, so removing one is removing its module and its line here.
_REGISTRY = {
    "apex": "lightning_ddp_amp.amp.apex_backend:ApexAmp",
    "native": "lightning_ddp_amp.amp.native_backend:NativeAmp",
}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a backend is asked to train, as the precision plugin learns it from the Trainer (or Fabric).

    Attributes:
        device_type: ``"cuda"``, ``"mps"`` or ``"cpu"``.
        strategy: The strategy's name, for messages.
        wraps_before_connect: Whether the strategy wraps the model in DistributedDataParallel before the precision
            plugin sees it (Lightning's ``ddp``), where apex needs ``amp.initialize`` first (envddp).
    """

    device_type: str
    strategy: str
    wraps_before_connect: bool


class AmpBackend(abc.ABC):
    """One AMP implementation behind :class:`~lightning_ddp_amp.AmpPrecision`, hook by hook.

    The class methods answer from the settings alone, before a Trainer exists (the strategy asks for
    ``master_weights`` and ``model_dtype`` then); an instance is built once the device is known.
    """

    @classmethod
    @abc.abstractmethod
    def unavailable(cls, settings: AmpSettings) -> str | None:
        """Why ``backend="auto"`` cannot choose this backend for ``settings``; None when it can."""

    @classmethod
    @abc.abstractmethod
    def check_settings(cls, settings: AmpSettings, requested: str) -> None:
        """Refuse settings this backend cannot run, when AmpPrecision is built.

        Args:
            settings: AmpPrecision's arguments.
            requested: The ``backend`` argument that chose this backend, for messages.
        """

    @classmethod
    @abc.abstractmethod
    def lightning_precision(cls, settings: AmpSettings) -> str:
        """The Lightning precision label (what ``trainer.precision`` reports)."""

    @classmethod
    @abc.abstractmethod
    def describe(cls, settings: AmpSettings) -> str:
        """What the settings run as here, for the line ``backend="auto"`` prints when it falls back."""

    @classmethod
    @abc.abstractmethod
    def from_settings(cls, settings: AmpSettings, device_type: str) -> AmpBackend:
        """The backend for ``settings`` on ``device_type`` (``"cuda"``, ``"cpu"``, ...)."""

    @classmethod
    @abc.abstractmethod
    def master_weights(cls, settings: AmpSettings) -> bool:
        """Whether the optimizer steps fp32 master copies of half-precision model weights."""

    @classmethod
    @abc.abstractmethod
    def model_dtype(cls, settings: AmpSettings) -> torch.dtype | None:
        """The dtype the selected modules' weights are cast to; None when they stay fp32."""

    @property
    @abc.abstractmethod
    def scales_loss(self) -> bool:
        """Whether backward runs on a scaled loss, so that the optimizer steps outside the closure."""

    @property
    @abc.abstractmethod
    def may_skip_steps(self) -> bool:
        """Whether a dynamic loss scaler can skip a step on overflow."""

    @classmethod  # noqa: B027 (optional hook)
    def check_placement(cls, settings: AmpSettings, placement: Placement) -> None:
        """Refuse a strategy or device this backend cannot train with, when the Trainer is built (builds nothing)."""

    @classmethod
    def unsuited(cls, settings: AmpSettings, placement: Placement) -> str | None:
        """Why ``backend="auto"`` cannot choose this backend for ``placement``; None when it can.

        The reason :meth:`check_placement` would refuse it for: one rule, whether it refuses or passes over.
        """
        try:
            cls.check_placement(settings, placement)
        except LightningDDPAmpError as error:
            return f"{error.field}={error.value!r}: {error.problem}"
        return None

    def convert_module(self, module: Module, selected: list[Module]) -> None:  # noqa: B027 (optional hook)
        """Prepare the model before the optimizers exist (``Precision.convert_module``); ``selected`` are the modules
        amp acts on (``module`` itself by default)."""

    def connect(self, model: Module, selected: list[Module], optimizers: list[Optimizer]) -> None:  # noqa: B027
        """Take the model and its raw optimizers, before any DDP wrap (``Precision.connect``, with optimizers);
        ``selected`` are the modules handed to ``amp.initialize``."""

    def models_wrapped(self) -> None:  # noqa: B027 (optional hook)
        """The connected models are wrapped in DDP, whose constructor gave every rank rank 0's weights: the weights the
        recipe's first backward sees. Called by envddp on both front doors."""

    def evaluate(self, model: Module) -> None:  # noqa: B027 (optional hook)
        """Get ready to evaluate ``model`` (validate, test, predict): after a fit of it in this process, as that fit
        left it; a model no fit connected runs as built."""

    def convert_input(self, data: Any) -> Any:
        """The batch as the model should see it."""
        return data

    def forward_context(self) -> AbstractContextManager[None]:
        """The context every forward runs in."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def backward(
        self,
        loss: Tensor,
        optimizers: Sequence[Optimizer],
        run_backward: Callable[[Tensor], None],
        loss_id: int,
        delay_unscale: bool,
    ) -> None:
        """Run ``run_backward`` on the loss as this backend scales it.

        Args:
            loss: The loss.
            optimizers: The optimizers whose parameters the loss reaches.
            run_backward: Lightning's backward of the (scaled) loss.
            loss_id: Which loss scaler scales the loss.
            delay_unscale: Keep the gradients scaled after backward (gradient accumulation).
        """

    def unscale(self, optimizer: Optimizer) -> None:  # noqa: B027 (optional hook)
        """Unscale ``optimizer``'s gradients after the closure, before hooks and clipping see them."""

    @abc.abstractmethod
    def step(self, optimizer: Optimizer, **kwargs: Any) -> tuple[Any, bool]:
        """Step ``optimizer`` after its closure ran.

        Returns:
            The optimizer's return value and whether the step was skipped on overflow.
        """

    def master_weight_pairs(self) -> list[tuple[Tensor, Tensor]]:
        """``(model parameter, its fp32 master)`` for each parameter the optimizer steps through a master copy."""
        return []

    def current_loss_scale(self) -> float | None:
        """The scale of the next backward's loss (of the first loss scaler), or None without loss scaling.

        Read from what the backend already holds on the host, so asking costs no device sync.
        """
        return None

    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        """The parameters the optimizer steps, which gradient clipping must see."""
        return (param for group in optimizer.param_groups for param in group["params"])

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This backend's part of AmpPrecision's checkpoint state, ``loss_scalers`` included."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from AmpPrecision's checkpoint state, which either backend may have written."""

    def teardown(self) -> None:  # noqa: B027 (optional hook)
        """Undo what the backend installed on the model."""


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, in the order ``backend="auto"`` tries them."""
    return tuple(_REGISTRY)


def backend_class(name: str) -> type[AmpBackend]:
    """The backend registered as ``name``."""
    module, _, attribute = _REGISTRY[name].partition(":")
    backend: type[AmpBackend] = getattr(importlib.import_module(module), attribute)
    return backend


def choose_backend(
    requested: str, settings: AmpSettings, placement: Placement | None = None
) -> tuple[str, type[AmpBackend], list[str]]:
    """The backend for ``backend=requested``, its settings checked: that one, or for ``"auto"`` the first that can
    run ``settings`` (and, once the Trainer is built, train at its ``placement``).

    Returns:
        The backend's name, its class, and why ``"auto"`` passed over the backends before it (for the one line
        :class:`~lightning_ddp_amp.AmpPrecision` prints on rank 0).

    Raises:
        PrecisionConfigurationError: The backend cannot run these settings.
        ApexUnavailableError: ``requested="apex"`` and apex amp cannot be imported.
    """
    name, passed_over = requested, []
    if requested == "auto":
        for name in backend_names():
            candidate = backend_class(name)
            reason = candidate.unavailable(settings)
            if reason is None and placement is not None:
                reason = candidate.unsuited(settings, placement)
            if reason is None:
                break
            passed_over.append(reason)
        else:
            raise PrecisionConfigurationError(
                "backend",
                "auto",
                f"no backend can run these settings ({'; '.join(passed_over)})",
                'pass backend="native"',
            )
    chosen = backend_class(name)
    chosen.check_settings(settings, requested)
    return name, chosen, passed_over


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with every floating-point tensor in it cast to ``dtype``."""
    return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)
