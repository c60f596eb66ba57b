# Generated from ../../trainer/precision.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""AmpPrecision: apex amp and native torch AMP in one Lightning precision plugin.

``Trainer(strategy="envddp", precision="apex-O1")`` gives the apex recipe::

    model, optimizer = amp.initialize([model_a, model_b], optimizer, opt_level="O1")  # before DDP
    model = DDP(model)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

``precision="amp-O1"`` does the same with apex when it is importable and with torch.amp otherwise, and
``precision="native-O1"`` with torch.amp even where apex is installed; the table in
:mod:`lightning_ddp_amp.amp.native_backend` says what each level means natively.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from pytorch_lightning import LightningModule
from pytorch_lightning.accelerators import Accelerator, CUDAAccelerator, MPSAccelerator
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import SingleDeviceStrategy, Strategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.amp.backend import AmpBackend, Placement, backend_names, choose_backend
from lightning_ddp_amp.amp.crossing import describe_crossing, grad_scaler_state
from lightning_ddp_amp.amp.loss_optimizers import LossOptimizers
from lightning_ddp_amp.amp.settings import AmpSettings, check_choice, check_half_steps, check_models
from lightning_ddp_amp.errors import PrecisionConfigurationError
from lightning_ddp_amp.precision_strings import OptLevel, resolve_flag

BACKENDS = ("auto", *backend_names())


