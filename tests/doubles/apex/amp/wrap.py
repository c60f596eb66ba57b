"""TEST DOUBLE of ``apex/amp/wrap.py`` and ``apex/amp/utils.py``: the wrappers O1 puts around torch functions,
RNN functions included.

Type tests compare ``tensor.type()`` endings (``'HalfTensor'``, ``'FloatTensor'``), which, as in apex, do not
depend on the device; casts happen only on the double's device (apex: only on CUDA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import double_extras, rnn_compat
from ._amp_state import _amp_state, on_amp_device

CastFn = Callable[[Any], Any]


# --- utils.py ---------------------------------------------------------------------------------------------------


def _is_nested(x: Any) -> bool:
    """utils.py ``is_nested``: a tuple or a list."""
    return isinstance(x, (tuple, list))


def is_fp_tensor(x: Any) -> bool:
    """utils.py ``is_fp_tensor``: a floating tensor, or a tuple/list made only of them."""
    if _is_nested(x):
        return all(is_fp_tensor(y) for y in x)
    return torch.is_tensor(x) and torch.is_floating_point(x)


def type_string(x: torch.Tensor) -> str:
    """utils.py ``type_string``: ``'HalfTensor'``, ``'FloatTensor'``... whatever the device."""
    return x.type().split(".")[-1]


def should_cache(x: Any) -> bool:
    """utils.py ``should_cache``: fp32 Parameters (the weights) are cast once per iteration."""
    if _is_nested(x):
        return all(should_cache(y) for y in x)
    return isinstance(x, torch.nn.Parameter) and type_string(x) == "FloatTensor"


def collect_fp_tensor_types(args: Any, kwargs: dict[str, Any]) -> set[str]:
    """utils.py ``collect_fp_tensor_types``: the type strings of the floating tensor arguments."""
    types: set[str] = set()

    def collect(x: Any) -> None:
        if _is_nested(x):
            for y in x:
                collect(y)
        else:
            types.add(type_string(x))

    for x in [*args, *kwargs.values()]:
        if is_fp_tensor(x):
            collect(x)
    return types


def maybe_half(x: Any) -> Any:
    """utils.py ``maybe_half``: fp16 copy of a tensor on the double's device that is not fp16 already."""
    if _is_nested(x):
        return type(x)([maybe_half(y) for y in x])
    if not on_amp_device(x) or type_string(x) == "HalfTensor":
        return x
    return x.half()


def maybe_float(x: Any) -> Any:
    """utils.py ``maybe_float``: fp32 copy of a tensor on the double's device that is not fp32 already."""
    if _is_nested(x):
        return type(x)([maybe_float(y) for y in x])
    if not on_amp_device(x) or type_string(x) == "FloatTensor":
        return x
    return x.float()


