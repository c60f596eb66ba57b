"""TEST DOUBLE of ``apex/amp/amp.py``: O1's ``init``, which patches torch functions and Tensor methods for the rest
of the process (following :mod:`apex.amp.lists`, then RNNs and RNN cells through :mod:`apex.amp.rnn_compat`), and
the user's own additions to it: the registries (``register_half_function``...), read by the next O1 ``init``, and
the decorators (``half_function``...), active once an O1 ``init`` has run. Verbose cast logging is not modelled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import lists, rnn_compat, wrap
from ._amp_state import _amp_state
from .frontend import DEPRECATED
from .handle import AmpHandle

#: The handle the decorators ask whether casts are active: the latest O1 ``init``'s, None before one.
_DECORATOR_HANDLE: AmpHandle | None = None
#: ``(module, name, cast function)`` and ``(module, name)`` registered by the user, applied and cleared by the next
#: O1 ``init``. A registration after ``amp.initialize`` waits there for another one; nothing checks it.
_USER_CAST_REGISTRY: set[tuple[Any, str, wrap.CastFn]] = set()
_USER_PROMOTE_REGISTRY: set[tuple[Any, str]] = set()


def _decorator_helper(orig_fn: Callable[..., Any], cast_fn: wrap.CastFn, wrap_fn: Callable[..., Any]) -> Any:
    """amp.py ``_decorator_helper``: at each call, ``orig_fn`` as is while no O1 handle is active, else wrapped
    by ``wrap_fn`` with the handle of the latest ``init``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        handle = _DECORATOR_HANDLE
        if handle is None or not handle.is_active():
            return orig_fn(*args, **kwargs)
        return wrap_fn(orig_fn, cast_fn, handle)(*args, **kwargs)

    return wrapper


def half_function(fn: Callable[..., Any]) -> Any:
    """amp.py ``half_function``: under O1, ``fn`` gets its floating arguments in fp16 (weights through the cache)."""
    from apex import deprecated_warning

    deprecated_warning(DEPRECATED)
    return _decorator_helper(fn, wrap.maybe_half, functools.partial(wrap.make_cast_wrapper, try_caching=True))


def float_function(fn: Callable[..., Any]) -> Any:
    """amp.py ``float_function``: under O1, ``fn`` gets its floating arguments in fp32."""
    from apex import deprecated_warning

    deprecated_warning(DEPRECATED)
    return _decorator_helper(fn, wrap.maybe_float, functools.partial(wrap.make_cast_wrapper, try_caching=False))


def promote_function(fn: Callable[..., Any]) -> Any:
    """amp.py ``promote_function``: under O1, ``fn`` promotes fp16 mixed with fp32 to fp32, as ``wrap.promote``."""
    from apex import deprecated_warning

    deprecated_warning(DEPRECATED)
    return _decorator_helper(fn, wrap.maybe_float, wrap.make_promote_wrapper)


def _check_registrable(module: Any, name: str) -> None:
    """amp.py ``register_*_function``'s check, apex's message."""
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")


def register_half_function(module: Any, name: str) -> None:
    """amp.py ``register_half_function``: the next O1 ``init`` makes ``module.name`` cast to fp16."""
    _check_registrable(module, name)
    _USER_CAST_REGISTRY.add((module, name, wrap.maybe_half))


def register_float_function(module: Any, name: str) -> None:
    """amp.py ``register_float_function``: the next O1 ``init`` makes ``module.name`` cast to fp32."""
    _check_registrable(module, name)
    _USER_CAST_REGISTRY.add((module, name, wrap.maybe_float))


def register_promote_function(module: Any, name: str) -> None:
    """amp.py ``register_promote_function``: the next O1 ``init`` makes ``module.name`` promote its arguments."""
    _check_registrable(module, name)
    _USER_PROMOTE_REGISTRY.add((module, name))


def _inplace(names: list[str]) -> list[str]:
    """utils.py ``as_inplace``: ``exp`` -> ``exp_``."""
    return [name + "_" for name in names]


def init(enable_caching: bool = True, verbose: bool = False, allow_banned: bool = False) -> AmpHandle:
    """amp.py ``init``, in apex's order: the user's registrations (consumed), fp16 and fp32 casts, promotion of mixed
    arguments, errors for in-place fp32-list functions on fp16 tensors, in-place methods matched to their tensor,
    RNNs and RNN cells, banned functions. The handle becomes the decorators'."""
    global _DECORATOR_HANDLE
    handle = AmpHandle(enable_caching, verbose)

    # Patched first, so that a listed function the user registered casts as registered (the list's wrapper outside).
    for mod, fn, cast_fn in _USER_CAST_REGISTRY:
        wrap.cached_cast_function(mod, fn, cast_fn, handle, try_caching=cast_fn is wrap.maybe_half)
    _USER_CAST_REGISTRY.clear()
    for mod, fn in _USER_PROMOTE_REGISTRY:
        wrap.promote(mod, fn, handle)
    _USER_PROMOTE_REGISTRY.clear()

    casts = [
        (lists.FUNCTIONAL, lists.FUNCTIONAL_FP16, lists.FUNCTIONAL_FP32),
        (lists.TORCH, lists.TORCH_FP16, lists.TORCH_FP32),
        (lists.TENSOR, lists.TENSOR_FP16, lists.TENSOR_FP32),
    ]
    for module, fp16_names, fp32_names in casts:
        for name in fp16_names:
            wrap.cached_cast_function(module, name, wrap.maybe_half, handle, try_caching=True)
        for name in fp32_names:
            wrap.cached_cast_function(module, name, wrap.maybe_float, handle, try_caching=False)

    for module, names, sequence_names in [
        (lists.TORCH, lists.TORCH_CASTS, lists.TORCH_SEQUENCE_CASTS),
        (lists.TENSOR, lists.TENSOR_CASTS, lists.TENSOR_SEQUENCE_CASTS),
    ]:
        for name in names:
            wrap.promote(module, name, handle)
        for name in sequence_names:
            wrap.sequence_promote(module, name, handle)

    for name in _inplace(lists.TORCH_FP32):
        wrap.err_if_any_half(lists.TORCH, name, handle)
    for name in _inplace(lists.TENSOR_FP32):
        wrap.err_if_arg0_half(lists.TENSOR, name, handle)
    for name in _inplace([*lists.TENSOR_FP16, *lists.TENSOR_CASTS]):
        wrap.promote_match_arg0(lists.TENSOR, name, handle)

    # nn.LSTM and nn.GRU call _VF.lstm / _VF.gru, which O1 wraps on the shim; nn.RNN calls _VF.rnn_tanh / rnn_relu,
    # left as they are: O1 wraps _rnn_impls' entries instead, which today's torch no longer calls.
    if not rnn_compat.has_old_rnns():
        torch.nn.modules.rnn._VF = rnn_compat.VariableFunctionsShim()  # type: ignore[attr-defined]
        for name in rnn_compat.RNN_NAMES:
            wrap.new_rnn_cast(name.upper(), handle, verbose)
    rnn_compat.whitelist_rnn_cells(handle, verbose)

    for name, message in lists.FUNCTIONAL_BANNED:
        if allow_banned:
            wrap.cached_cast_function(lists.FUNCTIONAL, name, wrap.maybe_float, handle, try_caching=True)
        else:
            wrap.err_if_any_half(lists.FUNCTIONAL, name, handle, message)

    _DECORATOR_HANDLE = handle
    _amp_state.handle = handle
    return handle
