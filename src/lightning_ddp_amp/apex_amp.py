"""NVIDIA apex amp as a backend of :class:`~lightning_ddp_amp.AmpPrecision`.

``apex.amp`` exists only in NVIDIA apex releases up to 25.05 (it was removed in May 2025), built from source with
its CUDA extensions. The package called ``apex`` on PyPI is an unrelated web toolkit. This module finds apex, says
precisely why it cannot be used when it cannot, and makes the calls the recipe made::

    models, optimizer = amp.initialize(models, optimizer, opt_level="O1")   # before DDP
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NoReturn

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_ddp_amp.errors import ApexUnavailableError, PrecisionConfigurationError

# The amp modules initialized so far in this process: apex documents one amp.initialize per process.
_INITIALIZED: weakref.WeakSet[ModuleType] = weakref.WeakSet()
_OVERRIDDEN_STEP_WARNING = r"Seems like `optimizer\.step\(\)` has been overridden after learning rate scheduler"

NATIVE_ALTERNATIVES = 'use the native backend instead: precision="amp-O1" (same O-levels) or precision="16-mixed"'
_INSTALL = (
    "build NVIDIA apex 25.05 or older from source with its CUDA extensions (pip install -v --no-build-isolation"
    ' --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext"'
    " git+https://github.com/NVIDIA/apex.git@25.05), or " + NATIVE_ALTERNATIVES
)


def find_amp() -> ModuleType | None:
    """``apex.amp`` if it can be imported, else None. Never raises."""
    try:
        return load_apex_module("apex.amp", "backend", "apex")
    except ApexUnavailableError:
        return None


def load_apex_module(name: str, field: str, value: Any) -> ModuleType:
    """Import ``apex.amp`` or ``apex.parallel``, or explain why it cannot be imported.

    Args:
        name: ``"apex.amp"`` or ``"apex.parallel"``.
        field: The setting that asked for apex, for the message (``"backend"``, ``"precision"``, ``"ddp_impl"``).
        value: Its value.

    Raises:
        ApexUnavailableError: apex is not installed, lacks the module, or the module fails to import.
    """
    if importlib.util.find_spec("apex") is None:
        raise ApexUnavailableError(
            field,
            value,
            f"NVIDIA apex is not installed. {name} exists only in NVIDIA apex releases up to 25.05 (it was"
            " removed from apex in May 2025), built from source; it is not on PyPI",
            _INSTALL,
        )
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name not in (name, "apex"):
            _broken(name, field, value, error)
        raise ApexUnavailableError(
            field,
            value,
            f"the installed apex ({_apex_version()}) has no {name}: NVIDIA removed it after release 25.05, and"
            " the 'apex' package on PyPI is an unrelated web toolkit",
            _INSTALL,
        ) from None
    except Exception as error:  # apex imports its compiled extensions: any failure there lands here
        _broken(name, field, value, error)


def _broken(name: str, field: str, value: Any, error: Exception) -> NoReturn:
    raise ApexUnavailableError(
        field,
        value,
        f"{name} fails to import ({error}); apex's compiled extensions were probably built for another torch or CUDA",
        "rebuild apex from source against the installed torch, or " + NATIVE_ALTERNATIVES,
    ) from error


def _apex_version() -> str:
    try:
        return "apex " + importlib.metadata.version("apex")
    except importlib.metadata.PackageNotFoundError:
        return "apex, version unknown"


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


class ApexAmp:
    """The apex calls :class:`~lightning_ddp_amp.AmpPrecision` makes.

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
        self._optimizers: list[Optimizer] = []

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
                "apex amp was already initialized in this process by an earlier fit, and apex supports one"
                " amp.initialize per process",
                'start each fit in a new process (resume from the last checkpoint), or use backend="native"',
            )
        self.amp.initialize(list(modules), list(optimizers), opt_level=self.opt_level, **self.options)
        _INITIALIZED.add(self.amp)
        self._optimizers = list(optimizers)
        for optimizer in optimizers:
            # apex builds O2's fp32 master weights lazily, at the first backward. Build them now, so that an
            # optimizer state restored from a checkpoint is cast to the fp32 masters, not to the fp16 params.
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

    def backward(
        self,
        loss: Tensor,
        optimizers: Sequence[Optimizer],
        run_backward: Callable[[Tensor], None],
        loss_id: int,
        delay_unscale: bool,
    ) -> None:
        """Run ``run_backward`` on the scaled loss inside ``amp.scale_loss``."""
        with self.amp.scale_loss(loss, list(optimizers), loss_id=loss_id, delay_unscale=delay_unscale) as scaled:
            run_backward(scaled)

    @staticmethod
    def step_will_be_skipped(optimizer: Optimizer) -> bool:
        """Whether apex found an overflow and replaced this optimizer's next ``step()`` with a skip.

        apex keeps no public record of it; its own flag for the one-call skip is ``_amp_stash.already_patched``.
        """
        return bool(getattr(getattr(optimizer, "_amp_stash", None), "already_patched", False))

    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        """``amp.master_params(optimizer)``: the fp32 parameters clipping must see."""
        params: Iterator[Tensor] = self.amp.master_params(optimizer)
        return params

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

    @property
    def keeps_master_weights(self) -> bool:
        """Whether apex steps fp32 master copies of fp16 weights (O2)."""
        return self.opt_level == "O2"

    def master_weights(self) -> list[Tensor]:
        """The fp32 master weights of every optimizer, in order; empty where apex keeps none.

        apex's own checkpoints leave them out: a resume rebuilds them from the fp16 model weights, and so loses
        every bit below fp16's precision. Saving them makes an O2 resume continue exactly.
        """
        if not self.initialized or not self.keeps_master_weights:
            return list(self._pending_master_weights or [])
        return [param.detach() for optimizer in self._optimizers for param in self.main_params(optimizer)]

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

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Nothing to enter: apex patched torch or the models in ``amp.initialize``."""
        # O1 patches torch functions globally and O2/O3 patch the models' forward: nothing to enter here.
        yield