def casted_args(cast_fn: CastFn, args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """utils.py ``casted_args``: cast the floating tensor arguments; returns the new args, casts kwargs in place."""
    new_args = [cast_fn(x) if is_fp_tensor(x) else x for x in args]
    for key, value in kwargs.items():
        if is_fp_tensor(value):
            kwargs[key] = cast_fn(value)
    return new_args


def cached_cast(cast_fn: CastFn, x: torch.Tensor, cache: dict[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """utils.py ``cached_cast``: a weight's cast is reused until ``scale_loss`` clears the cache.

    On a hit with gradients on, apex checks that the cached copy still derives from the weight by reading
    ``grad_fn.next_functions[1]``. torch 1.12 and later give a cast one next function, so the check raises
    IndexError (apex issue #1228, PR #1282 unmerged in 25.05): under O1 a weight used twice between two
    ``scale_loss`` calls fails, in apex as here.
    """
    if x in cache:
        cached = cache[x]
        if x.requires_grad and cached.requires_grad and cached.grad_fn.next_functions[1][0].variable is not x:
            raise RuntimeError(
                "x and cache[x] both require grad, but x is not cache[x]'s parent.  This is likely an error."
            )
        # A cast made under no_grad is dropped when gradients are on again (not while they are off).
        if torch.is_grad_enabled() and x.requires_grad != cached.requires_grad:
            del cache[x]
        else:
            return cached
    cache[x] = cast_fn(x)
    return cache[x]


def has_func(mod: Any, fn: str) -> bool:
    """utils.py ``has_func``: ``mod`` is a module or object, or a dict of functions (``torch.nn.modules.rnn``'s
    ``_rnn_impls``)."""
    return fn in mod if isinstance(mod, dict) else hasattr(mod, fn)


def get_func(mod: Any, fn: str) -> Any:
    """utils.py ``get_func``: ``mod[fn]`` for a dict, ``mod.fn`` otherwise."""
    return mod[fn] if isinstance(mod, dict) else getattr(mod, fn)


def set_func(mod: Any, fn: str, new_fn: Any) -> None:
    """utils.py ``set_func``: ``mod[fn] = new_fn`` for a dict, ``mod.fn = new_fn`` otherwise."""
    if isinstance(mod, dict):
        mod[fn] = new_fn
    else:
        setattr(mod, fn, new_fn)


def set_func_save(handle: Any, mod: Any, fn: str, new_fn: Callable[..., Any]) -> None:
    """utils.py ``set_func_save``: patch ``mod.fn`` (or ``mod[fn]``) and remember what it was (on the handle, and
    on the wrapper for :func:`~apex.amp.double_extras.unpatch_torch_for_tests`)."""
    current = get_func(mod, fn)
    handle._save_func(mod, fn, current)
    double_extras.mark_replacement(new_fn, mod, fn, current)
    set_func(mod, fn, new_fn)


def new_synthesize_flattened_rnn_weights(
    fp32_weights: list[torch.Tensor], fp16_flat_tensor: torch.Tensor
) -> list[torch.Tensor]:
    """utils.py ``new_synthesize_flattened_rnn_weights``: an fp16 copy of each of an RNN's weights, all in one flat
    fp16 buffer, each made by ``copy_`` from its fp32 weight so that its gradient flows back to the fp32 weight.

    Deviation: apex puts each copy at its fp32 weight's offset from the first one, computed from their
    ``data_ptr()`` distance. That is right for cuDNN's flattened weights on CUDA, which are views into one buffer;
    on the CPU each weight is an allocation of its own, and those distances say nothing (negative, or past the
    buffer's end). The double lays the copies out in order, one after the other. apex reaches the buffer through
    ``storage()``, which torch now warns about (TypedStorage is deprecated); the double uses ``untyped_storage()``.
    """
    fp16_weights = []
    offset = 0
    for w_fp32 in fp32_weights:
        w_fp16 = w_fp32.new_empty(0, dtype=torch.half)
        w_fp16.set_(fp16_flat_tensor.untyped_storage(), offset, w_fp32.shape)
        w_fp16.copy_(w_fp32)
        fp16_weights.append(w_fp16)
        offset += w_fp32.numel()
    return fp16_weights


# --- wrap.py ----------------------------------------------------------------------------------------------------


def make_cast_wrapper(orig_fn: Callable[..., Any], cast_fn: CastFn, handle: Any, try_caching: bool = False) -> Any:
    """wrap.py ``make_cast_wrapper``: cast the floating arguments (weights through the cache) while active."""

    @functools.wraps(orig_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not handle.is_active():
            return orig_fn(*args, **kwargs)
        if try_caching and handle.has_cache:
            args = tuple(cached_cast(cast_fn, a, handle.cache) if should_cache(a) else a for a in args)
            for key, value in kwargs.items():
                if should_cache(value):
                    kwargs[key] = cached_cast(cast_fn, value, handle.cache)
        return orig_fn(*casted_args(cast_fn, args, kwargs), **kwargs)

    return wrapper


def cached_cast_function(mod: Any, fn: str, cast_fn: CastFn, handle: Any, try_caching: bool = False) -> None:
    """wrap.py ``cached_cast``: ``mod.fn`` casts its floating arguments (fp16 ones through the weight cache)."""
    if has_func(mod, fn):
        set_func_save(handle, mod, fn, make_cast_wrapper(get_func(mod, fn), cast_fn, handle, try_caching))


def make_promote_wrapper(orig_fn: Callable[..., Any], cast_fn: CastFn, handle: Any = None) -> Any:
    """wrap.py ``make_promote_wrapper``: one floating type passes, fp16 with fp32 goes fp32, any other mix of
    floating types (fp32 with fp64, fp16 with fp64, bf16 with fp32) raises. Integer tensors and numbers are not
    collected, so ``long / 2`` and ``float / long`` pass to torch.

    ``handle`` is unused, as in apex (amp.py's ``promote_function`` passes one): the wrapper asks
    ``_amp_state.handle`` whether casts are active."""

    @functools.wraps(orig_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _amp_state.handle.is_active():
            return orig_fn(*args, **kwargs)
        types = collect_fp_tensor_types(args, kwargs)
        if len(types) <= 1:
            return orig_fn(*args, **kwargs)
        if types == {"HalfTensor", "FloatTensor"}:
            return orig_fn(*casted_args(cast_fn, args, kwargs), **kwargs)
        raise NotImplementedError(f"Do not know how to handle these types to promote: {types}")

    return wrapper


def promote(mod: Any, fn: str, handle: Any) -> None:
    """wrap.py ``promote``: mixed fp16/fp32 arguments are all cast to fp32; other mixes are an error."""
    set_func_save(handle, mod, fn, make_promote_wrapper(getattr(mod, fn), maybe_float))


def sequence_promote(mod: Any, fn: str, handle: Any) -> None:
    """wrap.py ``sequence_promote``: fp16 with fp32 in a sequence (``torch.cat``, ``torch.stack``) goes fp32;
    unlike :func:`promote`, any other mix passes to torch unchanged (fp32 with fp64 gives fp64)."""
    orig_fn = getattr(mod, fn)

    @functools.wraps(orig_fn)
    def wrapper(seq: Any, *args: Any, **kwargs: Any) -> Any:
        if not _amp_state.handle.is_active():
            return orig_fn(seq, *args, **kwargs)
        types = {type_string(x) for x in seq}
        if types == {"HalfTensor", "FloatTensor"}:
            return orig_fn(casted_args(maybe_float, seq, {}), *args, **kwargs)
        return orig_fn(seq, *args, **kwargs)

    set_func_save(handle, mod, fn, wrapper)


def promote_match_arg0(mod: Any, fn: str, handle: Any) -> None:
    """wrap.py ``promote_match_arg0``: an in-place method casts its other arguments to its tensor's type."""
    if not hasattr(mod, fn):
        return
    orig_fn = getattr(mod, fn)

    @functools.wraps(orig_fn)
    def wrapper(arg0: Any, *args: Any, **kwargs: Any) -> Any:
        assert torch.is_tensor(arg0)
        if not _amp_state.handle.is_active():
            return orig_fn(arg0, *args, **kwargs)
        if type_string(arg0) == "HalfTensor":
            cast_fn = maybe_half
        elif type_string(arg0) == "FloatTensor":
            cast_fn = maybe_float
        else:
            return orig_fn(arg0, *args, **kwargs)
        return orig_fn(arg0, *casted_args(cast_fn, args, kwargs), **kwargs)

    set_func_save(handle, mod, fn, wrapper)


def err_if_any_half(mod: Any, fn: str, handle: Any, custom_err_msg: str | None = None) -> None:
    """wrap.py ``err_if_any_half``: an error for any fp16 argument, whether casts are active or not."""
    if not hasattr(mod, fn):
        return
    orig_fn = getattr(mod, fn)

    @functools.wraps(orig_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "HalfTensor" in collect_fp_tensor_types(args, kwargs):
            raise NotImplementedError(custom_err_msg or f"Cannot call in-place function {fn} with fp16 arguments.")
        return orig_fn(*args, **kwargs)

    set_func_save(handle, mod, fn, wrapper)


def err_if_arg0_half(mod: Any, fn: str, handle: Any) -> None:
    """wrap.py ``err_if_arg0_half``: an in-place fp32-list method on an fp16 tensor is an error."""
    if not hasattr(mod, fn):
        return
    orig_fn = getattr(mod, fn)

    @functools.wraps(orig_fn)
    def wrapper(arg0: Any, *args: Any, **kwargs: Any) -> Any:
        assert torch.is_tensor(arg0)
        if type_string(arg0) == "HalfTensor":
            raise NotImplementedError(f"Cannot call in-place method {fn} on fp16 Tensors.")
        return orig_fn(arg0, *casted_args(maybe_float, args, kwargs), **kwargs)

    set_func_save(handle, mod, fn, wrapper)


def new_rnn_cast(fn: str, handle: Any, verbose: bool = False) -> None:
    """wrap.py ``new_rnn_cast``: the RNN function ``fn`` runs in fp16: its floating arguments (input, hidden state)
    through ``maybe_half``, its weights as fp16 copies in one flat buffer
    (:func:`new_synthesize_flattened_rnn_weights`), so that gradients reach the fp32 weights.

    A key of ``torch.nn.modules.rnn._rnn_impls`` (``'RNN_TANH'``, ``'RNN_RELU'``) is patched there; any other name
    is lower-cased and patched on the :class:`~apex.amp.rnn_compat.VariableFunctionsShim` that O1 put in
    ``torch.nn.modules.rnn._VF`` (an AssertionError without it). O1 passes upper-case names, so ``nn.RNN``, which
    calls ``_VF.rnn_tanh`` / ``_VF.rnn_relu`` itself, is left in fp32; ``new_rnn_cast("rnn_tanh", handle)`` patches
    the shim's ``rnn_tanh``, which ``nn.RNN`` does call. ``verbose`` is accepted, and cast logging not modelled.
    """
    rnn = torch.nn.modules.rnn
    mod: Any
    if has_func(rnn._rnn_impls, fn):
        mod = rnn._rnn_impls
    else:
        mod = rnn._VF
        assert isinstance(mod, rnn_compat.VariableFunctionsShim)
        fn = fn.lower()
    orig_fn = get_func(mod, fn)

    @functools.wraps(orig_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # torch/nn/modules/rnn.py's call, exactly: nine positional arguments.
        assert len(args) == 9
        assert len(kwargs) == 0
        if not _amp_state.handle.is_active():
            return orig_fn(*args, **kwargs)
        # Argument 6 is `train` (a bool) for a padded input; for a PackedSequence, whose batch sizes come second, it
        # is `dropout` (a float) and the weights move one place on.
        params_idx = 2 if isinstance(args[6], bool) else 3
        new_args = []
        for i, arg in enumerate(args):
            if i == params_idx:
                flat = args[0].new_empty((sum(w.numel() for w in arg),), dtype=torch.half)
                new_args.append(new_synthesize_flattened_rnn_weights(arg, flat))
            elif is_fp_tensor(arg):
                new_args.append(maybe_half(arg))
            else:
                new_args.append(arg)
        return orig_fn(*new_args)

    set_func_save(handle, mod, fn, wrapper)