class AmpPrecision(Precision):
    """Mixed precision with NVIDIA apex amp or native torch AMP, in the apex recipe's order.

    Args:
        opt_level: apex's optimization level, ``"O0"`` … ``"O3"``.
        backend: ``"apex"`` (NVIDIA apex required), ``"native"`` (torch.amp) or ``"auto"`` (apex when it can be
            imported, else native).
        models: Attribute names (dotted paths allowed) of the LightningModule's sub-modules to hand to
            ``amp.initialize``, e.g. ``["model_a", "model_b"]``. The LightningModule can instead define
            ``configure_amp_models()`` returning the modules. Default: the LightningModule itself.
        keep_batchnorm_fp32: As in ``amp.initialize`` (O2 / O3 only).
        loss_scale: ``"dynamic"`` or a fixed scale; default: the level's (dynamic for O1 / O2).
        num_losses: Number of losses with their own loss scale; pass ``loss_id`` to ``manual_backward``.
        min_loss_scale: Floor of a dynamic loss scale.
        max_loss_scale: Ceiling of a dynamic loss scale.
        cast_model_outputs: dtype the selected modules' floating outputs are cast to, e.g. ``"float32"``.
        dtype: Native backend only: ``"float16"`` or ``"bfloat16"`` (no loss scaling).

    Raises:
        PrecisionConfigurationError: An argument is invalid or the combination cannot run.
        ApexUnavailableError: ``backend="apex"`` and apex amp cannot be imported.
    """

    def __init__(
        self,
        opt_level: OptLevel = "O1",
        backend: Literal["auto", "apex", "native"] = "auto",
        models: Sequence[str] | None = None,
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
    def master_weights(self) -> bool:
        """Whether the optimizer steps fp32 master copies of half-precision model weights (apex O2).

        apex's ``zero_grad`` then detaches each model gradient in place, which EnvDDPStrategy takes into account.
        """
        ...

    @property
    def model_dtype(self) -> torch.dtype | None:
        """The dtype the selected modules' weights, and so their gradients, are cast to; None when they stay fp32."""
        ...

    @property
    def amp_backend(self) -> AmpBackend:
        """The backend the hooks hand over to (:mod:`~lightning_ddp_amp.amp.backend`): apex's or torch.amp's.

        Built on first use, after the Trainer has told the device (``check_trainer_setup``); a plugin used alone
        guesses it.
        """
        ...

    def check_trainer_setup(self, strategy: Strategy, accelerator: Accelerator) -> None:
        """Check that the Trainer can run this plugin; called when the Trainer is built.

        ``backend="auto"`` (``precision="amp-O*"``) chooses again, now that the strategy and the device are known:
        apex where apex can run with them, else torch.amp. Its choice is one line on rank 0, printed here, where
        the ranks train (a self-launch's agent never gets this far).

        Raises:
            ApexUnavailableError: ``backend="apex"`` on an accelerator other than CUDA.
            PrecisionConfigurationError: ``backend="apex"`` with a strategy that wraps the model in DDP before the
                precision plugin sees it.
        """
        ...

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        ...

    def models_wrapped(self) -> None:
        """The connected models are wrapped in DDP (every rank holds rank 0's weights): apex O2 takes them into its
        fp32 masters, as the recipe's first backward after the wrap does; envddp calls this."""
        ...

    def _check_half_steps(self, model: Module, optimizers: list[Optimizer]) -> None:
        """Refuse an ``eps`` that rounds to 0 where the optimizer steps half-precision weights (:func:`check_half_steps
        <lightning_ddp_amp.amp.settings.check_half_steps>`), when ``fit`` starts: the optimizers do not exist when the
        Trainer is built."""
        ...

    def amp_modules(self, lightning_module: LightningModule) -> list[Module]:
        """The modules handed to ``amp.initialize``: ``models``, ``configure_amp_models()``, or the module itself.

        Raises:
            PrecisionConfigurationError: a name does not lead to a module, both sources are given, or
                ``configure_amp_models()`` returns something other than modules.
        """
        ...

    def _selected(self, model: Module) -> list[Module]:
        # A model that is not the LightningModule (a DDP wrapper, or a plain module outside a Trainer) is taken whole.
        ...

    def _skip_aware(self, config: LRSchedulerConfig) -> LRSchedulerConfig:
        ...

    @property
    def current_loss_scale(self) -> float | None:
        """The scale the next backward multiplies the loss by (the first loss scaler's); None without loss scaling.

        It costs no device sync: both backends keep it on the host.
        """
        ...

    def step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the last step of ``optimizer`` was skipped because its gradients overflowed."""
        ...

    @override
    def convert_module(self, module: Module) -> Module:
        ...

    @override
    def convert_input(self, data: Any) -> Any:
        ...

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        ...

    @override
    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: LightningModule,
        optimizer: Any,
        *args: Any,
        loss_id: int = 0,
        optimizers: Optimizer | Sequence[Optimizer] | None = None,
        delay_unscale: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """Backward on the scaled loss: inside ``amp.scale_loss`` for apex, through the ``GradScaler`` natively.

        Under manual optimization ``manual_backward(loss, loss_id=1, ...)`` passes the keyword arguments here.

        Args:
            tensor: The loss.
            model: The LightningModule.
            optimizer: The optimizer being stepped; None under manual optimization.
            *args: Passed on to ``LightningModule.backward``.
            loss_id: Which loss scaler scales this loss (``num_losses=2`` gives a second loss its own).
            optimizers: The optimizers this loss is scaled for, as the classic ``amp.scale_loss(loss, optimizers)``
                named them. Default: ``optimizer``; under manual optimization the one optimizer whose parameters
                the loss reaches (:mod:`~lightning_ddp_amp.amp.loss_optimizers`).
            delay_unscale: True keeps apex from unscaling (gradient accumulation). Default: unscale only in
                the backward of the micro-batch that steps.
            **kwargs: Passed on to ``LightningModule.backward``.

        Raises:
            PrecisionConfigurationError: ``loss_id`` is not the number of one of the ``num_losses`` scalers, or
                the loss reaches the parameters of several optimizers and ``optimizers`` does not name them.
        """
        ...

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure here, then ``step()`` without it: apex rejects closures, GradScaler needs it so.

        Without loss scaling (O0, O3, bfloat16) the closure goes to ``step()`` as usual, so LBFGS works there.
        """
        ...

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:  # type: ignore[override]
        ...

    @override
    def state_dict(self) -> dict[str, Any]:
        ...

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the loss scale(s), and apex O2's fp32 master weights; apex after ``amp.initialize``, as it requires.

        A checkpoint written by the other backend carries over its loss scale, so a run can move between apex
        and native AMP.
        """
        ...

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Write the checkpoint so that a run can go on under any other precision, Lightning's own included.

        * apex O2 trains fp32 masters of fp16 weights; the checkpoint's weights (``state_dict``) become those
          masters, so that ``32-true``, ``16-mixed``, ``bf16-mixed``, ``amp-O*`` or ``load_from_checkpoint`` read
          the weights apex trained, not their fp16 copies (an apex O2 resume still restores its masters exactly).
        * a dynamic loss scale is also written as the GradScaler state Lightning's ``16-mixed`` reads (under
          ``"MixedPrecision"``); AmpPrecision itself reads its own entry.
        """
        ...

    def put_fp32_masters(self, state: dict[str, Tensor], module: Module) -> None:
        """Replace, in ``module``'s ``state``, apex O2's fp16 weights by the fp32 masters the optimizer steps.

        Every name of a tied weight is replaced; the masters are not copied (a checkpoint saves them once).
        """
        ...

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        ...

    @override
    def teardown(self) -> None:
        ...


class SkipAwareScheduler:
    """A step-interval LR scheduler that stands still when its optimizer's step was skipped on overflow.

    Lightning steps schedulers after every training step; a step the loss scaler skipped did not happen, so
    the recipe's ``if not skipped: scheduler.step()`` is applied here. Everything else is the wrapped scheduler.

    Args:
        scheduler: The user's scheduler.
        skipped: Tells whether the last step of an optimizer was skipped.
    """

    _OWN = ("scheduler", "_skipped")

    def __init__(self, scheduler: Any, skipped: Callable[[Optimizer], bool]) -> None:
        ...

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped scheduler's ``step``, unless the optimizer step it follows was skipped on overflow."""
        ...

    def __getattr__(self, name: str) -> Any:
        ...

    def __setattr__(self, name: str, value: Any) -> None:
        ...


def resolve_precision_flag(precision: object, plugins: Any) -> tuple[object, Any]:
    """``Trainer(precision="apex-O1")`` / ``"amp-O1"`` / ``"native-O1"`` as an :class:`AmpPrecision` in ``plugins``
    (:func:`~lightning_ddp_amp.precision_strings.resolve_flag`)."""
    ...


def _trainer_fn(model: Module) -> TrainerFn | None:
    """What the model's Trainer was asked to run (fit, validate, test, predict); None without a Trainer."""
    ...


def _device_type(accelerator: Accelerator) -> str:
    ...


def _submodule(root: Module, name: str) -> Module:
    ...
