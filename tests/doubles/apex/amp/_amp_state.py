"""TEST DOUBLE of ``apex/amp/_amp_state.py``: the state amp's modules share, and the device the double runs on.

apex compares tensors with ``is_cuda`` and type strings such as ``'torch.cuda.HalfTensor'``. The double asks
:func:`on_amp_device` instead: CUDA, or the CPU while ``apex.amp.supports_cpu`` is True (the shipped value). So
"half on CUDA" in apex reads "half on the double's device" here, and with ``supports_cpu = False`` the double
refuses CPU tensors wherever apex does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class AmpState:
    """_amp_state.py ``AmpState``: options apex reads before ``initialize`` sets the rest (``opt_properties``,
    ``loss_scalers``, ``handle``, ``min_loss_scale``, ``max_loss_scale``)."""

    def __init__(self) -> None:
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1


_amp_state = AmpState()


def warn_or_err(msg: str) -> None:
    """_amp_state.py ``warn_or_err``: an error, unless ``hard_override`` turns it into a printed warning."""
    if _amp_state.hard_override:
        print("Warning:  " + msg)
    else:
        raise RuntimeError(msg)


def maybe_print(msg: str, rank0: bool = False) -> None:
    """_amp_state.py ``maybe_print``: printed unless ``verbosity=0``; with ``rank0``, by rank 0 only."""
    if _amp_state.verbosity <= 0:
        return
    distributed = (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
    if not (rank0 and distributed) or torch.distributed.get_rank() == 0:
        print(msg)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """_amp_state.py ``master_params``: the parameters of ``optimizer.param_groups``, fp32 masters under O2."""
    for group in optimizer.param_groups:
        yield from group["params"]


def on_amp_device(tensor: Any) -> bool:
    """TEST-DOUBLE ONLY (apex has no such function): stands in for apex's inline ``tensor.is_cuda`` tests (e.g.
    _initialize.py ``check_params_fp32``, utils.py ``maybe_half``): CUDA, or the CPU while ``supports_cpu`` is True."""
    from apex import amp

    return bool(tensor.is_cuda or (amp.supports_cpu and tensor.device.type == "cpu"))


def is_amp_half(tensor: torch.Tensor) -> bool:
    """TEST-DOUBLE ONLY: apex's inline ``param.type() == 'torch.cuda.HalfTensor'`` (_process_optimizer.py
    ``lazy_init_*``, ``new_add_param_group``), on the double's device."""
    return on_amp_device(tensor) and tensor.dtype == torch.float16


def is_amp_float(tensor: torch.Tensor) -> bool:
    """TEST-DOUBLE ONLY: apex's inline ``param.type() == 'torch.cuda.FloatTensor'`` (_process_optimizer.py), on the
    double's device."""
    return on_amp_device(tensor) and tensor.dtype == torch.float32
