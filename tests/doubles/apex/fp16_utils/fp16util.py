"""TEST DOUBLE of ``apex/fp16_utils/fp16util.py``: casting a network batchnorm-safely, copying masters to the model.

apex's FP16_Optimizer, FP16Model, network_to_half and the flat-master variants are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.nn.modules.batchnorm import _BatchNorm


def convert_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """fp16util.py ``convert_module``: the module's own floating parameters, their gradients and its buffers.

    The tensors are replaced through ``.data``, so each Parameter keeps its identity: optimizers built before
    ``amp.initialize`` still hold the model's parameters.
    """
    for param in module.parameters(recurse=False):
        if param.data.dtype.is_floating_point:
            param.data = param.data.to(dtype=dtype)
        if param._grad is not None and param._grad.data.dtype.is_floating_point:
            param._grad.data = param._grad.data.to(dtype=dtype)
    for buffer in module.buffers(recurse=False):
        if buffer.data.dtype.is_floating_point:
            buffer.data = buffer.data.to(dtype=dtype)


def convert_network(network: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """fp16util.py ``convert_network``: every module but affine batchnorms, which stay as they are (fp32).

    A batchnorm without affine parameters is converted, buffers and all, as apex converts it.
    """
    for module in network.modules():
        if isinstance(module, _BatchNorm) and module.affine is True:
            continue
        convert_module(module, dtype)
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()
    return network


def master_params_to_model_params(model_params: Iterable[torch.Tensor], master_params: Iterable[torch.Tensor]) -> None:
    """fp16util.py ``master_params_to_model_params`` (``flat_master=False``): copy each master into its model param."""
    for model, master in zip(model_params, master_params):  # noqa: B905  (apex zips without a length check)
        model.data.copy_(master.data)
