"""TEST DOUBLE of ``apex.amp`` (see tests/doubles/README.md): apex's documented contract, on the CPU, no casting.

Its control flow follows apex 25.05 (``handle.scale_loss``, ``_process_optimizer``, ``scaler.LossScaler``,
``frontend.state_dict``): gradient stashing around each backward, the short cut for a static scale of 1,
``delay_unscale``, the one-call ``skip_step`` after an overflow, and the patched ``step`` / ``zero_grad``.
"""

from __future__ import annotations

import contextlib
import types
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

#: Real apex has no such flag: it tells lightning_ddp_amp that this amp runs without CUDA.
supports_cpu = True

#: What the double was asked to do, in order, for tests to inspect.
events: list[dict[str, Any]] = []

_OPT_LEVELS = {
    # opt_level: (default loss scale, master weights, patch_torch_functions)
    "O0": (1.0, False, False),
    "O1": ("dynamic", False, True),
    "O2": ("dynamic", True, False),
    "O3": (1.0, False, False),
}


class _LossScaler:
    def __init__(self, loss_scale: Any, min_loss_scale: float | None, max_loss_scale: float) -> None:
        self.dynamic = loss_scale == "dynamic"
        self.loss_scale = min(max_loss_scale, 2.0**16) if self.dynamic else float(loss_scale)
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.unskipped = 0
        self.scale_window = 2000
        self.has_overflow = False

    def update_scale(self) -> bool:
        if self.has_overflow and self.dynamic:
            self.loss_scale = max(self.min_loss_scale or 0.0, self.loss_scale / 2.0)
            self.unskipped = 0
            return True
        self.unskipped += 1
        if self.unskipped == self.scale_window and self.dynamic:
            self.loss_scale = min(self.max_loss_scale, self.loss_scale * 2.0)
            self.unskipped = 0
        return False


class _State:
    initialized = False
    master_weights = False
    loss_scalers: ClassVar[list[_LossScaler]] = []
    inside_scale_loss = False
    backward_outside_scale_loss = 0


_state = _State()


class AmpOptimizerState:
    """apex's ``optimizer._amp_stash``."""

    def __init__(self) -> None:
        self.lazy_init_called = False
        self.already_patched = False
        self.params_have_scaled_gradients = False
        self.grad_stash: list[torch.Tensor | None] = []


