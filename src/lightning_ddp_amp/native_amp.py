"""torch.amp as a backend of :class:`~lightning_ddp_amp.AmpPrecision`: apex's O-levels in native terms.

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
O3        whole model in fp16, loss scale 1                     model and floating inputs cast to ``dtype``
                                                                (Lightning's ``"16-true"``), no loss scaling
========  ===================================================  ================================================

``dtype="bfloat16"`` runs the same levels in bfloat16, which needs no loss scaling. On the CPU, autocast and
``GradScaler`` work as on CUDA (torch ≥ 2.3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

#: What each level means natively, as printed when "amp-O*" falls back to this backend.
LEVELS = {
    "O0": "fp32, no autocast, no loss scaling",
    "O1": "torch.autocast({dtype}) with dynamic loss scaling",
    "O2": "torch.autocast({dtype}) with dynamic loss scaling; weights stay fp32 as O2's master weights",
    "O3": "model and inputs cast to {dtype}, no loss scaling",
}

# A loss scale the user fixed never grows: GradScaler has no static mode, so growth is pushed out of reach.
_NEVER = 2**31 - 1


def lightning_precision(opt_level: str, dtype: torch.dtype) -> str:
    """The Lightning precision label for a level (what ``trainer.precision`` reports)."""
    prefix = "bf16" if dtype == torch.bfloat16 else "16"
    return {"O0": "32-true", "O1": f"{prefix}-mixed", "O2": f"{prefix}-mixed", "O3": f"{prefix}-true"}[opt_level]


class NativeAmp:
    """The torch.amp calls :class:`~lightning_ddp_amp.AmpPrecision` makes.

    Args:
        opt_level: ``"O0"`` … ``"O3"``.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        device_type: Where autocast and the scaler run: ``"cuda"``, ``"cpu"``, ...
        loss_scale: ``"dynamic"``, a fixed scale, or None for the level's default.
        min_loss_scale: Floor of the scale, or None.
        max_loss_scale: Ceiling of the scale.
    """

    def __init__(
        self,
        opt_level: str,
        dtype: torch.dtype,
        device_type: str,
        loss_scale: float | str | None,
        min_loss_scale: float | None,
        max_loss_scale: float,
    ) -> None:
        self.dtype = dtype
        self.device_type = device_type
        self.autocast = opt_level in ("O1", "O2")
        self.cast_model = opt_level == "O3"
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.scaler: torch.amp.GradScaler | None = None
        if self.autocast and dtype == torch.float16:
            if loss_scale is None or loss_scale == "dynamic":
                self.scaler = torch.amp.GradScaler(device_type, init_scale=min(max_loss_scale, 2.0**16))
            else:
                # A fixed scale: it never grows, and an overflowing step is skipped and the scale restored.
                self.min_loss_scale = float(loss_scale)
                self.scaler = torch.amp.GradScaler(device_type, init_scale=float(loss_scale), growth_interval=_NEVER)

    def convert_module(self, module: Module) -> Module:
        return module.to(dtype=self.dtype) if self.cast_model else module

    def convert_input(self, data: Any) -> Any:
        if not self.cast_model:
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        if not self.autocast:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def backward(self, loss: Tensor, run_backward: Callable[[Tensor], None]) -> None:
        run_backward(self.scaler.scale(loss) if self.scaler is not None else loss)

    def unscale(self, optimizer: Optimizer) -> None:
        """Unscale the gradients before hooks and clipping see them."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> tuple[Any, bool]:
        """Step through the scaler, which skips a step whose gradients overflowed.

        Returns:
            The optimizer's return value and whether the step was skipped.
        """
        if self.scaler is None:
            return optimizer.step(**kwargs), False
        before = self.scaler.get_scale()
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        # The scaler backs off (halves) exactly when it skipped the step.
        skipped = self.scaler.get_scale() < before
        self._clamp()
        return result, skipped

    def _clamp(self) -> None:
        assert self.scaler is not None
        scale = self.scaler.get_scale()
        if self.min_loss_scale is not None and scale < self.min_loss_scale:
            self.scaler.update(new_scale=self.min_loss_scale)
        elif scale > self.max_loss_scale:
            self.scaler.update(new_scale=self.max_loss_scale)

    def loss_scalers(self) -> list[dict[str, float]]:
        """The scaler's state in apex's terms (``loss_scale``, ``unskipped``), to move between backends."""
        if self.scaler is None:
            return []
        state = self.scaler.state_dict()
        return [{"loss_scale": float(state["scale"]), "unskipped": int(state["_growth_tracker"])}]

    def load_loss_scalers(self, scalers: list[dict[str, float]]) -> None:
        if self.scaler is None or not scalers:
            return
        state = self.scaler.state_dict()
        state.update(scale=float(scalers[0]["loss_scale"]), _growth_tracker=int(scalers[0]["unskipped"]))
        self.scaler.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
