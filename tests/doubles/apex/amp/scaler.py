"""TEST DOUBLE of ``apex/amp/scaler.py``: the loss scaler, as apex's Python fallback runs it (no ``amp_C`` kernels).

Overflow is apex's test: the sum of an incoming gradient, in fp32, is inf or NaN. Unscaling multiplies by
``1/scale``; a dynamic scaler stops unscaling at the first overflow, a static one never checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._amp_state import maybe_print


def _overflows(model_grad: torch.Tensor) -> bool:
    """scaler.py: the test inlined in ``scale_check_overflow_python`` and ``axpby_check_overflow_python``."""
    total = float(model_grad.float().sum())
    return total in (float("inf"), -float("inf")) or total != total


def scale_check_overflow_python(
    model_grad: torch.Tensor, master_grad: torch.Tensor, scale: float, check_overflow: bool = False
) -> bool:
    """scaler.py ``scale_check_overflow_python``: check, then ``master = model * scale``; True on overflow."""
    if check_overflow and _overflows(model_grad):
        return True
    if master_grad is not model_grad:
        master_grad.copy_(model_grad)
    if scale != 1.0:
        master_grad.mul_(scale)
    return False


def axpby_check_overflow_python(
    model_grad: torch.Tensor,
    stashed_grad: torch.Tensor,
    master_grad: torch.Tensor,
    a: float,
    b: float,
    check_overflow: bool = False,
) -> bool:
    """scaler.py ``axpby_check_overflow_python``: check, then ``master.data = a * model + b * stashed``."""
    if check_overflow and _overflows(model_grad):
        return True
    assert stashed_grad.dtype == master_grad.dtype
    master_grad.data = a * model_grad.data.to(master_grad.dtype) + b * stashed_grad.data
    return False


class LossScaler:
    """scaler.py ``LossScaler``: a static scale, or a dynamic one that starts at ``min(max_loss_scale, 2**16)``,
    halves on overflow (floored by ``min_loss_scale``) and doubles after ``scale_window`` clean steps (capped by
    ``max_loss_scale``)."""

    warned_unscaling_non_fp32_grad = False

    def __init__(
        self,
        loss_scale: Any,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> None:
        self.dynamic = loss_scale == "dynamic"
        self._loss_scale = min(max_loss_scale, init_scale) if self.dynamic else loss_scale
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0
        self._has_overflow = False

    def loss_scale(self) -> Any:
        """scaler.py ``LossScaler.loss_scale``."""
        return self._loss_scale

    def _warn_if_not_fp32(self, master: torch.Tensor) -> None:
        """scaler.py: the one-time warning inlined in ``unscale_python`` and ``unscale_with_stashed_python``."""
        if not LossScaler.warned_unscaling_non_fp32_grad and master.dtype != torch.float32:
            maybe_print(
                f"Attempting to unscale a grad with type {master.type()} Unscaling non-fp32 grads may indicate an"
                " error. When using Amp, you don't need to call .half() on your model."
            )
            LossScaler.warned_unscaling_non_fp32_grad = True

    def unscale_python(self, model_grads: Sequence[Any], master_grads: Sequence[Any], scale: float) -> None:
        """scaler.py ``LossScaler.unscale_python``: ``master = model / scale``, stopping at a (dynamic) overflow."""
        for model, master in zip(model_grads, master_grads):  # noqa: B905  (as apex)
            if model is None:
                continue
            self._warn_if_not_fp32(master)
            self._has_overflow = scale_check_overflow_python(model, master, 1.0 / scale, self.dynamic)
            if self._has_overflow and self.dynamic:
                break

    def unscale(
        self,
        model_grads: Sequence[Any],
        master_grads: Sequence[Any],
        unused_scale: Any,
        models_are_masters: bool = False,
        scale_override: float | None = None,
    ) -> None:
        """scaler.py ``unscale``: nothing after an overflow, nor for a static scale of 1 on models that are masters."""
        if self._has_overflow:
            return
        scale = self._loss_scale if scale_override is None else scale_override
        if scale == 1.0 and models_are_masters and not self.dynamic:
            return
        self.unscale_python(model_grads, master_grads, scale)

    def unscale_with_stashed(
        self,
        model_grads: Sequence[torch.Tensor],
        stashed_master_grads: Sequence[torch.Tensor],
        master_grads: Sequence[torch.Tensor],
        scale_override: tuple[float, float, float] | None = None,
    ) -> None:
        """scaler.py ``unscale_with_stashed`` with ``unscale_with_stashed_python``:
        ``master = model * out/grads_scale + stashed * out/stashed_scale``."""
        if self._has_overflow:
            return
        grads_have_scale, stashed_have_scale, out_scale = (
            (self._loss_scale, 1.0, 1.0) if scale_override is None else scale_override
        )
        a, b = out_scale / grads_have_scale, out_scale / stashed_have_scale
        for model, stashed, master in zip(model_grads, stashed_master_grads, master_grads):  # noqa: B905
            if model is None and stashed is None:
                continue
            self._warn_if_not_fp32(master)
            self._has_overflow = axpby_check_overflow_python(model, stashed, master, a, b, self.dynamic)
            if self._has_overflow and self.dynamic:
                break

    def clear_overflow_state(self) -> None:
        """scaler.py ``LossScaler.clear_overflow_state``."""
        self._has_overflow = False

    def update_scale(self) -> bool:
        """scaler.py ``update_scale``: after an overflow (dynamic only) halve the scale and return True (skip)."""
        if self._has_overflow and self.dynamic:
            should_skip = True
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / 2.0)
            else:
                self._loss_scale = self._loss_scale / 2.0
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0
        return should_skip