def _is_data_parallel(model: torch.nn.Module) -> bool:
    from apex.parallel import DistributedDataParallel as ApexDDP

    return isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel, ApexDDP))


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> Any:
    if _state.initialized:
        raise RuntimeError("amp.initialize should only be called once (apex documents this).")
    if opt_level not in _OPT_LEVELS:
        raise RuntimeError(f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'.")
    models_list = models if isinstance(models, list) else [models]
    if not all(isinstance(m, torch.nn.Module) for m in models_list):
        raise TypeError("models must be either a single model or a list of models.")
    for model in models_list:
        if _is_data_parallel(model):
            raise RuntimeError(
                f"Incoming model is an instance of {type(model).__name__}. Parallel wrappers should only be"
                " applied to the model(s) AFTER the model(s) have been returned from amp.initialize."
            )
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers_list = [optimizers]
    elif optimizers is None:
        optimizers_list = []
    elif isinstance(optimizers, list) and all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        optimizers_list = optimizers
    else:
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers.")

    default_scale, default_master, patch_functions = _OPT_LEVELS[opt_level]
    _state.initialized = True
    _state.master_weights = default_master if master_weights is None else bool(master_weights)
    scale = default_scale if loss_scale is None else loss_scale
    _state.loss_scalers = [_LossScaler(scale, min_loss_scale, max_loss_scale) for _ in range(num_losses)]
    for optimizer in optimizers_list:
        _process_optimizer(optimizer, patch_functions)
    for model in models_list:
        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(_check_inside_scale_loss)
    events.append(
        {
            "event": "initialize",
            "models": [type(m).__name__ for m in models_list],
            "optimizers": [type(o).__name__ for o in optimizers_list],
            "opt_level": opt_level,
            "loss_scale": scale,
            "num_losses": num_losses,
            "keep_batchnorm_fp32": keep_batchnorm_fp32,
            "cast_model_outputs": str(cast_model_outputs) if cast_model_outputs is not None else None,
            "min_loss_scale": min_loss_scale,
            "max_loss_scale": max_loss_scale,
            "params_on": sorted({p.device.type for m in models_list for p in m.parameters()}),
        }
    )
    return models, optimizers


def _check_inside_scale_loss(grad: torch.Tensor) -> torch.Tensor:
    if not _state.inside_scale_loss:
        _state.backward_outside_scale_loss += 1
    return grad


def _process_optimizer(optimizer: torch.optim.Optimizer, patch_functions: bool) -> None:
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    optimizer._amp_stash = AmpOptimizerState()  # type: ignore[attr-defined]

    def _amp_lazy_init(self: torch.optim.Optimizer) -> None:
        if not self._amp_stash.lazy_init_called:  # type: ignore[attr-defined]
            self._amp_stash.lazy_init_called = True  # type: ignore[attr-defined]
            events.append({"event": "lazy_init"})

    optimizer._amp_lazy_init = types.MethodType(_amp_lazy_init, optimizer)  # type: ignore[attr-defined]

    if _state.master_weights:
        old_step, old_zero_grad = optimizer.step, optimizer.zero_grad

        def new_step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
            if closure is not None:
                raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
            return old_step()

        def new_zero_grad(self: torch.optim.Optimizer) -> None:
            self._amp_lazy_init()  # type: ignore[attr-defined]
            old_zero_grad()

        optimizer.step = types.MethodType(new_step, optimizer)  # type: ignore[method-assign]
        optimizer.zero_grad = types.MethodType(new_zero_grad, optimizer)  # type: ignore[method-assign]
    elif patch_functions:
        # O1 wraps step to disable its casts while stepping.
        old_step = optimizer.step

        def patched_step(*args: Any, **kwargs: Any) -> Any:
            return old_step(*args, **kwargs)

        optimizer.step = patched_step  # type: ignore[method-assign]


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _prepare_backward(optimizer: torch.optim.Optimizer) -> None:
    # apex stashes the gradients already there and lets backward write fresh ones.
    optimizer._amp_lazy_init()  # type: ignore[attr-defined]
    params = list(master_params(optimizer))
    optimizer._amp_stash.grad_stash = [p.grad for p in params]  # type: ignore[attr-defined]
    for param in params:
        param.grad = None


def _post_backward(optimizer: torch.optim.Optimizer, scaler: _LossScaler) -> None:
    # Unscale what backward wrote, check it for inf/NaN, then add back the stashed gradients.
    stash = optimizer._amp_stash.grad_stash  # type: ignore[attr-defined]
    params = list(master_params(optimizer))
    if len(stash) != len(params):
        stash = [None] * len(params)
    for param, stashed in zip(params, stash, strict=True):
        if param.grad is None:
            param.grad = stashed
            continue
        if not torch.isfinite(param.grad).all():
            scaler.has_overflow = True
        if scaler.has_overflow:
            continue
        param.grad.div_(scaler.loss_scale)
        if stashed is not None:
            param.grad.add_(stashed)
    optimizer._amp_stash.grad_stash = []  # type: ignore[attr-defined]


def _patch_skip(optimizer: torch.optim.Optimizer, loss_id: int, scaler: _LossScaler) -> None:
    stash = optimizer._amp_stash  # type: ignore[attr-defined]
    if stash.already_patched:
        return
    opt_step = optimizer.step

    def skip_step(closure: Any = None) -> None:
        if closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        events.append({"event": "skipped_step", "loss_id": loss_id})
        optimizer.step = opt_step  # type: ignore[method-assign]
        stash.already_patched = False

    optimizer.step = skip_step  # type: ignore[method-assign]
    stash.already_patched = True


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    if not _state.initialized:
        raise RuntimeError(
            "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  model, optimizer ="
            " amp.initialize(model, optimizer, opt_level=...) must be called before `with amp.scale_loss`."
        )
    optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    for optimizer in optimizers:
        if not hasattr(optimizer, "_amp_stash"):
            raise RuntimeError("scale_loss got an optimizer that did not pass through amp.initialize.")
    scaler = _state.loss_scalers[loss_id]
    scale = scaler.loss_scale
    events.append(
        {
            "event": "scale_loss",
            "loss_id": loss_id,
            "delay_unscale": delay_unscale,
            "scale": scale,
            "optimizers": len(optimizers),
        }
    )
    if not _state.master_weights and not scaler.dynamic and scale == 1.0:
        # apex's short cut: nothing to scale, unscale or check.
        with _inside_scale_loss():
            yield loss.float()
        return
    if not delay_unscale:
        for optimizer in optimizers:
            if not optimizer._amp_stash.params_have_scaled_gradients:
                _prepare_backward(optimizer)
    with _inside_scale_loss():
        yield loss.float() * scale
    if delay_unscale:
        for optimizer in optimizers:
            optimizer._amp_stash.params_have_scaled_gradients = True
        return
    scaler.has_overflow = False
    for optimizer in optimizers:
        _post_backward(optimizer, scaler)
        optimizer._amp_stash.params_have_scaled_gradients = False
    if scaler.update_scale():
        events.append({"event": "overflow", "loss_id": loss_id, "new_scale": scaler.loss_scale})
        for optimizer in optimizers:
            _patch_skip(optimizer, loss_id, scaler)


@contextlib.contextmanager
def _inside_scale_loss() -> Iterator[None]:
    _state.inside_scale_loss = True
    try:
        yield
    finally:
        _state.inside_scale_loss = False


def state_dict(destination: Any = None) -> OrderedDict[str, dict[str, float]]:
    if not _state.initialized:
        # Real apex fails the same way: its state has no loss scalers before initialize.
        raise AttributeError("'AmpState' object has no attribute 'loss_scalers'")
    destination = OrderedDict() if destination is None else destination
    for index, scaler in enumerate(_state.loss_scalers):
        destination[f"loss_scaler{index}"] = {"loss_scale": scaler.loss_scale, "unskipped": scaler.unskipped}
    return destination


def load_state_dict(state_dict: dict[str, dict[str, float]]) -> None:
    if not _state.initialized:
        raise AttributeError("'AmpState' object has no attribute 'loss_scalers' (amp.initialize comes first)")
    unexpected = [key for key in state_dict if "loss_scaler" not in key]
    if unexpected:
        raise RuntimeError(f"Error(s) in loading state_dict. Unexpected key(s) in state_dict: {unexpected}.")
    # Like apex: entries are taken in order, extra ones skipped, missing ones leave their scaler as it is.
    for scaler, saved in zip(_state.loss_scalers, state_dict.values(), strict=False):
        scaler.loss_scale = saved["loss_scale"]
        scaler.unskipped = int(saved["unskipped"])
    events.append({"event": "load_state_dict", "state": {k: dict(v) for k, v in state_dict.items()}})


def backward_outside_scale_loss() -> int:
    """How many parameter gradients were computed outside ``scale_loss`` since ``initialize``."""
    return _state.backward_outside_scale_loss
