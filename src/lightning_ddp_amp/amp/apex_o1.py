"""apex O1 on today's torch: what changed in torch since apex 25.05's patches were written, and how each is undone.

O1 does not use autocast: ``amp.initialize`` patches torch's functions to cast their inputs (apex's lists), and its
own code runs RNNs in fp16 inside torch's ``_VF`` calls. Three torch changes slip past those patches; the apex
backend undoes each under O1 only, for the rest of the process, as O1's patches last:

* the fused attention kernel of ``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention`` in eval mode, which no
  patch reaches (:func:`keep_attention_off_the_fast_path`);
* apex's cache of fp16 weight casts, whose check no longer matches torch's autograd graph
  (:func:`turn_off_the_weight_cast_cache`);
* the dtype check of ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``, which refuses O1's fp16 activations before apex's cast
  (``nn.GRU`` and ``nn.RNN`` on every supported torch, ``nn.LSTM`` from torch 2.2), and ``nn.RNN``'s direct ``_VF``
  call past that cast
  (:func:`hand_rnns_their_input`).
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_info  # what lightning.fabric.utilities re-exports
from torch.nn import Module
from torch.nn.utils.rnn import PackedSequence

from lightning_ddp_amp.errors import PrecisionConfigurationError
from lightning_ddp_amp.rank_zero import log_once

# The RNN modules handed their input in their weights' dtype so far in this process.
_HOOKED_RNNS: weakref.WeakSet[Module] = weakref.WeakSet()
# apex's _VF shims whose rnn_tanh and rnn_relu went through new_rnn_cast (each amp.initialize installs a new one).
_CAST_SHIMS: weakref.WeakSet[object] = weakref.WeakSet()


def turn_off_the_weight_cast_cache(amp: ModuleType) -> None:
    """Let apex O1 cast a weight at each use instead of once per ``scale_loss``.

    apex 25.05's cache of fp16 weight casts fails with ``IndexError: tuple index out of range`` when a weight is used
    twice before the next ``scale_loss`` (a GAN's discriminator on real and fake data, tied or shared weights;
    NVIDIA/apex#1228): its check reads ``grad_fn.next_functions[1]``, which a cast has not had since torch 1.12.
    Uncached, each use casts the weight again: the same fp16 values, and as many casts as before for a weight used
    once a step. ``_enable_caching`` is what ``amp.init(enable_caching=False)`` sets; ``amp.initialize`` passes none.
    """
    handle = getattr(getattr(amp, "_amp_state", None), "handle", None)
    if getattr(handle, "_enable_caching", False):
        handle._enable_caching = False  # type: ignore[union-attr]


_FUSED_ATTENTION = (torch.nn.TransformerEncoderLayer, torch.nn.MultiheadAttention)


def _attention_fast_path_switch() -> Any:
    """``torch.backends.mha``, which turns the fused attention path off (torch 2.3 and later); None before."""
    return getattr(torch.backends, "mha", None)


def keep_attention_off_the_fast_path(model: Module) -> None:
    """Keep ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` on their Python path under apex O1.

    In eval mode without gradients torch runs them as one fused kernel (``torch._transformer_encoder_layer_fwd``),
    which apex does not patch: it gets O1's fp16 activations beside fp32 weights and fails with "expected m1 and m2 to
    have the same dtype". Like O1's patches, turning it off lasts for the rest of the process.

    Raises:
        PrecisionConfigurationError: ``model`` has such a module and this torch has no switch for the fast path.
    """
    mha = _attention_fast_path_switch()
    if mha is not None:
        if mha.get_fastpath_enabled():
            mha.set_fastpath_enabled(False)
            rank_zero_info(
                "AmpPrecision: apex O1 computes in fp16 through patched torch functions, which torch's fused attention"
                " fast path bypasses; it is turned off for this process (torch.backends.mha.set_fastpath_enabled(False))"
            )
        return
    fused = [name or "the model" for name, module in model.named_modules() if isinstance(module, _FUSED_ATTENTION)]
    if fused:
        raise PrecisionConfigurationError(
            "torch",
            torch.__version__,
            f"in eval mode {fused[0]} runs torch's fused attention kernel, which apex O1's fp16 activations break"
            " (expected m1 and m2 to have the same dtype), and this torch cannot turn that kernel off",
            "install torch 2.3 or later (torch.backends.mha turns it off), or use torch's AMP:"
            ' AmpPrecision(opt_level="O1", backend="native")',
        )


def hand_rnns_their_input(model: Module, amp: ModuleType) -> None:
    """Let apex O1 run every ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` of ``model`` in fp16, as it does on the torch it
    was written for; call it after ``amp.initialize``.

    O1 casts an RNN's input and weights to fp16 inside torch's ``_VF`` call (apex's ``wrap.new_rnn_cast``, with
    ``utils.new_synthesize_flattened_rnn_weights``), but the module's own ``check_input`` first refuses an input
    whose dtype is not its weights' unless autocast is on (``nn.GRU`` and ``nn.RNN`` on every supported torch,
    ``nn.LSTM`` from torch 2.2), and O1's fp16 activations (a Linear's output) are that input: "RNN input dtype
    (torch.float16) does not match weight dtype (torch.float32)" ("input must have the type ..." on torch 2.1). Each RNN
    gets its fp16 input in its weights' dtype (a forward pre-hook): exact, and apex's cast makes it fp16 again, so
    the recurrence computes as if the check were not there. ``nn.RNN`` also calls ``_VF.rnn_tanh`` / ``rnn_relu``
    directly, past the ``_rnn_impls`` entries apex wraps, so apex never cast it; apex's own ``new_rnn_cast`` is
    applied to those two functions on the ``_VF`` shim apex installed, and ``nn.RNN`` computes in fp16 like the
    others. Said once on rank 0 when a model has such a module.
    """
    rnns = [module for module in model.modules() if isinstance(module, torch.nn.RNNBase)]
    new = [rnn for rnn in rnns if rnn not in _HOOKED_RNNS]
    for rnn in new:
        rnn.register_forward_pre_hook(_input_in_weight_dtype, with_kwargs=True)
        _HOOKED_RNNS.add(rnn)
    shim = torch.nn.modules.rnn._VF  # type: ignore[attr-defined]
    if type(shim).__name__ == "VariableFunctionsShim" and shim not in _CAST_SHIMS:
        for name in ("rnn_tanh", "rnn_relu"):
            amp.wrap.new_rnn_cast(name, amp._amp_state.handle)
        _CAST_SHIMS.add(shim)
    if new:
        log_once(
            "AmpPrecision: apex O1 runs RNNs in fp16 inside torch's _VF calls, after nn.LSTM / nn.GRU / nn.RNN check"
            " that their input has their weights' dtype; each RNN gets its input in fp32 for that check (apex casts"
            " it back), and nn.RNN, whose _VF call apex's patch misses, gets apex's cast"
        )


def _input_in_weight_dtype(module: Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A forward pre-hook: an fp16 input (a tensor or a PackedSequence, by position or as ``input=``) of an RNN with
    fp32 weights, in fp32."""
    given = args[0] if args else kwargs.get("input")
    data = given.data if isinstance(given, PackedSequence) else given
    weight = module.weight_ih_l0
    if not (isinstance(data, torch.Tensor) and data.dtype == torch.float16 and weight.dtype == torch.float32):
        return None
    assert given is not None
    if args:
        return (given.to(weight.dtype), *args[1:]), kwargs
    return args, {**kwargs, "input": given.to(weight.dtype)}
