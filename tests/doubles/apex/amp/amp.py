"""TEST DOUBLE of ``apex/amp/amp.py`` ``init``: O1 patches torch functions and Tensor methods for the rest of the
process, following :mod:`apex.amp.lists`, then RNNs and RNN cells through :mod:`apex.amp.rnn_compat`. apex's
decorators and registries (``half_function``, ``register_float_function`` ...) and verbose cast logging are not
modelled.
"""

from __future__ import annotations

import torch

from . import lists, rnn_compat, wrap
from ._amp_state import _amp_state
from .handle import AmpHandle


def _inplace(names: list[str]) -> list[str]:
    """utils.py ``as_inplace``: ``exp`` -> ``exp_``."""
    return [name + "_" for name in names]


def init(enable_caching: bool = True, verbose: bool = False, allow_banned: bool = False) -> AmpHandle:
    """amp.py ``init``, in apex's order: fp16 and fp32 casts, promotion of mixed arguments, errors for in-place
    fp32-list functions on fp16 tensors, in-place methods matched to their tensor, RNNs and RNN cells, banned
    functions."""
    handle = AmpHandle(enable_caching, verbose)

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

    _amp_state.handle = handle
    return handle
