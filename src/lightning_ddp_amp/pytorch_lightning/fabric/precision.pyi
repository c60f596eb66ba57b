# Generated from ../../fabric/precision.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""AmpPrecision for Lightning Fabric: the AMP backends of the Trainer's plugin, behind Fabric's precision hooks.

``Fabric(strategy="envddp", precision="apex-O1")`` runs the apex recipe in a kept loop::

    model, optimizer = fabric.setup(model, optimizer)   # amp.initialize(model, optimizer), then the DDP wrap
    fabric.backward(loss)                               # with amp.scale_loss(loss, optimizer) as s: s.backward()
    optimizer.step()                                    # apex's step: skipped after an overflow

The backends (:mod:`lightning_ddp_amp.pytorch_lightning.amp.apex_backend`, :mod:`~lightning_ddp_amp.amp.native_backend`) are the
Trainer's; this module only answers Fabric's hooks. Fabric hands a precision plugin no optimizer at backward, so the
optimizers come from :meth:`AmpPrecision.connect`, which envddp calls before it wraps the models.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, Literal

import torch
from lightning_fabric.accelerators.cuda import CUDAAccelerator
from lightning_fabric.accelerators.mps import MPSAccelerator
from lightning_fabric.plugins import Precision
from lightning_fabric.utilities import rank_zero_info
from torch import Tensor
from torch.nn import Module, ModuleList
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.amp.backend import AmpBackend, Placement, backend_names, choose_backend
from lightning_ddp_amp.amp.loss_optimizers import LossOptimizers
from lightning_ddp_amp.amp.settings import AmpSettings, check_choice, check_half_steps
from lightning_ddp_amp.errors import PrecisionConfigurationError
from lightning_ddp_amp.precision_strings import OptLevel, resolve_flag

SETUP_MODELS = "lightning_ddp_amp.fabric.setup_models(fabric, [model_a, model_b], optimizer)"


