# Generated from ../../amp/apex_backend.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""NVIDIA apex amp as a backend of :class:`~lightning_ddp_amp.pytorch_lightning.AmpPrecision`: the calls the recipe made::

    models, optimizer = amp.initialize(models, optimizer, opt_level="O1")   # before DDP
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

Finding and importing apex is :mod:`lightning_ddp_amp.amp.apex_loader`'s part.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp_amp.amp.apex_loader import find_amp, load_apex_module, missing_cuda
from lightning_ddp_amp.pytorch_lightning.amp.apex_o1 import (
    hand_rnns_their_input,
    keep_attention_off_the_fast_path,
    turn_off_the_weight_cast_cache,
)
from lightning_ddp_amp.amp.backend import AmpBackend, Placement, cast_floats
from lightning_ddp_amp.amp.settings import AmpSettings
from lightning_ddp_amp.errors import ApexUnavailableError, PrecisionConfigurationError

# The amp modules initialized so far in this process: apex documents one amp.initialize per process.
_INITIALIZED: weakref.WeakSet[ModuleType] = weakref.WeakSet()
# The LightningModules apex O2/O3 cast whole: their batches are cast to fp16 in every Trainer of this process.
_BATCH_CAST: weakref.WeakSet[Module] = weakref.WeakSet()
_OVERRIDDEN_STEP_WARNING = r"Seems like `optimizer\.step\(\)` has been overridden after learning rate scheduler"


def supports_device(amp: ModuleType, device_type: str) -> bool:
    """Real apex amp needs CUDA. A stand-in may declare ``supports_cpu`` (the CPU test double does)."""
    ...


def _explain_set_to_none(apex_zero_grad: Callable[[], None]) -> Callable[..., None]:
    """apex O2's ``zero_grad`` takes no arguments; torch's ``set_to_none`` gets an answer instead of a TypeError."""

    ...


class ApexAmp(AmpBackend):
    """The apex calls :class:`~lightning_ddp_amp.pytorch_lightning.AmpPrecision` makes.

    Forward keeps the default context, none: ``amp.initialize`` patched torch (O1) or the models' forward (O2/O3).

    Args:
        amp: The ``apex.amp`` module.
        opt_level: ``"O0"`` … ``"O3"``.
        options: The other ``amp.initialize`` arguments the user set (None values are left out).
    """

    def __init__(self, amp: ModuleType, opt_level: str, options: dict[str, Any]) -> None:
        ...

    @classmethod
    @override
    def unavailable(cls, settings: AmpSettings) -> str | None:
        # apex computes in float16 only, so bfloat16 always runs natively.
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
    def from_settings(cls, settings: AmpSettings, device_type: str) -> ApexAmp:
        ...

    @property
    def initialized(self) -> bool:
        ...

    def initialize(self, modules: Sequence[Module], optimizers: Sequence[Optimizer]) -> None:
        """``amp.initialize(models, optimizers, ...)``: once, before any DDP wrap, with the raw optimizers.

        apex patches the modules and optimizers in place, so the objects Lightning holds stay valid.
        """
        ...

    @classmethod
    @override
    def master_weights(cls, settings: AmpSettings) -> bool:
        ...

    @classmethod
    @override
    def model_dtype(cls, settings: AmpSettings) -> torch.dtype | None:
        ...

    @property
    def keeps_master_weights(self) -> bool:
        """Whether apex steps fp32 master copies of fp16 weights (O2)."""
        ...

    @property
    @override
    def scales_loss(self) -> bool:
        ...

    @property
    @override
    def may_skip_steps(self) -> bool:
        ...

    @classmethod
    @override
    def check_placement(cls, settings: AmpSettings, placement: Placement) -> None:
        """Refuse a device apex cannot run on, and a strategy that wraps the model in DDP before ``connect``.

        Raises:
            ApexUnavailableError: An accelerator other than CUDA.
            PrecisionConfigurationError: The strategy wraps the model in DDP before the precision plugin sees it.
        """
        ...

    @override
    def connect(self, model: Module, selected: list[Module], optimizers: list[Optimizer]) -> None:
        """``amp.initialize`` on the selected modules and the raw optimizers.

        Raises:
            PrecisionConfigurationError: The model arrived already wrapped.
        """
        ...

    @override
    def models_wrapped(self) -> None:
        """O2: copy the fp16 model weights, rank 0's since the DDP wrap, into the fp32 masters built at
        ``amp.initialize`` from this rank's own: apex builds them at the first backward, after the wrap, so a rank that
        started from other weights trains rank 0's. Masters restored from a checkpoint are kept."""
        ...

    @override
    def evaluate(self, model: Module) -> None:
        """A model amp.initialize cast keeps its input casts, in any Trainer of this process; another model (every
        model, in a fresh process) runs as built.

        O1's patches of torch stay for the rest of the process, as in apex: every model evaluated after an O1 fit runs
        under them, as the recipe's evaluation did.
        """
        ...

    @override
    def convert_input(self, data: Any) -> Any:
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
        """Run ``run_backward`` on the scaled loss inside ``amp.scale_loss``."""
        # A LightningOptimizer wraps the torch optimizer that went through amp.initialize.
        ...

    @override
    def step(self, optimizer: Optimizer, **kwargs: Any) -> tuple[Any, bool]:
        """``optimizer.step()``, which after an overflow apex has replaced with a skip for this one call.

        apex keeps no public record of the skip; its own flag for it is ``_amp_stash.already_patched``.
        """
        ...

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        """``amp.master_params(optimizer)``: the fp32 parameters clipping must see."""
        ...

    @override
    def state_dict(self) -> dict[str, Any]:
        """The loss scalers, and under O2 the fp32 master weights."""
        ...

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loss scale(s), and O2's fp32 master weights, after ``amp.initialize`` as apex requires."""
        ...

    @override
    def current_loss_scale(self) -> float | None:
        ...

    def loss_scalers(self) -> list[dict[str, float]]:
        """``amp.state_dict()`` as a list: ``loss_scale`` and ``unskipped`` of each loss's scaler."""
        ...

    def load_loss_scalers(self, scalers: list[dict[str, float]]) -> None:
        """``amp.load_state_dict``, which apex allows only after ``amp.initialize``: until then it waits."""
        ...

    def master_weight_values(self) -> list[Tensor]:
        """The fp32 master weights of every optimizer, in order; empty where apex keeps none.

        apex's own checkpoints leave them out: a resume rebuilds them from the fp16 model weights, and so loses
        every bit below fp16's precision. Saving them makes an O2 resume continue exactly.
        """
        ...

    @override
    def master_weight_pairs(self) -> list[tuple[Tensor, Tensor]]:
        """apex O2's fp16 model parameters beside their fp32 masters, from each optimizer's ``_amp_stash``."""
        ...

    def load_master_weights(self, saved: list[Tensor]) -> None:
        """Copy saved fp32 master weights into apex's, after ``amp.initialize`` built them (until then it waits).

        Raises:
            PrecisionConfigurationError: the checkpoint's master weights do not fit this model.
        """
        ...


def _is_ddp_wrapper(model: Module) -> bool:
    """Whether ``model`` is torch's DistributedDataParallel or apex's: wrapped before ``amp.initialize``."""
    ...
