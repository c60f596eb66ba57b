"""TEST DOUBLE of ``apex/amp/rnn_compat.py``: the stand-in for ``torch.nn.modules.rnn._VF`` that O1 patches, and
the casts on the RNN cell functions.

``torch.nn.modules.rnn`` calls its RNNs through the module-level name ``_VF`` (``_VF.lstm``, ``_VF.gru_cell``...),
which cannot be patched in place. O1 replaces that name with a :class:`VariableFunctionsShim`, whose functions it
can wrap; other importers of ``torch._VF`` are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import wrap

RNN_NAMES = ["rnn_relu", "rnn_tanh", "gru", "lstm"]


def _calls_vf(name: str) -> Callable[..., Any]:
    """rnn_compat.py ``_gen_VF_wrapper``: a function that calls torch's own ``_VF.<name>``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(torch._C._VariableFunctions, name)(*args, **kwargs)

    return call


class VariableFunctionsShim:
    """rnn_compat.py ``VariableFunctionsShim``: ``rnn_relu``, ``rnn_tanh``, ``gru``, ``lstm`` and their ``_cell``
    versions, as attributes O1 can replace, each calling torch's own."""

    def __init__(self) -> None:
        for name in RNN_NAMES:
            for fn_name in (name, name + "_cell"):
                setattr(self, fn_name, _calls_vf(fn_name))


def has_old_rnns() -> bool:
    """rnn_compat.py ``has_old_rnns``: whether torch still has the THNN RNN backend (before torch 1.0). False on
    every torch this package supports; apex's branch for it (wrap.py ``rnn_cast``) is not modelled."""
    try:
        torch.nn.backends.thnn.backend.LSTMCell  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError:
        return False
    return True


def whitelist_rnn_cells(handle: Any, verbose: bool = False) -> None:
    """rnn_compat.py ``whitelist_rnn_cells``: the shim's cell functions (``lstm_cell``, ``gru_cell``,
    ``rnn_relu_cell``, ``rnn_tanh_cell``) cast their floating arguments to fp16, the weights through the cache, as
    O1's fp16 list does (so ``nn.LSTMCell`` and friends compute in fp16). ``verbose`` logging is not modelled."""
    mod = torch.nn.modules.rnn._VF
    assert isinstance(mod, VariableFunctionsShim)
    for fn in [name + "_cell" for name in RNN_NAMES]:
        wrap.cached_cast_function(mod, fn, wrap.maybe_half, handle, try_caching=True)