class AmpPrecision(Precision):
    """Mixed precision with NVIDIA apex amp or native torch AMP for Lightning Fabric, in the apex recipe's order.

    The Trainer's :class:`lightning_ddp_amp.pytorch_lightning.AmpPrecision` with Fabric's hooks; its arguments mean the same (there is
    no ``models``: Fabric is handed the models themselves, see :func:`~lightning_ddp_amp.fabric.setup_models`).

    Args:
        opt_level: apex's optimization level, ``"O0"`` … ``"O3"``.
        backend: ``"apex"`` (NVIDIA apex required), ``"native"`` (torch.amp) or ``"auto"``.
        keep_batchnorm_fp32: As in ``amp.initialize`` (O2 / O3 only).
        loss_scale: ``"dynamic"`` or a fixed scale; default: the level's (dynamic for O1 / O2).
        num_losses: Number of losses with their own loss scale; pass ``loss_id`` to ``fabric.backward``.
        min_loss_scale: Floor of a dynamic loss scale.
        max_loss_scale: Ceiling of a dynamic loss scale.
        cast_model_outputs: dtype the models' floating outputs are cast to, e.g. ``"float32"``.
        dtype: Native backend only: ``"float16"`` or ``"bfloat16"``.

    Raises:
        PrecisionConfigurationError: An argument is invalid or the combination cannot run.
        ApexUnavailableError: ``backend="apex"`` and apex amp cannot be imported.
    """

    def __init__(
        self,
        opt_level: OptLevel = "O1",
        backend: Literal["auto", "apex", "native"] = "auto",
        keep_batchnorm_fp32: bool | None = None,
        loss_scale: float | Literal["dynamic"] | None = None,
        num_losses: int = 1,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
        cast_model_outputs: str | torch.dtype | None = None,
        dtype: Literal["float16", "bfloat16"] = "float16",
    ) -> None:
        ...

    def __repr__(self) -> str:
        ...

    @property
    def flag(self) -> str:
        """The ``Fabric(precision=...)`` string of what runs, for messages: ``"apex-O1"``, ``"native-O2"``, ...; under
        ``backend="auto"`` (``"amp-O1"``) the backend it chose, so that a fix naming it asks for that backend."""
        ...

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer steps fp32 master copies of half-precision model weights (apex O2)."""
        ...

    @property
    def initializes_with_optimizers(self) -> bool:
        """Whether the models must be handed over together with their optimizers, before any DDP wrap (apex)."""
        ...

    @property
    def amp_backend(self) -> AmpBackend:
        """The backend the hooks hand over to: apex's or torch.amp's, built once the device is known."""
        ...

    def check_fabric_setup(self, strategy: object, accelerator: object) -> None:
        """Check that Fabric can run this plugin with ``strategy`` on ``device_type``; called when Fabric is built.

        ``backend="auto"`` chooses again now that both are known, as on the Trainer.

        Raises:
            ApexUnavailableError: apex on a device other than CUDA.
            PrecisionConfigurationError: apex with a strategy that wraps the model in DDP before ``amp.initialize``.
        """
        ...

    def computes(self) -> str:
        """What this plugin computes, as the one line Fabric's rank 0 prints when it is built: the backend and what the
        level means there, why ``backend="auto"`` passed over apex, and, at a ``*-mixed`` level, that inputs and outputs
        keep their dtypes, where Fabric's own ``16-mixed`` / ``bf16-mixed`` casts them."""
        ...

    @override
    def convert_module(self, module: Module) -> Module:
        """Cast the model where the native backend casts it (O3), before Fabric moves it; apex casts in
        :meth:`connect`. Every model set up so far keeps its casts (a backend casts all its models at once)."""
        ...

    def connect(self, models: Sequence[Module], optimizers: Sequence[Optimizer], call: str) -> None:
        """``amp.initialize(models, optimizers)``: the models and their raw optimizers, before any DDP wrap.

        Args:
            models: The models, on their device.
            optimizers: Their optimizers (not Fabric's wrappers).
            call: What the script called, for messages.

        Raises:
            PrecisionConfigurationError: apex amp was already initialized in this process, or an optimizer's ``eps``
                rounds to 0 in the half-precision weights it would step (O3).
        """
        ...

    def models_wrapped(self) -> None:
        """The connected models are wrapped in DDP (every rank holds rank 0's weights): apex O2 takes them into its
        fp32 masters, as the recipe's first backward after the wrap does; envddp calls this."""
        ...

    def connected(self, item: Module | Optimizer) -> bool:
        """Whether the model or optimizer ``item`` went through :meth:`connect`."""
        ...

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """While the script accumulates (``fabric.no_backward_sync``): backward keeps apex's gradients scaled."""
        ...

    @override
    def convert_input(self, data: Any) -> Any:
        ...

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        ...

    @override
    def backward(
        self,
        tensor: Tensor,
        model: Module | None,
        *args: Any,
        loss_id: int = 0,
        optimizers: Optimizer | Sequence[Optimizer] | None = None,
        delay_unscale: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """``fabric.backward(loss)``: backward on the scaled loss, inside ``amp.scale_loss`` for apex.

        Args:
            tensor: The loss.
            model: The model Fabric names, unused.
            *args: Passed on to ``Tensor.backward``.
            loss_id: Which loss scaler scales this loss (``num_losses=2`` gives a second loss its own).
            optimizers: The optimizers this loss is scaled for, as the classic ``amp.scale_loss(loss, optimizers)``
                named them (Fabric's or the raw ones). Default: the one optimizer set up, or the one whose
                parameters the loss reaches (:mod:`~lightning_ddp_amp.amp.loss_optimizers`).
            delay_unscale: Keep apex from unscaling, as apex's accumulation recipe does on the micro-batches that do
                not step. Default: inside ``fabric.no_backward_sync(model)``, else not (the micro-batch that steps).
            **kwargs: Passed on to ``Tensor.backward``.

        Raises:
            PrecisionConfigurationError: ``loss_id`` is not one of the ``num_losses`` scalers, or the loss reaches the
                parameters of several optimizers and ``optimizers`` does not name them.
        """
        ...

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale before clipping (native; apex unscaled when ``amp.scale_loss`` exited); once per step."""
        ...

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` on the raw optimizer: apex's patched step (skipped after an overflow), or the
        GradScaler's."""
        ...

    def step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the last step of ``optimizer`` (Fabric's or the raw one) was skipped because of an overflow."""
        ...

    @property
    def may_skip_steps(self) -> bool:
        """Whether a dynamic loss scaler can skip a step on overflow."""
        ...

    @property
    def current_loss_scale(self) -> float | None:
        """The scale the next backward multiplies the loss by (the first loss scaler's); None without loss scaling."""
        ...

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:  # type: ignore[override]
        """The parameters the optimizer steps: apex O2's fp32 masters, which clipping must see."""
        ...

    @override
    def state_dict(self) -> dict[str, Any]:
        """The loss scalers, and under apex O2 the fp32 master weights: put the plugin into ``fabric.save``'s state."""
        ...

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the loss scale(s) and apex O2's fp32 master weights (``fabric.load`` after ``fabric.setup``).

        Raises:
            PrecisionConfigurationError: The state was not written by AmpPrecision.
        """
        ...

    @override
    def teardown(self) -> None:
        ...


def resolve_precision_flag(precision: object, plugins: Any) -> tuple[object, Any]:
    """``Fabric(precision="apex-O1")`` / ``"amp-O1"`` / ``"native-O1"`` as an :class:`AmpPrecision` in ``plugins``
    (:func:`~lightning_ddp_amp.precision_strings.resolve_flag`)."""
    ...


#: apex's calls a kept line of the classic loop may hand Fabric's optimizer wrapper to, and what replaces each.
_APEX_CALLS = {
    "scale_loss": "replace `with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()` by"
    " fabric.backward(loss), which runs amp.scale_loss on the raw optimizer",
    "initialize": "drop the amp.initialize call: fabric.setup(model, optimizer) (or setup_models) made it already,"
    " before the DDP wrap",
}


def _refuse_fabric_optimizers(amp: ModuleType) -> None:
    """Make ``amp.scale_loss`` and ``amp.initialize`` refuse Fabric's optimizer wrapper, which a kept line of the
    classic loop would hand them: apex patches the object it is given (``step``, to skip it after an overflow), and a
    patch on the wrapper would bypass the strategy. Idempotent; the package's own calls hand over raw optimizers."""
    ...


def _refusing(name: str, original: Callable[..., Any], fix: str) -> Callable[..., Any]:
    """apex's ``amp.<name>``, refusing Fabric's optimizer wrapper with ``fix``."""

    ...
