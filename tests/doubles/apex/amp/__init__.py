"""TEST DOUBLE of ``apex.amp`` (see tests/doubles/README.md): apex's documented contract, on the CPU, no casting."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

#: Real apex has no such flag: it tells lightning_ddp_amp that this amp runs without CUDA.
supports_cpu = True

#: What the double was asked to do, in order, for tests to inspect.
events: list[dict[str, Any]] = []

_OPT_LEVELS = {
    # opt_level: (default loss scale, master weights)
    "O0": (1.0, False),
    "O1": ("dynamic", False),
    "O2": ("dynamic", True),
    "O3": (1.0, False),
}


class _LossScaler:
    def __init__(self, loss_scale: Any, min_loss_scale: float | None, max_loss_scale: float) -> None:
        self.dynamic = loss_scale == "dynamic"
        self.loss_scale = min(max_loss_scale, 2.0**16) if self.dynamic else float(loss_scale)
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.unskipped = 0
        self.scale_window = 2000


class _State:
    initialized = False
    opt_level: str | None = None
    master_weights = False
    loss_scalers: ClassVar[list[_LossScaler]] = []
    inside_scale_loss = False
    backward_outside_scale_loss = 0


_state = _State()


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

    default_scale, default_master = _OPT_LEVELS[opt_level]
    _state.initialized = True
    _state.opt_level = opt_level
    _state.master_weights = default_master if master_weights is None else bool(master_weights)
    scale = default_scale if loss_scale is None else loss_scale
    _state.loss_scalers = [_LossScaler(scale, min_loss_scale, max_loss_scale) for _ in range(num_losses)]
    for optimizer in optimizers_list:
        _process_optimizer(optimizer)
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


def _process_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    optimizer._amp_stash = {"params_have_scaled_gradients": False, "skip_next_step": False}  # type: ignore[attr-defined]
    original_step = optimizer.step
    original_zero_grad = optimizer.zero_grad

    if _state.master_weights:
        # apex O2 replaces step and zero_grad with versions that take no closure / no arguments.
        def step(self: torch.optim.Optimizer) -> Any:
            if self._amp_stash["skip_next_step"]:  # type: ignore[attr-defined]
                return _skip(self)
            return original_step()

        def zero_grad(self: torch.optim.Optimizer) -> None:
            original_zero_grad()

        optimizer.zero_grad = zero_grad.__get__(optimizer)  # type: ignore[method-assign]
    else:

        def step(self: torch.optim.Optimizer, closure: Any = None) -> Any:  # type: ignore[misc]
            if self._amp_stash["skip_next_step"]:  # type: ignore[attr-defined]
                return _skip(self, closure)
            return original_step(closure) if closure is not None else original_step()

    optimizer.step = step.__get__(optimizer)  # type: ignore[method-assign]


def _skip(optimizer: torch.optim.Optimizer, closure: Any = None) -> None:
    if closure is not None:
        raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
    optimizer._amp_stash["skip_next_step"] = False  # type: ignore[attr-defined]
    events.append({"event": "skipped_step"})


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


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
    events.append({"event": "scale_loss", "loss_id": loss_id, "delay_unscale": delay_unscale, "scale": scale})
    _state.inside_scale_loss = True
    try:
        yield loss.float() * scale
    finally:
        _state.inside_scale_loss = False
    if delay_unscale:
        for optimizer in optimizers:
            optimizer._amp_stash["params_have_scaled_gradients"] = True
        return
    grads = [p.grad for o in optimizers for p in master_params(o) if p.grad is not None]
    overflow = any(not torch.isfinite(g).all() for g in grads)
    for optimizer in optimizers:
        optimizer._amp_stash["params_have_scaled_gradients"] = False
    if overflow and scaler.dynamic:
        floor = scaler.min_loss_scale or 0.0
        scaler.loss_scale = max(floor, scaler.loss_scale / 2.0)
        scaler.unskipped = 0
        for optimizer in optimizers:
            optimizer._amp_stash["skip_next_step"] = True
        events.append({"event": "overflow", "loss_id": loss_id, "new_scale": scaler.loss_scale})
        return
    for grad in grads:
        grad.div_(scale)
    scaler.unskipped += 1
    if scaler.dynamic and scaler.unskipped == scaler.scale_window:
        scaler.loss_scale = min(scaler.max_loss_scale, scaler.loss_scale * 2.0)
        scaler.unskipped = 0


def state_dict(destination: Any = None) -> OrderedDict[str, dict[str, float]]:
    destination = OrderedDict() if destination is None else destination
    for index, scaler in enumerate(_state.loss_scalers):
        destination[f"loss_scaler{index}"] = {"loss_scale": scaler.loss_scale, "unskipped": scaler.unskipped}
    return destination


def load_state_dict(state_dict: dict[str, dict[str, float]]) -> None:
    if not _state.initialized:
        raise RuntimeError("amp.load_state_dict was called before amp.initialize (apex requires initialize first).")
    for index, scaler in enumerate(_state.loss_scalers):
        saved = state_dict[f"loss_scaler{index}"]
        scaler.loss_scale = saved["loss_scale"]
        scaler.unskipped = int(saved["unskipped"])
    events.append({"event": "load_state_dict", "state": {k: dict(v) for k, v in state_dict.items()}})


def backward_outside_scale_loss() -> int:
    """How many parameter gradients were computed outside ``scale_loss`` since ``initialize``."""
    return _state.backward_outside_scale_loss
