"""TEST DOUBLE of ``apex/amp/_process_optimizer.py``: how ``amp.initialize`` patches each optimizer.

Without master weights the optimizer steps the model's own parameters; amp only stashes and unscales their
gradients. With master weights (O2), the first ``_amp_lazy_init`` replaces every fp16 parameter in
``param_groups`` by an fp32 master copy, ``step`` updates the masters and copies them into the fp16 model, and
``zero_grad`` zeroes the model's gradients in place. apex's FusedSGD paths and fused kernels are not modelled.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from ..fp16_utils import master_params_to_model_params
from . import double_extras
from ._amp_state import is_amp_float, is_amp_half


class AmpOptimizerState:
    """_process_optimizer.py ``AmpOptimizerState``: ``optimizer._amp_stash``."""


def _type_error(param: torch.Tensor) -> TypeError:
    """_process_optimizer.py: the TypeError of ``lazy_init_*`` and ``new_add_param_group`` (neither fp16 nor fp32)."""
    return TypeError(
        "Optimizer's parameters must be either torch.cuda.FloatTensor or torch.cuda.HalfTensor. Received"
        f" {param.type()}"
    )


def _master_params_to_model_params(self: torch.optim.Optimizer) -> None:
    """_process_optimizer.py ``_master_params_to_model_params``, its path without ``multi_tensor_applier``."""
    stash = self._amp_stash
    for fp16_group, fp32_from_fp16_group in zip(stash.fp16_groups, stash.fp32_from_fp16_groups):  # noqa: B905
        master_params_to_model_params(fp16_group, fp32_from_fp16_group)


def _split_group_with_master_weights(params: list[torch.Tensor]) -> tuple[list[Any], list[Any], list[Any]]:
    """_process_optimizer.py: the loop of ``lazy_init_with_master_weights`` and ``new_add_param_group``.

    Replace each fp16 parameter of ``params`` in place by an fp32 master; returns the fp16 params, their
    masters, and the fp32 params (their own masters). Parameters that need no gradient are left alone."""
    fp16, fp32_from_fp16, fp32 = [], [], []
    for i, param in enumerate(params):
        if not param.requires_grad:
            continue
        if is_amp_half(param):
            master = param.detach().clone().float()
            master.requires_grad = True
            params[i] = master
            fp16.append(param)
            fp32_from_fp16.append(master)
        elif is_amp_float(param):
            fp32.append(param)
        else:
            raise _type_error(param)
    return fp16, fp32_from_fp16, fp32


def lazy_init_with_master_weights(self: torch.optim.Optimizer) -> None:
    """_process_optimizer.py ``lazy_init_with_master_weights``: build the fp32 masters, move each parameter's
    optimizer state to its master, and recast that state to fp32 (through ``state_dict``/``load_state_dict``)."""
    stash = self._amp_stash
    stash.fp16_groups, stash.fp32_from_fp16_groups, stash.fp32_from_fp32_groups = [], [], []
    for group in self.param_groups:
        fp16, masters, fp32 = _split_group_with_master_weights(group["params"])
        for param, master in zip(fp16, masters):  # noqa: B905
            if param in self.state:
                self.state[master] = self.state.pop(param)
        stash.fp16_groups.append(fp16)
        stash.fp32_from_fp16_groups.append(masters)
        stash.fp32_from_fp32_groups.append(fp32)
    stash.all_fp16_params = [p for group in stash.fp16_groups for p in group]
    stash.all_fp32_from_fp16_params = [p for group in stash.fp32_from_fp16_groups for p in group]
    stash.all_fp32_from_fp32_params = [p for group in stash.fp32_from_fp32_groups for p in group]
    stash.all_fp16_grad_stash = [None for _ in stash.all_fp16_params]
    stash.all_fp32_from_fp32_grad_stash = [None for _ in stash.all_fp32_from_fp32_params]
    for param in [*stash.all_fp32_from_fp16_params, *stash.all_fp32_from_fp32_params]:
        param.grad = None
    self.load_state_dict(self.state_dict())


def post_backward_models_are_masters(
    scaler: Any, params: list[torch.Tensor], stashed_grads: list[Any], scale_override: Any = None
) -> None:
    """_process_optimizer.py ``post_backward_models_are_masters``: unscale the new gradients and add the stashed
    ones back. With a static scale of 1 the stash is dropped, unscaled and un-added, as in apex."""
    grads_have_scale, stashed_have_scale, out_scale = scaler.loss_scale(), 1.0, 1.0
    if scaler.loss_scale() == 1.0 and not scaler.dynamic:
        stashed_grads[:] = [None] * len(stashed_grads)
        return
    if scale_override is not None:
        grads_have_scale, stashed_have_scale, out_scale = scale_override
    new_grads, new_grads_with_stash, stashed = [], [], []
    for param, stashed_grad in zip(params, stashed_grads):  # noqa: B905
        if param.grad is None and stashed_grad is not None:
            param.grad = stashed_grad
        elif param.grad is not None and stashed_grad is None:
            new_grads.append(param.grad)
        elif param.grad is not None:
            new_grads_with_stash.append(param.grad)
            stashed.append(stashed_grad)
    if new_grads:
        scaler.unscale(new_grads, new_grads, None, models_are_masters=True, scale_override=grads_have_scale / out_scale)
    if new_grads_with_stash:
        scaler.unscale_with_stashed(
            new_grads_with_stash,
            stashed,
            new_grads_with_stash,
            scale_override=(grads_have_scale, stashed_have_scale, out_scale),
        )
    stashed_grads[:] = [None] * len(stashed_grads)


def prepare_backward_with_master_weights(self: torch.optim.Optimizer) -> None:
    """_process_optimizer.py ``prepare_backward_with_master_weights``: the fp16 gradients start from None (the
    masters keep theirs); fp32 params stash theirs."""
    stash = self._amp_stash
    self._amp_lazy_init()
    for param in stash.all_fp16_params:
        param.grad = None
    for i, param in enumerate(stash.all_fp32_from_fp32_params):
        stash.all_fp32_from_fp32_grad_stash[i] = param.grad
        param.grad = None


def post_backward_with_master_weights(self: torch.optim.Optimizer, scaler: Any) -> None:
    """_process_optimizer.py ``post_backward_with_master_weights``: unscale each new fp16 gradient into its master's
    gradient (a new fp32 tensor, or added to the one there)."""
    stash = self._amp_stash
    self._amp_lazy_init()
    fp16_grads, new_fp32_grads, fp16_grads_with_stash, preexisting_fp32_grads = [], [], [], []
    for fp16_param, fp32_param in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):  # noqa: B905
        if fp16_param.grad is None:
            continue
        if fp32_param.grad is None:
            fp32_param.grad = torch.empty_like(fp32_param)
            fp16_grads.append(fp16_param.grad)
            new_fp32_grads.append(fp32_param.grad)
        else:
            fp16_grads_with_stash.append(fp16_param.grad)
            preexisting_fp32_grads.append(fp32_param.grad)
    if fp16_grads:
        scaler.unscale(fp16_grads, new_fp32_grads, scaler.loss_scale(), models_are_masters=False)
    if fp16_grads_with_stash:
        scaler.unscale_with_stashed(fp16_grads_with_stash, preexisting_fp32_grads, preexisting_fp32_grads)
    post_backward_models_are_masters(scaler, stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash)


def lazy_init_no_master_weights(self: torch.optim.Optimizer) -> None:
    """_process_optimizer.py ``lazy_init_no_master_weights``: the params by type, each with an empty grad stash."""
    stash = self._amp_stash
    stash.all_fp16_params, stash.all_fp32_params = [], []
    for group in self.param_groups:
        for param in group["params"]:
            if is_amp_half(param):
                stash.all_fp16_params.append(param)
            elif is_amp_float(param):
                stash.all_fp32_params.append(param)
            else:
                raise _type_error(param)
    stash.all_fp16_grad_stash = [None for _ in stash.all_fp16_params]
    stash.all_fp32_grad_stash = [None for _ in stash.all_fp32_params]


def prepare_backward_no_master_weights(self: torch.optim.Optimizer) -> None:
    """_process_optimizer.py ``prepare_backward_no_master_weights``: stash every gradient, start from None."""
    stash = self._amp_stash
    self._amp_lazy_init()
    for params, grad_stash in [
        (stash.all_fp16_params, stash.all_fp16_grad_stash),
        (stash.all_fp32_params, stash.all_fp32_grad_stash),
    ]:
        for i, param in enumerate(params):
            grad_stash[i] = param.grad
            param.grad = None


def post_backward_no_master_weights(self: torch.optim.Optimizer, scaler: Any) -> None:
    """_process_optimizer.py ``post_backward_no_master_weights``: fp16 then fp32 params, as models that are masters."""
    stash = self._amp_stash
    self._amp_lazy_init()
    post_backward_models_are_masters(scaler, stash.all_fp16_params, stash.all_fp16_grad_stash)
    post_backward_models_are_masters(scaler, stash.all_fp32_params, stash.all_fp32_grad_stash)


def _amp_lazy_init(self: torch.optim.Optimizer) -> None:
    """_process_optimizer.py ``_amp_lazy_init``: once, at the first backward, ``zero_grad`` or ``add_param_group``."""
    if not self._amp_stash.lazy_init_called:
        self._lazy_init_maybe_master_weights()
        self._amp_stash.lazy_init_called = True
        double_extras.record("lazy_init")


def _with_master_weights_step(self: torch.optim.Optimizer, old_step: Any, closure: Any = None) -> Any:
    """_process_optimizer.py ``_process_optimizer``'s ``new_step`` (master weights): no closure; step, copy the
    masters into the model, clear the master gradients."""
    if closure is not None:
        raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
    retval = old_step()
    self._master_params_to_model_params()
    # The master gradients are not the model's: model.zero_grad() would not clear them.
    for param in self._amp_stash.all_fp32_from_fp16_params:
        param.grad = None
    return retval


def _with_master_weights_zero_grad(self: torch.optim.Optimizer) -> None:
    """_process_optimizer.py ``_process_optimizer``'s ``new_zero_grad``: no ``set_to_none``; ``detach_()`` fails on
    a gradient that is a view (DDP's ``gradient_as_bucket_view``), with torch's "Can't detach views in-place"."""
    stash = self._amp_stash
    self._amp_lazy_init()
    for param in [*stash.all_fp16_params, *stash.all_fp32_from_fp32_params]:
        if param.grad is not None:
            param.grad.detach_()
            param.grad.zero_()
    for param in stash.all_fp32_from_fp16_params:
        param.grad = None


def _add_param_group(
    self: torch.optim.Optimizer, old_add_param_group: Any, master_weights: bool, new_group: Any
) -> None:
    """_process_optimizer.py ``_process_optimizer``'s ``new_add_param_group``: lazy init first, then the new
    group's params join the stash (as masters)."""
    stash = self._amp_stash
    if not stash.lazy_init_called:
        self._lazy_init_maybe_master_weights()
        stash.lazy_init_called = True
    assert isinstance(new_group, dict), "param group must be a dict"
    new_params = new_group["params"]
    if isinstance(new_params, torch.Tensor):
        new_group["params"] = [new_params]
    elif isinstance(new_params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the ordering of tensors in sets"
            " will change between runs. Please use a list instead."
        )
    else:
        new_group["params"] = list(new_params)
    if master_weights:
        fp16, masters, fp32 = _split_group_with_master_weights(new_group["params"])
        stash.fp16_groups.append(fp16)
        stash.fp32_from_fp16_groups.append(masters)
        stash.fp32_from_fp32_groups.append(fp32)
        stash.all_fp16_params += fp16
        stash.all_fp32_from_fp16_params += masters
        stash.all_fp32_from_fp32_params += fp32
        stash.all_fp32_from_fp32_grad_stash += [None for _ in fp32]
    else:
        for param in new_group["params"]:
            if is_amp_half(param):
                stash.all_fp16_params.append(param)
                stash.all_fp16_grad_stash.append(None)
            elif is_amp_float(param):
                stash.all_fp32_params.append(param)
                stash.all_fp32_grad_stash.append(None)
            else:
                raise _type_error(param)
    old_add_param_group(new_group)


_AMP_METHODS = (
    "_lazy_init_maybe_master_weights",
    "_master_params_to_model_params",
    "_prepare_amp_backward",
    "_post_amp_backward",
    "_amp_lazy_init",
)


def _process_optimizer(optimizer: torch.optim.Optimizer, properties: Any) -> torch.optim.Optimizer:
    """_process_optimizer.py ``_process_optimizer``: give the optimizer its ``_amp_stash`` and amp methods, and
    patch ``step``, ``zero_grad`` (master weights only) and ``add_param_group`` in place."""
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    optimizer._amp_stash = AmpOptimizerState()
    optimizer._amp_stash.lazy_init_called = False
    optimizer._amp_stash.already_patched = False
    optimizer._amp_stash.params_have_scaled_gradients = False
    for name in _AMP_METHODS:
        if hasattr(optimizer, name):
            raise RuntimeError(f"Incoming optimizer already has {name} defined.")

    def bind(function: Any) -> Any:
        return types.MethodType(function, optimizer)

    if properties.master_weights:
        optimizer._lazy_init_maybe_master_weights = bind(lazy_init_with_master_weights)
        optimizer._master_params_to_model_params = bind(_master_params_to_model_params)
        old_step = optimizer.step
        optimizer.step = bind(lambda self, closure=None: _with_master_weights_step(self, old_step, closure))
        optimizer.zero_grad = bind(_with_master_weights_zero_grad)
        optimizer._prepare_amp_backward = bind(prepare_backward_with_master_weights)
        optimizer._post_amp_backward = bind(post_backward_with_master_weights)
    else:
        optimizer._lazy_init_maybe_master_weights = bind(lazy_init_no_master_weights)
        optimizer._prepare_amp_backward = bind(prepare_backward_no_master_weights)
        optimizer._post_amp_backward = bind(post_backward_no_master_weights)
    optimizer._amp_lazy_init = bind(_amp_lazy_init)
    old_add_param_group = optimizer.add_param_group
    master_weights = bool(properties.master_weights)
    optimizer.add_param_group = bind(
        lambda self, new_group: _add_param_group(self, old_add_param_group, master_weights, new_group)
    )
    return optimizer
