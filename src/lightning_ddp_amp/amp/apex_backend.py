"""NVIDIA apex amp as a backend of :class:`~lightning_ddp_amp.AmpPrecision`: the calls the recipe made::

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
from lightning_ddp_amp.amp.apex_o1 import (
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
    return device_type == "cuda" or bool(getattr(amp, "supports_cpu", False))


def _explain_set_to_none(apex_zero_grad: Callable[[], None]) -> Callable[..., None]:
    """apex O2's ``zero_grad`` takes no arguments; torch's ``set_to_none`` gets an answer instead of a TypeError."""

    def zero_grad(set_to_none: bool | None = None) -> None:
        if set_to_none:
            raise PrecisionConfigurationError(
                "set_to_none",
                True,
                "apex O2's optimizer.zero_grad() takes no set_to_none: it zeroes the fp16 model gradients in place"
                " and drops the fp32 master gradients itself",
                "call optimizer.zero_grad() (or zero_grad(set_to_none=False)) under apex O2",
            )
        apex_zero_grad()

    return zero_grad


class ApexAmp(AmpBackend):
    """The apex calls :class:`~lightning_ddp_amp.AmpPrecision` makes.

    Forward keeps the default context, none: ``amp.initialize`` patched torch (O1) or the models' forward (O2/O3).

    Args:
        amp: The ``apex.amp`` module.
        opt_level: ``"O0"`` … ``"O3"``.
        options: The other ``amp.initialize`` arguments the user set (None values are left out).
    """

    def __init__(self, amp: ModuleType, opt_level: str, options: dict[str, Any]) -> None:
        self.amp = amp
        self.opt_level = opt_level
        self.options = options
        self._pending_loss_scalers: list[dict[str, float]] | None = None
        self._pending_master_weights: list[Tensor] | None = None
        self._masters_restored = False
        self._optimizers: list[Optimizer] = []
        self._cast_batch = False

    @classmethod
    @override
    def unavailable(cls, settings: AmpSettings) -> str | None:
        # apex computes in float16 only, so bfloat16 always runs natively.
        if settings.torch_dtype != torch.float16:
            return "apex amp has no bfloat16"
        return "NVIDIA apex amp is not importable" if find_amp() is None else None

    @classmethod
    @override
    def check_settings(cls, settings: AmpSettings, requested: str) -> None:
        no_cuda = missing_cuda() if find_amp() is None else None
        if no_cuda is not None:
            # Said before any advice on building apex: no build makes apex amp run here.
            raise ApexUnavailableError(
                "backend",
                requested,
                f"apex amp needs CUDA, and this machine has none ({no_cuda}): apex amp cannot run here, whatever is installed",
                f'use precision="amp-{settings.opt_level}" (AmpPrecision(backend="auto")): the same O-levels on'
                " torch.amp here, and apex amp on a CUDA machine that has NVIDIA apex",
            )
        load_apex_module("apex.amp", "backend", requested)
        if settings.torch_dtype != torch.float16:
            raise PrecisionConfigurationError(
                "dtype", "bfloat16", "apex amp computes in float16 only", 'use backend="native" for bfloat16'
            )

    @classmethod
    @override
    def lightning_precision(cls, settings: AmpSettings) -> str:
        return {"O0": "32-true", "O3": "16-true"}.get(settings.opt_level, "16-mixed")

    @classmethod
    @override
    def describe(cls, settings: AmpSettings) -> str:
        return f"apex amp {settings.opt_level}"

    @classmethod
    @override
    def from_settings(cls, settings: AmpSettings, device_type: str) -> ApexAmp:
        # amp.initialize takes the options by their names, all but the native backend's dtype; None is apex's default.
        given = {**settings.options(), "cast_model_outputs": settings.output_dtype}
        options = {name: value for name, value in given.items() if name != "dtype" and value is not None}
        amp = load_apex_module("apex.amp", "backend", "apex")
        return cls(amp, settings.opt_level, options)

    @property
    def initialized(self) -> bool:
        return self.amp in _INITIALIZED

    def initialize(self, modules: Sequence[Module], optimizers: Sequence[Optimizer]) -> None:
        """``amp.initialize(models, optimizers, ...)``: once, before any DDP wrap, with the raw optimizers.

        apex patches the modules and optimizers in place, so the objects Lightning holds stay valid.
        """
        if self.initialized:
            raise PrecisionConfigurationError(
                "backend",
                "apex",
                "trainer.fit would call amp.initialize again, but an earlier trainer.fit in this process"
                " initialized apex amp, and apex supports one amp.initialize per process (trainer.validate, test"
                " and predict after a fit evaluate the model as it trained)",
                'start each fit in a new process (trainer.fit(model, ckpt_path="last") resumes from the last'
                ' checkpoint), or use backend="native"',
            )
        self.amp.initialize(list(modules), list(optimizers), opt_level=self.opt_level, **self.options)
        _INITIALIZED.add(self.amp)
        if self.opt_level == "O1":
            turn_off_the_weight_cast_cache(self.amp)
        self._optimizers = list(optimizers)
        for optimizer in optimizers:
            # apex builds O2's fp32 master weights lazily, at the first backward. Build them now, so that an
            # optimizer state restored from a checkpoint is cast to the fp32 masters, not to the fp16 params; the
            # DDP wrap that follows gives them rank 0's weights (models_wrapped).
            lazy_init = getattr(optimizer, "_amp_lazy_init", None)
            if callable(lazy_init):
                lazy_init()
            if self.keeps_master_weights:
                optimizer.zero_grad = _explain_set_to_none(optimizer.zero_grad)  # type: ignore[method-assign]
        # apex replaces optimizer.step in place after the schedulers were built; its step still calls the one
        # the schedulers wrapped, so every schedule stays correct and torch's warning about it is a false alarm.
        warnings.filterwarnings("ignore", message=_OVERRIDDEN_STEP_WARNING, category=UserWarning)
        if self._pending_loss_scalers is not None:
            self.load_loss_scalers(self._pending_loss_scalers)
        if self._pending_master_weights is not None:
            self.load_master_weights(self._pending_master_weights)

    @classmethod
    @override
    def master_weights(cls, settings: AmpSettings) -> bool:
        return settings.opt_level == "O2"

    @classmethod
    @override
    def model_dtype(cls, settings: AmpSettings) -> torch.dtype | None:
        return torch.float16 if settings.opt_level in ("O2", "O3") else None

    @property
    def keeps_master_weights(self) -> bool:
        """Whether apex steps fp32 master copies of fp16 weights (O2)."""
        return self.opt_level == "O2"

    @property
    @override
    def scales_loss(self) -> bool:
        return True

    @property
    @override
    def may_skip_steps(self) -> bool:
        loss_scale = self.options.get("loss_scale")
        return loss_scale == "dynamic" or (loss_scale is None and self.opt_level in ("O1", "O2"))

    @classmethod
    @override
    def check_placement(cls, settings: AmpSettings, placement: Placement) -> None:
        """Refuse a device apex cannot run on, and a strategy that wraps the model in DDP before ``connect``.

        Raises:
            ApexUnavailableError: An accelerator other than CUDA.
            PrecisionConfigurationError: The strategy wraps the model in DDP before the precision plugin sees it.
        """
        if not supports_device(load_apex_module("apex.amp", "backend", "apex"), placement.device_type):
            raise ApexUnavailableError(
                "accelerator",
                placement.device_type,
                "apex amp needs CUDA: its loss scaler and kernels run on the GPU",
                'train on a GPU (accelerator="cuda"), or use the native backend (precision="amp-O1", which runs'
                " on the CPU too)",
            )
        if placement.wraps_before_connect:
            raise PrecisionConfigurationError(
                "strategy",
                placement.strategy,
                "this strategy wraps the model in DistributedDataParallel before the precision plugin sees it, but"
                " apex requires amp.initialize before the wrap",
                'use strategy="envddp", which calls amp.initialize first, as the recipe did',
            )

    @override
    def connect(self, model: Module, selected: list[Module], optimizers: list[Optimizer]) -> None:
        """``amp.initialize`` on the selected modules and the raw optimizers.

        Raises:
            PrecisionConfigurationError: The model arrived already wrapped.
        """
        if _is_ddp_wrapper(model):
            raise PrecisionConfigurationError(
                "strategy",
                type(model).__name__,
                "the model reached the precision plugin already wrapped; amp.initialize must come before the DDP wrap",
                'use strategy="envddp"',
            )
        if self.opt_level == "O1":  # before amp.initialize, which a refusal must leave for the fix to use
            keep_attention_off_the_fast_path(model)
        self.initialize(selected, optimizers)
        if self.opt_level == "O1":
            hand_rnns_their_input(model, self.amp)
        # apex O2/O3 patch the forward of the modules they cast; Lightning calls training_step, not the
        # LightningModule's forward, so when the module itself is selected the batch is cast here instead.
        self._cast_batch = selected == [model] and self.opt_level in ("O2", "O3")
        if self._cast_batch:
            _BATCH_CAST.add(model)

    @override
    def models_wrapped(self) -> None:
        """O2: copy the fp16 model weights, rank 0's since the DDP wrap, into the fp32 masters built at
        ``amp.initialize`` from this rank's own: apex builds them at the first backward, after the wrap, so a rank that
        started from other weights trains rank 0's. Masters restored from a checkpoint are kept."""
        if self._masters_restored:
            return
        for model_param, master in self.master_weight_pairs():
            master.data.copy_(model_param.data)

    @override
    def evaluate(self, model: Module) -> None:
        """A model amp.initialize cast keeps its input casts, in any Trainer of this process; another model (every
        model, in a fresh process) runs as built.

        O1's patches of torch stay for the rest of the process, as in apex: every model evaluated after an O1 fit runs
        under them, as the recipe's evaluation did.
        """
        self._cast_batch = model in _BATCH_CAST
        if self.opt_level == "O1" and self.initialized:
            keep_attention_off_the_fast_path(model)
            hand_rnns_their_input(model, self.amp)

    @override
    def convert_input(self, data: Any) -> Any:
        return cast_floats(data, torch.float16) if self._cast_batch else data

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
        initialized = [getattr(optimizer, "optimizer", optimizer) for optimizer in optimizers]
        with self.amp.scale_loss(loss, initialized, loss_id=loss_id, delay_unscale=delay_unscale) as scaled:
            run_backward(scaled)

    @override
    def step(self, optimizer: Optimizer, **kwargs: Any) -> tuple[Any, bool]:
        """``optimizer.step()``, which after an overflow apex has replaced with a skip for this one call.

        apex keeps no public record of the skip; its own flag for it is ``_amp_stash.already_patched``.
        """
        skipped = bool(getattr(getattr(optimizer, "_amp_stash", None), "already_patched", False))
        return optimizer.step(**kwargs), skipped

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        """``amp.master_params(optimizer)``: the fp32 parameters clipping must see."""
        params: Iterator[Tensor] = self.amp.master_params(optimizer)
        return params

    @override
    def state_dict(self) -> dict[str, Any]:
        """The loss scalers, and under O2 the fp32 master weights."""
        state: dict[str, Any] = {"loss_scalers": self.loss_scalers()}
        if self.keeps_master_weights:
            state["master_weights"] = self.master_weight_values()
        return state

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loss scale(s), and O2's fp32 master weights, after ``amp.initialize`` as apex requires."""
        self.load_loss_scalers(state["loss_scalers"])
        if "master_weights" in state:
            self.load_master_weights(state["master_weights"])

    @override
    def current_loss_scale(self) -> float | None:
        scalers = self.loss_scalers()
        return float(scalers[0]["loss_scale"]) if scalers else None

    def loss_scalers(self) -> list[dict[str, float]]:
        """``amp.state_dict()`` as a list: ``loss_scale`` and ``unskipped`` of each loss's scaler."""
        if not self.initialized:
            return list(self._pending_loss_scalers or [])
        state = self.amp.state_dict()
        return [dict(state[key]) for key in sorted(state, key=lambda k: int(k.removeprefix("loss_scaler")))]

    def load_loss_scalers(self, scalers: list[dict[str, float]]) -> None:
        """``amp.load_state_dict``, which apex allows only after ``amp.initialize``: until then it waits."""
        if not self.initialized:
            self._pending_loss_scalers = list(scalers)
            return
        self.amp.load_state_dict({f"loss_scaler{index}": dict(state) for index, state in enumerate(scalers)})
        self._pending_loss_scalers = None

    def master_weight_values(self) -> list[Tensor]:
        """The fp32 master weights of every optimizer, in order; empty where apex keeps none.

        apex's own checkpoints leave them out: a resume rebuilds them from the fp16 model weights, and so loses
        every bit below fp16's precision. Saving them makes an O2 resume continue exactly.
        """
        if not self.initialized or not self.keeps_master_weights:
            return list(self._pending_master_weights or [])
        return [param.detach() for optimizer in self._optimizers for param in self.main_params(optimizer)]

    @override
    def master_weight_pairs(self) -> list[tuple[Tensor, Tensor]]:
        """apex O2's fp16 model parameters beside their fp32 masters, from each optimizer's ``_amp_stash``."""
        if not self.initialized or not self.keeps_master_weights:
            return []
        pairs: list[tuple[Tensor, Tensor]] = []
        for optimizer in self._optimizers:
            stash = getattr(optimizer, "_amp_stash", None)
            groups = zip(getattr(stash, "fp16_groups", []), getattr(stash, "fp32_from_fp16_groups", []), strict=True)
            for models, masters in groups:
                pairs += zip(models, masters, strict=True)
        return pairs

    def load_master_weights(self, saved: list[Tensor]) -> None:
        """Copy saved fp32 master weights into apex's, after ``amp.initialize`` built them (until then it waits).

        Raises:
            PrecisionConfigurationError: the checkpoint's master weights do not fit this model.
        """
        if not self.initialized:
            self._pending_master_weights = list(saved)
            return
        self._pending_master_weights = None
        if not self.keeps_master_weights:
            return
        masters = [param for optimizer in self._optimizers for param in self.main_params(optimizer)]
        shapes = [tuple(t.shape) for t in saved]
        if shapes != [tuple(m.shape) for m in masters]:
            raise PrecisionConfigurationError(
                "checkpoint",
                f"{len(saved)} master weights",
                f"they do not fit this model's {len(masters)} apex O2 master weights (shapes {shapes[:3]}...)",
                "resume from a checkpoint of this model and optimizer, or start without ckpt_path",
            )
        for master, value in zip(masters, saved, strict=True):
            master.data.copy_(value)
        self._masters_restored = True


def _is_ddp_wrapper(model: Module) -> bool:
    """Whether ``model`` is torch's DistributedDataParallel or apex's: wrapped before ``amp.initialize``."""
    return isinstance(model, DistributedDataParallel) or type(model).__qualname__ == "DistributedDataParallel"
