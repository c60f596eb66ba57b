# Generated from ../../amp/native_backend.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""torch.amp as a backend of :class:`~lightning_ddp_amp.pytorch_lightning.AmpPrecision`: apex's O-levels in native terms.

========  ===================================================  ================================================
level     apex ``amp.initialize``                               native (this module)
========  ===================================================  ================================================
O0        fp32                                                  fp32: no autocast, no loss scaling
O1        torch functions patched to run in fp16 where safe,    ``torch.autocast(dtype)`` + dynamic
          dynamic loss scaling                                  ``GradScaler``: the same idea, done by torch
O2        model in fp16 except batchnorm, fp32 master           autocast + dynamic ``GradScaler``, like O1: the
          weights, dynamic loss scaling                         weights stay fp32 (they are the master weights)
                                                                and batchnorm runs in fp32 under autocast. Not
                                                                identical: activations are cast per operation
                                                                rather than the whole model living in fp16
O3        whole model in fp16, loss scale 1                     the selected modules cast to ``dtype``, their
                                                                floating inputs to ``dtype`` and outputs to
                                                                fp32 (as apex patches their forward); no loss
                                                                scaling. With the LightningModule itself
                                                                selected, the batch is cast instead
                                                                (Lightning's ``"16-true"``)
========  ===================================================  ================================================

``dtype="bfloat16"`` runs the same levels in bfloat16, which needs no loss scaling. On the CPU, autocast and
``GradScaler`` work as on CUDA from torch 2.3 on; with an older torch, float16 on the CPU is an error naming what
this torch lacks (:func:`cpu_fp16_missing`), and CUDA uses ``torch.cuda.amp.GradScaler``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from pytorch_lightning import LightningModule
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp_amp.pytorch_lightning.amp.backend import AmpBackend, ModuleSelector, cast_floats
from lightning_ddp_amp.amp.settings import AmpSettings
from lightning_ddp_amp.errors import PrecisionConfigurationError


def describe(opt_level: str, dtype: torch.dtype, loss_scale: float | str | None = None) -> str:
    """What a level means natively, as printed when ``"amp-O*"`` falls back to this backend.

    Args:
        opt_level: The apex level.
        dtype: The autocast dtype.
        loss_scale: ``AmpPrecision(loss_scale=...)``: a number is the fixed scale used; None or ``"dynamic"``, a
            dynamic one.
    """
    ...


# A loss scale the user fixed never grows: GradScaler has no static mode, so growth is pushed out of reach.
_NEVER = 2**31 - 1


def lightning_precision(opt_level: str, dtype: torch.dtype) -> str:
    """The Lightning precision label for a level (what ``trainer.precision`` reports)."""
    ...


@functools.cache
def cpu_fp16_missing() -> tuple[str, ...]:
    """What this torch lacks to train in float16 on the CPU; empty when it has it all (torch 2.3 and later).

    A probe, not a version check: it runs an fp16 linear, conv2d and bmm, a linear under
    ``torch.autocast("cpu", dtype=torch.float16)``, and scales a tensor with ``torch.amp.GradScaler("cpu")``.
    """
    ...


def torch_gaps() -> list[str]:
    """What this torch lacks that the native backend would use, and what it does instead; empty on torch >= 2.3."""
    ...


def _grad_scaler(device_type: str, **options: Any) -> Any:
    """``torch.amp.GradScaler``, or on CUDA before torch 2.3 (which lacks it) ``torch.cuda.amp.GradScaler``."""
    ...


class NativeAmp(AmpBackend):
    """The torch.amp calls :class:`~lightning_ddp_amp.pytorch_lightning.AmpPrecision` makes.

    Args:
        opt_level: ``"O0"`` … ``"O3"``.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        device_type: Where autocast and the scaler run: ``"cuda"``, ``"cpu"``, ...
        loss_scale: ``"dynamic"``, a fixed scale, or None for the level's default.
        min_loss_scale: Floor of the scale, or None.
        max_loss_scale: Ceiling of the scale.
        cast_model_outputs: dtype for the selected modules' floating outputs, or None for the level's default.
    """

    def __init__(
        self,
        opt_level: str,
        dtype: torch.dtype,
        device_type: str,
        loss_scale: float | str | None,
        min_loss_scale: float | None,
        max_loss_scale: float,
        cast_model_outputs: torch.dtype | None = None,
    ) -> None:
        ...

    @classmethod
    @override
    def unavailable(cls, settings: AmpSettings) -> str | None:
        ...

    @classmethod
    @override
    def check_settings(cls, settings: AmpSettings, requested: str) -> None:
        ...

    @classmethod
    @override
    def lightning_precision(cls, settings: AmpSettings) -> str:
        ...

    @classmethod
    @override
    def describe(cls, settings: AmpSettings) -> str:
        ...

    @classmethod
    @override
    def from_settings(cls, settings: AmpSettings, device_type: str) -> NativeAmp:
        ...

    @classmethod
    @override
    def master_weights(cls, settings: AmpSettings) -> bool:
        # The model's weights stay fp32 (they are the master weights), or under O3 the optimizer steps them cast.
        ...

    @classmethod
    @override
    def model_dtype(cls, settings: AmpSettings) -> torch.dtype | None:
        ...

    @property
    @override
    def scales_loss(self) -> bool:
        ...

    @property
    @override
    def may_skip_steps(self) -> bool:
        ...

    @override
    def convert_module(self, module: Module, select: ModuleSelector) -> None:
        """Cast the selected modules here, where apex would cast them in ``amp.initialize``."""
        ...

    def prepare(self, root: Module, selected: list[Module]) -> None:
        """Cast the selected modules (O3) and their inputs and outputs, as ``amp.initialize`` patches them.

        Args:
            root: The LightningModule.
            selected: The modules handed to ``amp.initialize`` (``root`` itself by default).
        """
        ...

    @override
    def teardown(self) -> None:
        ...

    def release(self) -> None:
        """Remove the hooks :meth:`prepare` registered."""
        ...

    def _cast_inputs(self, module: Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        ...

    @override
    def convert_input(self, data: Any) -> Any:
        """The batch, cast to the half dtype when O3 selected the LightningModule itself."""
        ...

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """``torch.autocast`` for O1/O2; nothing for O0 and O3."""
        ...

    @override
    def backward(
        self,
        loss: Tensor,
        optimizers: Sequence[Optimizer],
        run_backward: Callable[[Tensor], None],
        loss_id: int,
        delay_unscale: bool,
    ) -> None:
        """Run ``run_backward`` on the loss, scaled by the ``GradScaler`` when there is one.

        One scaler serves every loss and optimizer, and ``GradScaler`` unscales only in :meth:`unscale`.
        """
        ...

    @override
    def unscale(self, optimizer: Optimizer) -> None:
        """Unscale the gradients before hooks and clipping see them."""
        ...

    @override
    def step(self, optimizer: Optimizer, **kwargs: Any) -> tuple[Any, bool]:
        """Step through the scaler, which skips a step whose gradients overflowed.

        Returns:
            The optimizer's return value and whether the step was skipped.
        """
        ...

    def _clamp(self, scale: float) -> float:
        ...

    @override
    def current_loss_scale(self) -> float | None:
        ...

    def loss_scalers(self) -> list[dict[str, float]]:
        """The scaler's state in apex's terms (``loss_scale``, ``unskipped``), to move between backends."""
        ...

    def load_loss_scalers(self, scalers: list[dict[str, float]]) -> None:
        """Take the loss scale of a checkpoint written by the apex backend."""
        ...

    @override
    def state_dict(self) -> dict[str, Any]:
        """The loss scale in apex's terms, to move between backends, and the ``GradScaler``'s own state."""
        ...

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the ``GradScaler``; from a checkpoint of the apex backend, its first loss scale."""
        ...

    def _load_grad_scaler(self, state: dict[str, Any]) -> None:
        ...


def _cast_outputs(dtype: torch.dtype) -> Callable[[Module, Any, Any], Any]:
    ...
