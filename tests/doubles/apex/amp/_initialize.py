"""TEST DOUBLE of ``apex/amp/_initialize.py``: what ``amp.initialize`` does to the models and optimizers.

apex's checks for its own FP16_Optimizer classes and LARC are not modelled (the double has neither).
"""

from __future__ import annotations

import collections.abc
import functools
import warnings
from types import MethodType
from typing import Any

import numpy as np
import torch

from ..fp16_utils import convert_network
from ._amp_state import _amp_state, on_amp_device, warn_or_err
from ._process_optimizer import _process_optimizer
from .handle import disable_casts
from .scaler import LossScaler


def to_type(dtype: torch.dtype, t: Any) -> Any:
    """_initialize.py ``to_type``: floating tensors to ``dtype``, warning about a tensor off the amp device."""
    if isinstance(t, torch.Tensor):
        if not on_amp_device(t):
            warnings.warn("An input tensor was not cuda.", stacklevel=1)
        return t.to(dtype) if t.is_floating_point() else t
    return t.to(dtype)


def applier(value: Any, fn: Any) -> Any:
    """_initialize.py ``applier``: ``fn`` on every tensor (or object with ``.to``) inside ``value``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (str, np.ndarray)):
        return value
    if hasattr(value, "to"):
        return fn(value)
    if isinstance(value, collections.abc.Mapping):
        return {applier(k, fn): applier(v, fn) for k, v in value.items()}
    if isinstance(value, collections.abc.Iterable):
        return type(value)(applier(v, fn) for v in value)
    return value


def check_models(models: list[Any]) -> None:
    """_initialize.py ``check_models``: no model may arrive wrapped in torch's data-parallel wrappers.

    apex's branch for its own wrapper is guarded by ``'apex_DDP' in sys.modules``, an import alias that is never a
    module name, so apex 25.05 lets a model wrapped in apex DDP through; so does the double.
    """
    for model in models:
        parallel_type = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            parallel_type = "torch.nn.parallel.DistributedDataParallel"
        if isinstance(model, torch.nn.parallel.DataParallel):
            parallel_type = "torch.nn.parallel.DataParallel"
        if parallel_type is not None:
            raise RuntimeError(
                f"Incoming model is an instance of {parallel_type}. Parallel wrappers should only be applied to the"
                " model(s) AFTER \nthe model(s) have been returned from amp.initialize."
            )


def check_params_fp32(models: list[torch.nn.Module]) -> None:
    """_initialize.py ``check_params_fp32``: floating parameters and buffers must be fp32 on the amp device."""
    for model in models:
        for kind, kinds, named in (
            ("param", "parameters", model.named_parameters()),
            ("buffer", "buffers", model.named_buffers()),
        ):
            for name, tensor in named:
                if not tensor.is_floating_point():
                    continue
                if "Half" in tensor.type():
                    warn_or_err(
                        f"Found {kind} {name} with type {tensor.type()}, expected torch.cuda.FloatTensor.\nWhen"
                        " using amp.initialize, you do not need to call .half() on your model\nbefore passing it,"
                        " no matter what optimization level you choose."
                    )
                elif not on_amp_device(tensor):
                    warn_or_err(
                        f"Found {kind} {name} with type {tensor.type()}, expected torch.cuda.FloatTensor.\nWhen"
                        f" using amp.initialize, you need to provide a model with {kinds}\nlocated on a CUDA device"
                        " before passing it no matter what optimization level\nyou chose. Use model.to('cuda') to"
                        " use the default device."
                    )


class O2StateDictHook:
    """_initialize.py ``O2StateDictHook``: ``state_dict()`` of a cast model holds fp32 tensors, not fp16."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for key in state_dict:
            if "Half" in state_dict[key].type():
                state_dict[key] = state_dict[key].to(torch.float32)


def _patch_forward(model: torch.nn.Module, input_caster: Any, output_caster: Any) -> None:
    """_initialize.py ``_initialize``: its ``patch_forward`` / ``new_fwd`` closures, casting the inputs (when
    ``input_caster`` is given) and the outputs of ``model.forward``."""
    old_forward = model.forward

    def new_forward(*args: Any, **kwargs: Any) -> Any:
        if input_caster is not None:
            args, kwargs = applier(args, input_caster), applier(kwargs, input_caster)
        return applier(old_forward(*args, **kwargs), output_caster)

    model.forward = new_forward


def _patch_step_without_casts(optimizer: torch.optim.Optimizer) -> None:
    """_initialize.py ``_initialize``: O1's ``patch_step`` / ``new_step``, the step under ``disable_casts``."""
    old_step = optimizer.step

    def new_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        with disable_casts():
            return old_step(*args, **kwargs)

    optimizer.step = MethodType(new_step, optimizer)


def _initialize(
    models: Any, optimizers: Any, properties: Any, num_losses: int = 1, cast_model_outputs: Any = None
) -> Any:
    """_initialize.py ``_initialize``: cast the models (O2/O3, and O0 to fp32), patch their forward and
    ``state_dict``, process the optimizers, make one loss scaler per loss, patch torch (O1), and return what was
    given in the shape it was given."""
    from .amp import init as amp_init

    optimizers_was_list = False
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    elif optimizers is None:
        optimizers = []
    elif isinstance(optimizers, list):
        optimizers_was_list = True
    else:
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers.")

    if isinstance(models, torch.nn.Module):
        models_was_list = False
        models = [models]
    elif isinstance(models, list):
        models_was_list = True
    else:
        raise TypeError("models must be either a single model or a list of models.")

    check_models(models)
    if not _amp_state.allow_incoming_model_not_fp32:
        check_params_fp32(models)

    if properties.cast_model_type:
        for model in models:
            if properties.keep_batchnorm_fp32:
                convert_network(model, properties.cast_model_type)
            else:
                model.to(properties.cast_model_type)
        input_caster = functools.partial(to_type, properties.cast_model_type)
        output_type = torch.float32 if cast_model_outputs is None else cast_model_outputs
        output_caster = functools.partial(to_type, output_type)
        for model in models:
            _patch_forward(model, input_caster, output_caster)
        # Per-parameter optimizer state that exists already is recast to the new parameter types.
        for optimizer in optimizers:
            optimizer.load_state_dict(optimizer.state_dict())
        for model in models:
            for module in model.modules():
                module._register_state_dict_hook(O2StateDictHook(functools.partial(to_type, torch.float32)))
    elif cast_model_outputs is not None:
        for model in models:
            _patch_forward(model, None, functools.partial(to_type, cast_model_outputs))

    for i, optimizer in enumerate(optimizers):
        optimizers[i] = _process_optimizer(optimizer, properties)

    _amp_state.loss_scalers = [
        LossScaler(
            properties.loss_scale, min_loss_scale=_amp_state.min_loss_scale, max_loss_scale=_amp_state.max_loss_scale
        )
        for _ in range(num_losses)
    ]

    if properties.patch_torch_functions:
        amp_init(verbose=_amp_state.verbosity == 2)
        for optimizer in optimizers:
            _patch_step_without_casts(optimizer)

    if optimizers_was_list:
        return (models if models_was_list else models[0]), optimizers
    if len(optimizers) == 0:
        return models if models_was_list else models[0]
    return (models if models_was_list else models[0]), optimizers[0]
