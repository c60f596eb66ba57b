"""TEST DOUBLE of ``apex/amp/handle.py``: ``scale_loss``, ``disable_casts`` and the O1 handle (cast cache, saved
functions). apex's old ``AmpHandle.scale_loss`` API and ``NoOpHandle`` are not modelled."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import double_extras, wrap
from ._amp_state import _amp_state, maybe_print
from .scaler import LossScaler


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """handle.py ``scale_loss``: yield ``loss.float() * scale``; on exit unscale into the (master) gradients, and
    after an overflow halve the scale and make the next ``optimizer.step()`` a one-call skip.

    Before the backward, each optimizer stashes the gradients already there (``_prepare_amp_backward``), unless
    they still hold scaled gradients from a ``delay_unscale`` backward. A static scale of 1 without master weights
    takes apex's short cut: nothing is stashed, unscaled or checked.
    """
    if not hasattr(_amp_state, "opt_properties"):
        raise RuntimeError(
            "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  model, optimizer ="
            " amp.initialize(model, optimizer, opt_level=...) must be called before `with amp.scale_loss`."
        )
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    loss_scaler: LossScaler = _amp_state.loss_scalers[loss_id]
    loss_scale = loss_scaler.loss_scale()
    double_extras.record(
        "scale_loss", loss_id=loss_id, delay_unscale=delay_unscale, scale=loss_scale, optimizers=len(optimizers)
    )

    if not _amp_state.opt_properties.master_weights and not loss_scaler.dynamic and loss_scale == 1.0:
        with double_extras.inside_scale_loss():
            yield loss.float()
        if _amp_state.opt_properties.patch_torch_functions:
            _amp_state.handle._clear_cache()
        return

    # As in apex, only a list of optimizers is prepared: a tuple goes through unstashed.
    if not delay_unscale and isinstance(optimizers, list):
        for optimizer in optimizers:
            if not optimizer._amp_stash.params_have_scaled_gradients:
                optimizer._prepare_amp_backward()

    with double_extras.inside_scale_loss():
        yield loss.float() * loss_scale

    if delay_unscale:
        for optimizer in optimizers:
            optimizer._amp_stash.params_have_scaled_gradients = True
    else:
        loss_scaler.clear_overflow_state()
        for optimizer in optimizers:
            optimizer._post_amp_backward(loss_scaler)
            optimizer._amp_stash.params_have_scaled_gradients = False
        should_skip = False if delay_overflow_check else loss_scaler.update_scale()
        if should_skip:
            double_extras.record("overflow", loss_id=loss_id, new_scale=loss_scaler.loss_scale())
            for optimizer in optimizers:
                if not optimizer._amp_stash.already_patched:
                    optimizer.step = _skip_next_step(optimizer, loss_scaler, loss_id)
                    optimizer._amp_stash.already_patched = True

    if _amp_state.opt_properties.patch_torch_functions:
        _amp_state.handle._clear_cache()


def _skip_next_step(optimizer: Any, loss_scaler: LossScaler, loss_id: int) -> Callable[..., None]:
    """handle.py's ``skip_step``: replaces ``optimizer.step`` for one call, clears O2's master gradients and puts
    the real ``step`` back."""
    real_step = optimizer.step

    def skip_step(closure: Any = None) -> None:
        if closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        maybe_print(
            f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to"
            f" {loss_scaler.loss_scale()}"
        )
        double_extras.record("skipped_step", loss_id=loss_id)
        if hasattr(optimizer._amp_stash, "all_fp32_from_fp16_params"):
            for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                param.grad = None
        optimizer.step = real_step
        optimizer._amp_stash.already_patched = False

    return skip_step


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """handle.py ``disable_casts``: O1's wrappers pass calls through unchanged (apex restores them without a
    ``finally``, so an exception inside leaves casts disabled, as here)."""
    _amp_state.handle._is_active = False
    yield
    _amp_state.handle._is_active = True


class AmpHandle:
    """handle.py ``AmpHandle``: whether O1's casts are active, the cache of cast weights, the patched functions."""

    def __init__(self, enable_caching: bool = True, verbose: bool = False) -> None:
        self._enable_caching = enable_caching
        self._verbose = verbose
        self._cache: dict[torch.Tensor, torch.Tensor] = {}
        self._is_active = True
        self._all_wrappers: list[tuple[Any, str, Any]] = []

    def is_active(self) -> bool:
        return self._is_active

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        self._is_active = False
        yield
        self._is_active = True

    def _clear_cache(self) -> None:
        self._cache.clear()

    def _save_func(self, mod: Any, fn: str, func: Any) -> None:
        self._all_wrappers.append((mod, fn, func))

    def _deactivate(self) -> None:
        """apex's experimental restore of the functions this handle patched (in the order they were patched)."""
        for mod, fn, func in self._all_wrappers:
            wrap.set_func(mod, fn, func)
        self._all_wrappers = []

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def cache(self) -> dict[torch.Tensor, torch.Tensor]:
        return self._cache

    def remove_cache(self, param: torch.Tensor) -> None:
        if self.has_cache and param in self.cache:
            del self.cache[param]

    @property
    def verbose(self) -> bool:
        return self._verbose
