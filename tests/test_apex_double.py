"""The apex test double (tests/doubles/apex) behaves as NVIDIA apex 25.05 does, including where apex bites.

Plain torch models and optimizers, no Lightning. Each test takes the double freshly imported from the
``apex_double`` fixture (``apex.amp``), which undoes O1's patching of torch afterwards.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest import CPU_FP16_MISSING, DOUBLES, free_port, needs_cpu_fp16

F = torch.nn.functional

pytestmark = pytest.mark.filterwarnings("ignore:apex.*is deprecated:FutureWarning")


def model_and_optimizer(seed: int = 0, momentum: float = 0.0) -> tuple[torch.nn.Sequential, torch.optim.SGD]:
    """Linear, BatchNorm, Linear: fp16 and fp32 parameters under O2."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def initialize(amp: ModuleType, models: Any, optimizers: Any = None, **options: Any) -> Any:
    return amp.initialize(models, optimizers, verbosity=0, **options)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator)


def backward(amp: ModuleType, model: torch.nn.Module, optimizer: Any, scale_by: float = 1.0, **kwargs: Any) -> None:
    """One forward and one backward inside ``amp.scale_loss``; ``scale_by=inf`` makes the gradients overflow."""
    x, y = batch()
    loss = F.mse_loss(model(x).float(), y) * scale_by
    with amp.scale_loss(loss, optimizer, **kwargs) as scaled:
        scaled.backward()


def loss_scales(amp: ModuleType) -> list[float]:
    return [entry["loss_scale"] for entry in amp.state_dict().values()]


# --- O2: an fp16 model, fp32 master weights ---------------------------------------------------------------------


@needs_cpu_fp16
def test_o2_casts_the_model_to_fp16_and_keeps_batchnorm_fp32(apex_double: ModuleType) -> None:
    model, _ = initialize(apex_double, *model_and_optimizer(), opt_level="O2")
    assert [p.dtype for p in model[0].parameters()] == [torch.float16] * 2
    assert [p.dtype for p in model[1].parameters()] == [torch.float32] * 2
    assert [p.dtype for p in model[2].parameters()] == [torch.float16] * 2


@needs_cpu_fp16
def test_o2_without_keep_batchnorm_fp32_casts_batchnorm_too(apex_double: ModuleType) -> None:
    model, _ = initialize(apex_double, *model_and_optimizer(), opt_level="O2", keep_batchnorm_fp32=False)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert model[1].running_mean.dtype == torch.float16


@needs_cpu_fp16
def test_o2_masters_are_separate_fp32_copies_of_the_fp16_params(apex_double: ModuleType) -> None:
    model, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O2")
    optimizer.zero_grad()  # apex builds the masters lazily: here, or at the first backward
    fp16 = [p for p in model.parameters() if p.dtype == torch.float16]
    masters = [m for m in apex_double.master_params(optimizer) if all(m is not p for p in model.parameters())]
    assert len(masters) == len(fp16) == 4
    for master, param in zip(masters, fp16, strict=True):
        assert master.dtype == torch.float32
        assert torch.equal(master, param.float())


@needs_cpu_fp16
def test_o2_step_copies_each_master_into_its_fp16_model_param(apex_double: ModuleType) -> None:
    model, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O2", loss_scale=128.0)
    before = [p.detach().clone() for p in model.parameters()]
    backward(apex_double, model, optimizer)
    optimizer.step()
    fp16 = [p for p in model.parameters() if p.dtype == torch.float16]
    masters = [m for m in apex_double.master_params(optimizer) if all(m is not p for p in model.parameters())]
    assert all(torch.equal(param, master.half()) for param, master in zip(fp16, masters, strict=True))
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


@needs_cpu_fp16
def test_o2_step_clears_the_master_gradients(apex_double: ModuleType) -> None:
    model, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O2", loss_scale=128.0)
    backward(apex_double, model, optimizer)
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in apex_double.master_params(optimizer))
    optimizer.step()
    assert [m for m in optimizer._amp_stash.all_fp32_from_fp16_params if m.grad is not None] == []


@needs_cpu_fp16
def test_o2_zero_grad_fails_on_a_gradient_that_is_a_view_as_apex_does(apex_double: ModuleType) -> None:
    model, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O2")
    weight = model[0].weight
    # What torch DDP's gradient_as_bucket_view does: the gradient is a view into a bigger communication bucket.
    bucket = torch.zeros(weight.numel() + 8, dtype=weight.dtype)
    weight.grad = bucket[: weight.numel()].view_as(weight)
    with pytest.raises(RuntimeError, match="Can't detach views in-place"):
        optimizer.zero_grad()


@needs_cpu_fp16
def test_o2_zero_grad_takes_no_set_to_none(apex_double: ModuleType) -> None:
    _, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O2")
    with pytest.raises(TypeError, match="set_to_none"):
        optimizer.zero_grad(set_to_none=True)


@needs_cpu_fp16
def test_o2_step_rejects_a_closure(apex_double: ModuleType) -> None:
    _, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O2")
    with pytest.raises(RuntimeError, match="Amp does not support closure use with optimizers"):
        optimizer.step(lambda: 0.0)


@needs_cpu_fp16
def test_o2_forward_casts_inputs_to_fp16_and_outputs_to_fp32(apex_double: ModuleType) -> None:
    model, _ = initialize(apex_double, *model_and_optimizer(), opt_level="O2")
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].dtype))
    output = model(batch()[0])
    assert (seen, output.dtype) == ([torch.float16], torch.float32)


@needs_cpu_fp16
def test_o2_cast_model_outputs_chooses_the_output_dtype(apex_double: ModuleType) -> None:
    model, _ = initialize(apex_double, *model_and_optimizer(), opt_level="O2", cast_model_outputs=torch.float16)
    assert model(batch()[0]).dtype == torch.float16


@needs_cpu_fp16
def test_o2_state_dict_holds_fp32_tensors(apex_double: ModuleType) -> None:
    model, _ = initialize(apex_double, *model_and_optimizer(), opt_level="O2")
    assert {v.dtype for v in model.state_dict().values() if v.is_floating_point()} == {torch.float32}


@needs_cpu_fp16
def test_o2_moves_existing_optimizer_state_to_the_fp32_masters(apex_double: ModuleType) -> None:
    model, optimizer = model_and_optimizer(momentum=0.9)
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    optimizer.step()  # momentum buffers exist before amp.initialize
    model, optimizer = initialize(apex_double, model, optimizer, opt_level="O2")
    optimizer.zero_grad()
    masters = list(apex_double.master_params(optimizer))
    assert {id(key) for key in optimizer.state} == {id(master) for master in masters}
    assert {optimizer.state[m]["momentum_buffer"].dtype for m in masters} == {torch.float32}


@needs_cpu_fp16
def test_o2_add_param_group_adds_fp32_masters_of_fp16_params(apex_double: ModuleType) -> None:
    _, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O2")
    extra = torch.nn.Linear(2, 2).half()
    optimizer.add_param_group({"params": extra.parameters()})
    added = optimizer.param_groups[-1]["params"]
    assert [p.dtype for p in added] == [torch.float32, torch.float32]
    assert all(a is not p for a in added for p in extra.parameters())


# --- O1: torch functions patched for the process ---------------------------------------------------------------


@needs_cpu_fp16
def test_o1_linear_computes_in_fp16(apex_double: ModuleType) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.float16


@needs_cpu_fp16
def test_o1_softmax_computes_in_fp32(apex_double: ModuleType) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert F.softmax(torch.ones(2, 3, dtype=torch.float16), dim=1).dtype == torch.float32


@needs_cpu_fp16
@pytest.mark.parametrize("call", ["torch.add", "Tensor.__add__", "torch.cat", "torch.stack"])
def test_o1_promotes_mixed_fp16_and_fp32_arguments_to_fp32(apex_double: ModuleType, call: str) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    half, single = torch.ones(2, dtype=torch.float16), torch.ones(2)
    promoted = {
        "torch.add": lambda: torch.add(half, single),
        "Tensor.__add__": lambda: half + single,
        "torch.cat": lambda: torch.cat([half, single]),
        "torch.stack": lambda: torch.stack([half, single]),
    }[call]()
    assert promoted.dtype == torch.float32


@needs_cpu_fp16
def test_o1_leaves_the_model_weights_fp32(apex_double: ModuleType) -> None:
    model, _ = initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@needs_cpu_fp16
def test_o1_scale_loss_clears_the_cache_of_cast_weights(apex_double: ModuleType) -> None:
    model, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    backward(apex_double, model, optimizer)
    assert apex_double._amp_state.handle.cache == {}


@needs_cpu_fp16
def test_o1_a_weight_used_twice_between_scale_loss_calls_fails_as_in_apex(apex_double: ModuleType) -> None:
    # apex 25.05's cache check reads grad_fn.next_functions[1], which a cast has not had since torch 1.12.
    model, _ = initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    model(batch()[0])
    with pytest.raises(IndexError, match="tuple index out of range"):
        model(batch()[0])


@needs_cpu_fp16
def test_o1_optimizer_step_runs_with_casts_disabled(apex_double: ModuleType) -> None:
    seen: list[torch.dtype] = []

    class Probe(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            seen.append(F.linear(torch.ones(1, 2), torch.ones(1, 2)).dtype)
            return super().step(closure)

    model, _ = model_and_optimizer()
    model, optimizer = initialize(apex_double, model, Probe(model.parameters(), lr=0.1), opt_level="O1")
    optimizer.step()
    assert (seen, F.linear(torch.ones(1, 2), torch.ones(1, 2)).dtype) == ([torch.float32], torch.float16)


@needs_cpu_fp16
def test_unpatch_torch_for_tests_puts_back_the_original_functions(apex_double: ModuleType) -> None:
    originals = (F.linear, torch.cat, torch.Tensor.__add__, torch.Tensor.sum)
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert F.linear is not originals[0]
    apex_double.unpatch_torch_for_tests()
    assert (F.linear, torch.cat, torch.Tensor.__add__, torch.Tensor.sum) == originals
    assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.float32


@pytest.mark.parametrize(
    ("call", "words"),
    [
        ("F.binary_cross_entropy", "amp does not work out-of-the-box with `F.binary_cross_entropy`"),
        ("Tensor.exp_", "Cannot call in-place method exp_ on fp16 Tensors"),
        ("torch.exp_", "Cannot call in-place function exp_ with fp16 arguments"),
        ("torch.add", "Do not know how to handle these types to promote"),
    ],
)
def test_o1_refuses_what_apex_refuses(apex_double: ModuleType, call: str, words: str) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    half = torch.full((2,), 0.5, dtype=torch.float16)
    calls = {
        "F.binary_cross_entropy": lambda: F.binary_cross_entropy(half, half),
        "Tensor.exp_": lambda: half.exp_(),
        "torch.exp_": lambda: torch.exp_(half),
        "torch.add": lambda: torch.add(half, half.double()),  # fp16 with fp64: apex promotes only fp16 with fp32
    }
    with pytest.raises(NotImplementedError, match=words):
        calls[call]()


def promote_error(first: str, second: str) -> str:
    """apex's whole promote message, for a set of two type strings in either order."""
    pair = f"('{first}', '{second}'|'{second}', '{first}')"
    return rf"^Do not know how to handle these types to promote: \{{{pair}\}}$"


@pytest.mark.parametrize(
    "call", ["/", "Tensor.__div__", "Tensor.__rtruediv__", "torch.div", "+", "-", "*", "+=", "<", "=="]
)
def test_o1_refuses_fp32_mixed_with_fp64_as_apexs_promote_does(apex_double: ModuleType, call: str) -> None:
    # Lightning's epoch mean, value / cumulated_batch_size, meets this when the count is a float64 tensor.
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    single, double = torch.ones(2), torch.tensor(2.0, dtype=torch.float64)
    calls = {
        "/": lambda: single / double,
        "Tensor.__div__": lambda: single.__div__(double),
        "Tensor.__rtruediv__": lambda: single.__rtruediv__(double),
        "torch.div": lambda: torch.div(single, double),
        "+": lambda: single + double,
        "-": lambda: double - single,
        "*": lambda: single * double,
        "+=": lambda: single.__iadd__(double),
        "<": lambda: single < double,
        "==": lambda: single == double,
    }
    with pytest.raises(NotImplementedError, match=promote_error("FloatTensor", "DoubleTensor")):
        calls[call]()


@pytest.mark.parametrize(
    ("dtypes", "types"),
    [
        ((torch.float16, torch.float64), ("HalfTensor", "DoubleTensor")),
        ((torch.bfloat16, torch.float32), ("BFloat16Tensor", "FloatTensor")),
        ((torch.bfloat16, torch.float16), ("BFloat16Tensor", "HalfTensor")),
    ],
)
def test_o1_refuses_every_floating_mix_but_fp16_with_fp32(
    apex_double: ModuleType, dtypes: tuple[torch.dtype, torch.dtype], types: tuple[str, str]
) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    with pytest.raises(NotImplementedError, match=promote_error(*types)):
        torch.ones(2, dtype=dtypes[0]) + torch.ones(2, dtype=dtypes[1])


@pytest.mark.parametrize(
    ("call", "dtype"),
    [
        ("long / 2", torch.float32),
        ("long / long", torch.float32),
        ("float / long", torch.float32),
        ("double / long", torch.float64),
        ("float < long", torch.bool),
        pytest.param("half / long", torch.float16, marks=needs_cpu_fp16),
    ],
)
def test_o1_leaves_integer_tensors_out_of_promotion(apex_double: ModuleType, call: str, dtype: torch.dtype) -> None:
    # utils.py collect_fp_tensor_types collects floating tensors only: one floating type passes to torch.
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    long = torch.tensor([3, 4])
    calls = {
        "long / 2": lambda: long / 2,
        "long / long": lambda: long / long,
        "float / long": lambda: torch.ones(2) / long,
        "double / long": lambda: torch.ones(2, dtype=torch.float64) / long,
        "float < long": lambda: torch.ones(2) < long,
        "half / long": lambda: torch.ones(2, dtype=torch.float16) / long,
    }
    assert calls[call]().dtype == dtype


@pytest.mark.parametrize("fn", ["cat", "stack"])
def test_o1_cat_and_stack_pass_other_floating_mixes_to_torch(apex_double: ModuleType, fn: str) -> None:
    # wrap.py sequence_promote promotes fp16 with fp32 only and, unlike promote, passes any other mix through.
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert getattr(torch, fn)([torch.ones(2), torch.ones(2, dtype=torch.float64)]).dtype == torch.float64


def test_o1_promotion_is_off_while_casts_are_disabled(apex_double: ModuleType) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    with apex_double.disable_casts():
        assert (torch.ones(2) / torch.ones(2, dtype=torch.float64)).dtype == torch.float64


def test_o1_in_place_methods_cast_to_their_tensor_where_in_place_operators_promote(apex_double: ModuleType) -> None:
    # add_ is wrapped by promote_match_arg0 (its argument becomes fp32); += (__iadd__) is on the CASTS list.
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    single, double = torch.ones(2), torch.tensor(2.0, dtype=torch.float64)
    assert single.add_(double).tolist() == [3.0, 3.0]
    with pytest.raises(NotImplementedError, match=promote_error("FloatTensor", "DoubleTensor")):
        single += double


@needs_cpu_fp16
@pytest.mark.parametrize(
    "call",
    [
        "F.mse_loss",
        "F.cross_entropy",
        "F.log_softmax",
        "F.layer_norm",
        "F.gelu",
        "Tensor.sum",
        "Tensor.cpu",
        "**",
        "number / Tensor",
    ],
)
def test_o1_fp32_list_functions_compute_in_fp32(apex_double: ModuleType, call: str) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    half = torch.full((2, 3), 0.5, dtype=torch.float16)
    calls = {
        "F.mse_loss": lambda: F.mse_loss(half, half),
        "F.cross_entropy": lambda: F.cross_entropy(half, torch.tensor([0, 2])),
        "F.log_softmax": lambda: F.log_softmax(half, dim=1),
        "F.layer_norm": lambda: torch.nn.LayerNorm(3)(half),
        "F.gelu": lambda: torch.nn.GELU()(half),
        "Tensor.sum": lambda: half.sum(),
        "Tensor.cpu": lambda: half.cpu(),
        "**": lambda: half**2,
        "number / Tensor": lambda: 1 / half,  # torch's Tensor.__rdiv__ calls reciprocal, on the fp32 list
    }
    assert calls[call]().dtype == torch.float32


@needs_cpu_fp16
@pytest.mark.parametrize("call", ["F.batch_norm", "F.dropout", "F.relu", "torch.sigmoid", "Tensor.mean"])
def test_o1_leaves_functions_off_its_lists_to_torch(apex_double: ModuleType, call: str) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    half = torch.full((4, 3), 0.5, dtype=torch.float16)
    calls = {
        "F.batch_norm": lambda: torch.nn.BatchNorm1d(3)(half),  # fp32 weights and running stats, as apex leaves them
        "F.dropout": lambda: F.dropout(half, 0.5),
        "F.relu": lambda: F.relu(half),
        "torch.sigmoid": lambda: torch.sigmoid(half),
        "Tensor.mean": lambda: half.mean(),
    }
    assert calls[call]().dtype == torch.float16


@pytest.mark.parametrize("call", ["F.binary_cross_entropy", "nn.BCELoss", "an fp16 target"])
def test_o1_binary_cross_entropy_refuses_fp16_with_apexs_message(apex_double: ModuleType, call: str) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    half, single = torch.full((2,), 0.5, dtype=torch.float16), torch.full((2,), 0.5)
    calls = {
        "F.binary_cross_entropy": lambda: F.binary_cross_entropy(half, single),
        "nn.BCELoss": lambda: torch.nn.BCELoss()(half, single),
        "an fp16 target": lambda: F.binary_cross_entropy(single, half),
    }
    with pytest.raises(NotImplementedError) as refused:
        calls[call]()
    message = str(refused.value)
    assert message.startswith("\namp does not work out-of-the-box with `F.binary_cross_entropy`")
    assert message.endswith("disable this warning by passing allow_banned=True to `amp.init()`.")


def test_o1_binary_cross_entropy_refuses_fp16_even_while_casts_are_disabled(apex_double: ModuleType) -> None:
    # wrap.py err_if_any_half does not ask the handle whether casts are active.
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    half = torch.full((2,), 0.5, dtype=torch.float16)
    with apex_double.disable_casts(), pytest.raises(NotImplementedError, match="binary_cross_entropy"):
        F.binary_cross_entropy(half, half)


@needs_cpu_fp16
def test_o1_without_gradients_weight_casts_are_cached_and_reused(apex_double: ModuleType) -> None:
    model, _ = initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    cache = apex_double._amp_state.handle.cache
    with torch.no_grad():
        model(batch()[0])
        first = dict(cache)
        model(batch()[0])
    linears = [model[0].weight, model[0].bias, model[2].weight, model[2].bias]
    assert set(first) == set(linears)
    assert all(cache[weight] is first[weight] and cache[weight].dtype == torch.float16 for weight in linears)


@needs_cpu_fp16
def test_o1_a_weight_cast_cached_without_gradients_is_redone_with_gradients(apex_double: ModuleType) -> None:
    # Validation casts without gradients; the next training forward must not reuse them (it could not backpropagate).
    model, _ = initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    with torch.no_grad():
        model(batch()[0])
    model(batch()[0])
    assert apex_double._amp_state.handle.cache[model[0].weight].requires_grad


@needs_cpu_fp16
def test_o1_caches_the_casts_of_fp32_parameters_only(apex_double: ModuleType) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    F.linear(torch.ones(2, 3), torch.ones(4, 3), torch.ones(4))
    assert apex_double._amp_state.handle.cache == {}


@needs_cpu_fp16
def test_o1_transformer_encoder_layer_eval_fast_path_fails_on_fp16_activations_as_in_apex(
    apex_double: ModuleType,
) -> None:
    # apex patches F.linear (its fp16 output feeds the layer) but not torch._transformer_encoder_layer_fwd, the
    # layer's fast path without gradients, which then multiplies fp16 activations by fp32 weights.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, activation="gelu", batch_first=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), layer)
    model, _ = initialize(apex_double, model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")
    model.eval()
    with (
        torch.no_grad(),
        pytest.raises(RuntimeError, match=r"expected (m1 and m2|mat1 and mat2) to have the same dtype"),
    ):
        model(torch.randn(2, 5, 4))


# --- O1: RNNs and RNN cells (rnn_compat.py, wrap.py new_rnn_cast) -------------------------------------------------

#: How an RNN is built (4 features in, 6 hidden) and called, beyond one layer on a padded fp32 input.
RNN_SHAPES: dict[str, dict[str, Any]] = {
    "one layer": {},
    "batch_first": {"batch_first": True},
    "two layers": {"num_layers": 2},
    "bidirectional": {"bidirectional": True},
    "an initial state": {},
    "a PackedSequence": {},
}


def rnn_module(kind: str, **options: Any) -> torch.nn.RNNBase:
    torch.manual_seed(0)
    module: torch.nn.RNNBase = getattr(torch.nn, kind)(4, 6, **options)
    return module


def rnn_args(kind: str, shape: str) -> tuple[Any, ...]:
    """fp32 arguments for an RNN built with ``RNN_SHAPES[shape]``: 5 steps of a batch of 3, and an initial state
    (``(h0, c0)`` for an LSTM) for "an initial state"."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 4, generator=generator)
    if shape == "a PackedSequence":
        return (torch.nn.utils.rnn.pack_padded_sequence(x, [5, 4, 2]),)
    if shape == "an initial state":
        h0, c0 = torch.randn(2, 1, 3, 6, generator=generator)
        return x, ((h0, c0) if kind == "LSTM" else h0)
    return (x,)


def to_half(arg: Any) -> Any:
    if isinstance(arg, torch.nn.utils.rnn.PackedSequence):  # a tuple too
        return arg.half()
    return tuple(to_half(a) for a in arg) if isinstance(arg, tuple) else arg.half()


def output_data(output: Any) -> torch.Tensor:
    return output.data if isinstance(output, torch.nn.utils.rnn.PackedSequence) else output


def fp16_twin(rnn: torch.nn.Module, *args: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What an fp16 copy of ``rnn`` computes from ``args`` made fp16 by hand, before O1 patches torch: its output,
    and its weights' gradients of the output's sum in fp32."""
    twin = copy.deepcopy(rnn).half()
    output = output_data(twin(*[to_half(arg) for arg in args])[0])
    output.float().sum().backward()
    return output, [param.grad.float() for param in twin.parameters()]


def initialize_rnn(amp: ModuleType, rnn: torch.nn.Module) -> torch.nn.Module:
    rnn, _ = initialize(amp, rnn, torch.optim.SGD(rnn.parameters(), lr=0.1), opt_level="O1")
    return rnn


@needs_cpu_fp16  # and torch's message as torch 2.2 and later word it (2.1: "input must have the type ...")
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_o1_rnns_refuse_an_fp16_input_with_torchs_dtype_check(apex_double: ModuleType, kind: str) -> None:
    # O1 does not turn autocast on, so RNNBase.check_input sees fp16 activations and fp32 weights, as with apex.
    rnn = initialize_rnn(apex_double, rnn_module(kind))
    expected = "RNN input dtype (torch.float16) does not match weight dtype (torch.float32)"
    with pytest.raises(ValueError, match=re.escape(expected)):
        rnn(torch.randn(5, 3, 4, dtype=torch.float16))


@needs_cpu_fp16
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_o1_lstm_and_gru_fed_fp32_compute_in_fp16(apex_double: ModuleType, kind: str) -> None:
    rnn = initialize_rnn(apex_double, rnn_module(kind))
    output, hidden = rnn(torch.randn(5, 3, 4))
    hiddens = hidden if isinstance(hidden, tuple) else (hidden,)
    assert {output.dtype, *(h.dtype for h in hiddens)} == {torch.float16}


@needs_cpu_fp16
@pytest.mark.parametrize("shape", list(RNN_SHAPES))
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_o1_rnns_compute_what_a_hand_built_fp16_copy_computes(apex_double: ModuleType, kind: str, shape: str) -> None:
    # nn.RNN after new_rnn_cast("rnn_tanh", ...), the apex call that puts O1's cast where nn.RNN calls.
    rnn = rnn_module(kind, **RNN_SHAPES[shape])
    args = rnn_args(kind, shape)
    expected, _ = fp16_twin(rnn, *args)
    rnn = initialize_rnn(apex_double, rnn)
    if kind == "RNN":
        apex_double.wrap.new_rnn_cast("rnn_tanh", apex_double._amp_state.handle)
    output = output_data(rnn(*args)[0])
    assert output.dtype == torch.float16
    assert torch.equal(output, expected)


@needs_cpu_fp16
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_o1_rnn_gradients_reach_the_fp32_weights_as_a_hand_built_fp16_copy_computes_them(
    apex_double: ModuleType, kind: str
) -> None:
    rnn = rnn_module(kind, num_layers=2, bidirectional=True)
    x = torch.randn(5, 3, 4)
    _, expected = fp16_twin(rnn, x)
    rnn = initialize_rnn(apex_double, rnn)
    rnn(x)[0].float().sum().backward()
    grads = [param.grad for param in rnn.parameters()]
    assert {grad.dtype for grad in grads} == {torch.float32}
    assert all(torch.equal(grad, want) for grad, want in zip(grads, expected, strict=True))


@needs_cpu_fp16
@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_o1_nn_rnn_fed_fp32_computes_in_fp32_as_apexs_rnn_impls_patch_never_reaches_it(
    apex_double: ModuleType, nonlinearity: str
) -> None:
    rnn = initialize_rnn(apex_double, rnn_module("RNN", nonlinearity=nonlinearity))
    assert rnn(torch.randn(5, 3, 4))[0].dtype == torch.float32


@needs_cpu_fp16
@pytest.mark.parametrize("name", ["RNN_TANH", "RNN_RELU"])
def test_o1_casts_the_rnn_impls_entries_to_fp16(apex_double: ModuleType, name: str) -> None:
    rnn = initialize_rnn(apex_double, rnn_module("RNN"))
    call = (torch.randn(5, 3, 4), torch.zeros(1, 3, 6), rnn._flat_weights, True, 1, 0.0, False, False, False)
    assert torch.nn.modules.rnn._rnn_impls[name](*call)[0].dtype == torch.float16


@needs_cpu_fp16
@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_new_rnn_cast_of_the_lower_case_name_makes_nn_rnn_compute_in_fp16(
    apex_double: ModuleType, nonlinearity: str
) -> None:
    rnn = initialize_rnn(apex_double, rnn_module("RNN", nonlinearity=nonlinearity))
    apex_double.wrap.new_rnn_cast(f"rnn_{nonlinearity}", apex_double._amp_state.handle)
    assert rnn(torch.randn(5, 3, 4))[0].dtype == torch.float16


def test_new_rnn_cast_of_a_name_outside_rnn_impls_needs_o1s_shim(apex_double: ModuleType) -> None:
    with pytest.raises(AssertionError):
        apex_double.wrap.new_rnn_cast("rnn_tanh", apex_double.handle.AmpHandle())


@needs_cpu_fp16
def test_the_rnn_cast_holds_torch_to_its_nine_argument_call(apex_double: ModuleType) -> None:
    rnn = initialize_rnn(apex_double, rnn_module("LSTM"))
    with pytest.raises(AssertionError):
        torch.nn.modules.rnn._VF.lstm(torch.randn(5, 3, 4), (torch.zeros(1, 3, 6),) * 2, rnn._flat_weights)


@needs_cpu_fp16
def test_o1_rnns_compute_in_fp32_while_casts_are_disabled(apex_double: ModuleType) -> None:
    rnn = initialize_rnn(apex_double, rnn_module("LSTM"))
    with apex_double.disable_casts():
        assert rnn(torch.randn(5, 3, 4))[0].dtype == torch.float32


@needs_cpu_fp16
@pytest.mark.parametrize(
    "cell",
    [
        torch.nn.LSTMCell(4, 6),
        torch.nn.GRUCell(4, 6),
        torch.nn.RNNCell(4, 6),
        torch.nn.RNNCell(4, 6, nonlinearity="relu"),
    ],
    ids=["LSTMCell", "GRUCell", "RNNCell tanh", "RNNCell relu"],
)
def test_o1_rnn_cells_fed_fp32_compute_in_fp16(apex_double: ModuleType, cell: torch.nn.Module) -> None:
    cell = initialize_rnn(apex_double, copy.deepcopy(cell))
    output = cell(torch.randn(3, 4))
    outputs = output if isinstance(output, tuple) else (output,)
    assert {o.dtype for o in outputs} == {torch.float16}


@needs_cpu_fp16
def test_o1_an_rnn_cell_stepped_twice_between_scale_loss_calls_fails_as_in_apex(apex_double: ModuleType) -> None:
    # whitelist_rnn_cells casts the cell's weights through the cache, whose check fails on a second use (IndexError,
    # as for test_o1_a_weight_used_twice_between_scale_loss_calls_fails_as_in_apex): a loop over steps fails.
    cell = initialize_rnn(apex_double, torch.nn.GRUCell(4, 6))
    hidden = cell(torch.randn(3, 4))
    with pytest.raises(IndexError, match="tuple index out of range"):
        cell(torch.randn(3, 4), hidden)


def test_unpatch_torch_for_tests_puts_back_torchs_vf_and_rnn_impls(apex_double: ModuleType) -> None:
    rnn = torch.nn.modules.rnn
    impls = dict(rnn._rnn_impls)
    initialize_rnn(apex_double, rnn_module("LSTM"))
    assert rnn._VF is not torch._VF
    apex_double.unpatch_torch_for_tests()
    assert (rnn._VF, rnn._rnn_impls) == (torch._VF, impls)


# --- the user's registrations and decorators (amp.py) -------------------------------------------------------------


def registries(amp: ModuleType) -> tuple[set[Any], set[Any]]:
    """apex.amp.amp's ``_USER_CAST_REGISTRY`` and ``_USER_PROMOTE_REGISTRY``."""
    module = sys.modules[f"{amp.__name__}.amp"]
    return module._USER_CAST_REGISTRY, module._USER_PROMOTE_REGISTRY


def einsum_of_fp16_and_a_parameter() -> torch.Tensor:
    return torch.einsum("ij,jk->ik", torch.ones(2, 3, dtype=torch.float16), torch.nn.Parameter(torch.ones(3, 4)))


@needs_cpu_fp16
def test_o1_einsum_of_an_fp16_activation_and_an_fp32_parameter_fails_in_torch(apex_double: ModuleType) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    with pytest.raises(RuntimeError, match="expected scalar type Half but found Float"):
        einsum_of_fp16_and_a_parameter()


@needs_cpu_fp16
def test_register_promote_function_before_initialize_makes_einsum_promote_to_fp32(apex_double: ModuleType) -> None:
    apex_double.register_promote_function(torch, "einsum")
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert torch.equal(einsum_of_fp16_and_a_parameter(), torch.full((2, 4), 3.0))


@needs_cpu_fp16
def test_register_float_function_before_initialize_makes_sigmoid_compute_in_fp32(apex_double: ModuleType) -> None:
    apex_double.register_float_function(torch, "sigmoid")
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert torch.sigmoid(torch.zeros(2, dtype=torch.float16)).dtype == torch.float32


@needs_cpu_fp16
def test_register_half_function_before_initialize_makes_tanh_compute_in_fp16(apex_double: ModuleType) -> None:
    apex_double.register_half_function(torch, "tanh")
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert torch.tanh(torch.zeros(2)).dtype == torch.float16


@needs_cpu_fp16
def test_a_registered_listed_function_casts_as_registered_since_registrations_are_patched_first(
    apex_double: ModuleType,
) -> None:
    # init patches the registry before the lists: exp's fp32-list wrapper goes outside the user's fp16 cast.
    apex_double.register_half_function(torch, "exp")
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert torch.exp(torch.zeros(2)).dtype == torch.float16


@pytest.mark.parametrize("register", ["register_half_function", "register_float_function", "register_promote_function"])
def test_registering_a_missing_function_is_apexs_value_error(apex_double: ModuleType, register: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"No function named nope in module {torch}.")):
        getattr(apex_double, register)(torch, "nope")


def test_o1_initialize_empties_the_registries(apex_double: ModuleType) -> None:
    apex_double.register_float_function(torch, "sigmoid")
    apex_double.register_promote_function(torch, "einsum")
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert registries(apex_double) == (set(), set())


@needs_cpu_fp16
def test_o2_leaves_the_registrations_for_a_later_o1_initialize(apex_double: ModuleType) -> None:
    apex_double.register_promote_function(torch, "einsum")
    initialize(apex_double, *model_and_optimizer(), opt_level="O2")
    assert registries(apex_double) == (set(), {(torch, "einsum")})


@needs_cpu_fp16
def test_a_function_registered_after_initialize_stays_as_it_was(apex_double: ModuleType) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    apex_double.register_float_function(torch, "sigmoid")
    assert torch.sigmoid(torch.zeros(2, dtype=torch.float16)).dtype == torch.float16


@needs_cpu_fp16
def test_the_next_o1_initialize_applies_a_registration_made_after_the_first(apex_double: ModuleType) -> None:
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    apex_double.register_float_function(torch, "sigmoid")
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    assert torch.sigmoid(torch.zeros(2, dtype=torch.float16)).dtype == torch.float32


def decorated(amp: ModuleType, decorator: str) -> Any:
    """``torch.add`` through one of amp's decorators."""
    return getattr(amp, decorator)(torch.add)


#: Each decorator, the arguments it is called with, and the dtype it computes in under O1.
DECORATED_CALLS = {
    "half_function": ((torch.ones(2), torch.ones(2)), torch.float16),
    "float_function": ((torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.float16)), torch.float32),
    "promote_function": ((torch.ones(2, dtype=torch.float16), torch.ones(2)), torch.float32),
}


@needs_cpu_fp16
@pytest.mark.parametrize("decorator", list(DECORATED_CALLS))
def test_a_decorated_function_casts_once_o1_is_initialized(apex_double: ModuleType, decorator: str) -> None:
    function = decorated(apex_double, decorator)
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    args, dtype = DECORATED_CALLS[decorator]
    assert function(*args).dtype == dtype


@needs_cpu_fp16
@pytest.mark.parametrize("decorator", ["half_function", "float_function"])
def test_a_decorated_function_runs_uncast_before_initialize(apex_double: ModuleType, decorator: str) -> None:
    args, dtype = DECORATED_CALLS[decorator]
    assert decorated(apex_double, decorator)(*args).dtype != dtype


@needs_cpu_fp16
@pytest.mark.parametrize("decorator", ["half_function", "float_function"])
def test_a_decorated_function_runs_uncast_while_casts_are_disabled(apex_double: ModuleType, decorator: str) -> None:
    function = decorated(apex_double, decorator)
    initialize(apex_double, *model_and_optimizer(), opt_level="O1")
    args, dtype = DECORATED_CALLS[decorator]
    with apex_double.disable_casts():
        assert function(*args).dtype != dtype


def test_decorating_warns_that_apex_amp_is_deprecated(apex_double: ModuleType) -> None:
    with pytest.warns(FutureWarning, match="apex.amp is deprecated"):
        apex_double.half_function(torch.add)


# --- the loss scaler ---------------------------------------------------------------------------------------------


def scalar_model(amp: ModuleType, **options: Any) -> tuple[torch.nn.Parameter, torch.optim.SGD]:
    """One fp32 weight, fp32 compute (O0) with the loss scaling given: thousands of steps cost well under a second."""
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    initialize(amp, torch.nn.ParameterList([weight]), optimizer, opt_level="O0", **options)
    return weight, optimizer


def clean_steps(amp: ModuleType, weight: torch.Tensor, optimizer: Any, steps: int) -> None:
    for _ in range(steps):
        with amp.scale_loss(weight.sum(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_dynamic_loss_scale_starts_at_2_to_the_16(apex_double: ModuleType) -> None:
    scalar_model(apex_double, loss_scale="dynamic")
    assert loss_scales(apex_double) == [2.0**16]


def test_a_dynamic_loss_scale_starts_at_max_loss_scale_when_that_is_lower(apex_double: ModuleType) -> None:
    scalar_model(apex_double, loss_scale="dynamic", max_loss_scale=1024.0)
    assert loss_scales(apex_double) == [1024.0]


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_gradient_skips_the_step_and_halves_the_scale(apex_double: ModuleType, bad: float) -> None:
    model, optimizer = model_and_optimizer()
    model, optimizer = initialize(apex_double, model, optimizer, opt_level="O0", loss_scale="dynamic")
    before = [p.detach().clone() for p in model.parameters()]
    backward(apex_double, model, optimizer, scale_by=bad)
    optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert loss_scales(apex_double) == [2.0**15]


def test_the_skip_replaces_only_the_next_step(apex_double: ModuleType) -> None:
    model, optimizer = model_and_optimizer()
    model, optimizer = initialize(apex_double, model, optimizer, opt_level="O0", loss_scale="dynamic")
    backward(apex_double, model, optimizer, scale_by=float("inf"))
    optimizer.step()
    before = model[2].weight.detach().clone()
    optimizer.zero_grad()
    backward(apex_double, model, optimizer)
    optimizer.step()
    assert not torch.equal(before, model[2].weight)


def test_the_skipped_step_refuses_a_closure(apex_double: ModuleType) -> None:
    model, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O0", loss_scale="dynamic")
    backward(apex_double, model, optimizer, scale_by=float("inf"))
    with pytest.raises(RuntimeError, match="Amp does not support closure use with optimizers"):
        optimizer.step(lambda: 0.0)


def test_the_scale_doubles_after_2000_clean_steps_and_not_before(apex_double: ModuleType) -> None:
    weight, optimizer = scalar_model(apex_double, loss_scale="dynamic")
    clean_steps(apex_double, weight, optimizer, 1999)
    assert apex_double.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**16, "unskipped": 1999}
    clean_steps(apex_double, weight, optimizer, 1)
    assert apex_double.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**17, "unskipped": 0}


def test_the_scale_never_grows_past_max_loss_scale(apex_double: ModuleType) -> None:
    weight, optimizer = scalar_model(apex_double, loss_scale="dynamic", max_loss_scale=1024.0)
    clean_steps(apex_double, weight, optimizer, 2000)
    assert apex_double.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 0}


def test_an_overflow_never_halves_the_scale_below_min_loss_scale(apex_double: ModuleType) -> None:
    model, optimizer = model_and_optimizer()
    model, optimizer = initialize(
        apex_double, model, optimizer, opt_level="O0", loss_scale="dynamic", min_loss_scale=2.0**16
    )
    backward(apex_double, model, optimizer, scale_by=float("inf"))
    assert loss_scales(apex_double) == [2.0**16]


def test_each_loss_has_its_own_scaler(apex_double: ModuleType) -> None:
    model, optimizer = model_and_optimizer()
    model, optimizer = initialize(apex_double, model, optimizer, opt_level="O0", loss_scale="dynamic", num_losses=2)
    backward(apex_double, model, optimizer, loss_id=0)
    backward(apex_double, model, optimizer, scale_by=float("inf"), loss_id=1)
    assert loss_scales(apex_double) == [2.0**16, 2.0**15]


def test_a_loss_id_beyond_num_losses_fails_as_in_apex(apex_double: ModuleType) -> None:
    weight, optimizer = scalar_model(apex_double, loss_scale="dynamic", num_losses=2)
    with pytest.raises(IndexError), apex_double.scale_loss(weight.sum(), optimizer, loss_id=2):
        pass


def test_a_static_loss_scale_of_one_never_checks_for_overflow(apex_double: ModuleType) -> None:
    # apex's short cut without master weights: nothing is unscaled or checked, so nothing is skipped.
    model, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O0")
    backward(apex_double, model, optimizer, scale_by=float("inf"))
    optimizer.step()
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    assert [e for e in apex_double.events if e["event"] in ("overflow", "skipped_step")] == []


def test_delay_unscale_leaves_the_gradients_scaled_until_a_later_scale_loss(apex_double: ModuleType) -> None:
    weight, optimizer = scalar_model(apex_double, loss_scale=128.0)
    with apex_double.scale_loss(weight.sum() * 3, optimizer, delay_unscale=True) as scaled:
        scaled.backward()
    assert weight.grad.tolist() == [3.0 * 128]
    with apex_double.scale_loss(weight.sum() * 5, optimizer) as scaled:
        scaled.backward()
    assert weight.grad.tolist() == [8.0]


def test_gradients_from_earlier_backwards_are_stashed_and_added_back(apex_double: ModuleType) -> None:
    weight, optimizer = scalar_model(apex_double, loss_scale=128.0)
    for factor in (3, 5):
        with apex_double.scale_loss(weight.sum() * factor, optimizer) as scaled:
            scaled.backward()
    assert weight.grad.tolist() == [8.0]


def test_state_dict_has_apex_format(apex_double: ModuleType) -> None:
    model, optimizer = model_and_optimizer()
    initialize(apex_double, model, optimizer, opt_level="O0", loss_scale="dynamic", num_losses=2)
    state = apex_double.state_dict()
    assert type(state) is OrderedDict
    assert state == {
        "loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0},
        "loss_scaler1": {"loss_scale": 65536.0, "unskipped": 0},
    }
    assert type(state["loss_scaler0"]["loss_scale"]) is float and type(state["loss_scaler0"]["unskipped"]) is int


def test_state_dict_before_initialize_fails_as_in_apex(apex_double: ModuleType) -> None:
    with pytest.raises(AttributeError, match="loss_scalers"):
        apex_double.state_dict()


def test_load_state_dict_takes_the_entries_in_order_and_skips_extra_ones(apex_double: ModuleType) -> None:
    scalar_model(apex_double, loss_scale="dynamic")
    apex_double.load_state_dict(
        {"loss_scaler7": {"loss_scale": 8.0, "unskipped": 3}, "loss_scaler0": {"loss_scale": 4.0, "unskipped": 1}}
    )
    assert apex_double.state_dict()["loss_scaler0"] == {"loss_scale": 8.0, "unskipped": 3}


def test_load_state_dict_refuses_other_keys_after_loading_the_scalers(apex_double: ModuleType) -> None:
    scalar_model(apex_double, loss_scale="dynamic")
    with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "scale"'):
        apex_double.load_state_dict({"scale": 2.0, "loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}})
    assert loss_scales(apex_double) == [8.0]


# --- initialize ---------------------------------------------------------------------------------------------------

SHAPES = {
    "model, optimizer": (False, False),
    "model, [optimizer]": (False, True),
    "[model], optimizer": (True, False),
    "[model], [optimizer]": (True, True),
    "model, None": (False, None),
    "[model], None": (True, None),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_initialize_returns_what_it_was_given_in_the_same_shape(apex_double: ModuleType, shape: str) -> None:
    model, optimizer = model_and_optimizer()
    models_as_list, optimizers_as_list = SHAPES[shape]
    models = [model] if models_as_list else model
    optimizers = None if optimizers_as_list is None else [optimizer] if optimizers_as_list else optimizer
    returned = initialize(apex_double, models, optimizers, opt_level="O0")
    expected = models if optimizers is None else (models, optimizers)
    assert returned == expected


WRAPPERS = {
    "torch.nn.parallel.DistributedDataParallel": torch.nn.parallel.DistributedDataParallel,
    "torch.nn.parallel.DataParallel": torch.nn.DataParallel,
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_initialize_refuses_a_model_already_wrapped_for_data_parallel(apex_double: ModuleType, wrapper: str) -> None:
    cls = WRAPPERS[wrapper]
    wrapped = cls.__new__(cls)  # only its type matters: amp.initialize refuses it before touching it
    with pytest.raises(RuntimeError, match=f"^Incoming model is an instance of {wrapper}. Parallel wrappers"):
        initialize(apex_double, wrapped, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))


def test_initialize_refuses_cpu_parameters_when_supports_cpu_is_off(
    apex_double: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(apex_double, "supports_cpu", False)  # as real apex: CUDA only
    with pytest.raises(
        RuntimeError, match=r"^Found param 0\.weight with type torch\.FloatTensor, expected torch\.cuda"
    ):
        initialize(apex_double, *model_and_optimizer(), opt_level="O1")


def test_initialize_refuses_a_model_already_in_fp16(apex_double: ModuleType) -> None:
    model, optimizer = model_and_optimizer()
    with pytest.raises(RuntimeError, match=r"you do not need to call \.half\(\) on your model"):
        initialize(apex_double, model.half(), optimizer, opt_level="O2")


def test_initialize_refuses_an_fp16_buffer_in_an_fp32_model(apex_double: ModuleType) -> None:
    model, optimizer = model_and_optimizer()
    model.register_buffer("scale", torch.ones(1, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"^Found buffer scale with type torch\.HalfTensor"):
        initialize(apex_double, model, optimizer, opt_level="O0")


def test_initialize_refuses_an_optimizer_passed_twice(apex_double: ModuleType) -> None:
    model, optimizer = model_and_optimizer()
    initialize(apex_double, model, optimizer, opt_level="O0")
    with pytest.raises(RuntimeError, match=r"A given optimizer should only be passed through amp\.initialize once"):
        initialize(apex_double, model, optimizer, opt_level="O0")


def test_initialize_refuses_an_optimizer_that_already_has_amps_methods(apex_double: ModuleType) -> None:
    class HasAmpMethod(torch.optim.SGD):
        def _amp_lazy_init(self) -> None:
            pass

    model, _ = model_and_optimizer()
    with pytest.raises(RuntimeError, match=r"^Incoming optimizer already has _amp_lazy_init defined"):
        initialize(apex_double, model, HasAmpMethod(model.parameters(), lr=0.1), opt_level="O0")


def test_an_optimizer_parameter_neither_fp16_nor_fp32_is_a_type_error(apex_double: ModuleType) -> None:
    weight = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    initialize(apex_double, torch.nn.Linear(1, 1), optimizer, opt_level="O0", loss_scale=128.0)
    with (
        pytest.raises(TypeError, match=r"torch\.cuda\.HalfTensor\. Received torch\.DoubleTensor"),
        apex_double.scale_loss(weight.sum(), optimizer),
    ):
        pass


def test_add_param_group_refuses_a_set(apex_double: ModuleType) -> None:
    _, optimizer = initialize(apex_double, *model_and_optimizer(), opt_level="O0")
    with pytest.raises(TypeError, match="ordered collections"):
        optimizer.add_param_group({"params": {torch.nn.Parameter(torch.ones(1))}})


def test_a_second_initialize_is_allowed_as_in_apex(apex_double: ModuleType) -> None:
    # apex documents one call per process but does not enforce it; each call resets the loss scalers.
    initialize(apex_double, *model_and_optimizer(), opt_level="O0", loss_scale=8.0)
    initialize(apex_double, *model_and_optimizer(), opt_level="O0", loss_scale=4.0)
    assert loss_scales(apex_double) == [4.0]


def test_initialize_refuses_an_unknown_opt_level(apex_double: ModuleType) -> None:
    with pytest.raises(RuntimeError, match=r"^Unexpected optimization level O4\."):
        initialize(apex_double, *model_and_optimizer(), opt_level="O4")


@pytest.mark.parametrize(
    ("option", "words"),
    [
        ({"keep_batchnorm_fp32": True}, "With opt_level O1, batchnorm functions are automatically patched"),
        ({"master_weights": True}, "It doesn't make sense to use master_weights with O1"),
        ({"cast_model_type": torch.float16}, "O1 inserts casts around Torch functions rather than model weights"),
    ],
)
def test_o1_refuses_options_that_cast_the_model(apex_double: ModuleType, option: dict[str, Any], words: str) -> None:
    with pytest.raises(RuntimeError, match=words):
        initialize(apex_double, *model_and_optimizer(), opt_level="O1", **option)


@pytest.mark.parametrize(
    ("option", "error", "words"),
    [
        ({"patch_torch_functions": True}, RuntimeError, "patch_torch_functions=True should only be set by selecting"),
        ({"keep_batchnorm_fp32": "yes"}, AssertionError, "keep_batchnorm_fp32 must be a boolean"),
    ],
)
def test_initialize_refuses_inconsistent_options(
    apex_double: ModuleType, option: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        initialize(apex_double, *model_and_optimizer(), opt_level="O0", **option)


def test_initialize_refuses_cudnn_disabled(apex_double: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "enabled", False)
    with pytest.raises(RuntimeError, match=r"^Amp requires torch\.backends\.cudnn\.enabled = True"):
        initialize(apex_double, *model_and_optimizer(), opt_level="O0")


def test_initialize_warns_that_apex_amp_is_deprecated(apex_double: ModuleType) -> None:
    with pytest.warns(FutureWarning, match="apex.amp is deprecated"):
        initialize(apex_double, *model_and_optimizer(), opt_level="O0")


def test_scale_loss_before_initialize_is_an_error(apex_double: ModuleType) -> None:
    with (
        pytest.raises(RuntimeError, match="internal Amp state has not been initialized"),
        apex_double.scale_loss(torch.ones(1), []),
    ):
        pass


# --- apex.parallel.DistributedDataParallel on two real ranks (gloo) -----------------------------------------------


#: The wrappers each rank builds: name -> (parameter dtype, DistributedDataParallel options). A message_size of 1
#: gives the weight and the bias a bucket each.
DDP_SETUPS = {
    "float32": (torch.float32, {"message_size": 1}),
    "float16": (torch.float16, {}),
    "delayed": (torch.float32, {"delay_allreduce": True}),
}


def _apex_ddp_rank(rank: int, port: int, out: str) -> None:
    """One rank: wrap rank-specific models in apex's DDP, record what each backward leaves in the gradients."""
    sys.path.insert(0, str(DOUBLES))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from apex.parallel import DistributedDataParallel

    record: dict[str, Any] = {}
    for name, (dtype, options) in DDP_SETUPS.items():
        if dtype == torch.float16 and CPU_FP16_MISSING:
            continue
        x = torch.full((2, 3), float(rank + 1), dtype=dtype)
        torch.manual_seed(rank)  # different weights on each rank
        model = torch.nn.Linear(3, 2).to(dtype)
        model.register_buffer("marker", torch.full((1,), float(rank)))
        ddp = DistributedDataParallel(model, **options)
        record[f"{name}/params"] = [p.detach().clone() for p in model.parameters()]
        record[f"{name}/marker"] = model.marker.clone()
        for attempt in ("first", "second"):  # the first backward builds the buckets, the second uses them
            model.zero_grad(set_to_none=True)
            ddp(x).sum().backward()
            record[f"{name}/grads/{attempt}"] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        ddp.disable_allreduce()
        ddp(x).sum().backward()
        ddp.enable_allreduce()
        record[f"{name}/grads/disabled"] = [p.grad.clone() for p in model.parameters()]
        if name == "float32":
            loss = ddp(x).sum()
            loss.backward(retain_graph=True)
            try:
                loss.backward()
            except RuntimeError as error:
                record["second backward without a forward"] = str(error)
    path = Path(out) / f"rank{rank}.pt"
    torch.save(record, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # complete once it exists
    torch.distributed.barrier()  # both records are saved before either rank tears gloo down
    # The package's teardown: on torch 2.1 a plain destroy_process_group() right after a collective hangs the finished
    # process about one exit in three (pytorch/pytorch#154976; docs/maintainers.md).
    from lightning_ddp_amp.launch.process_group import destroy_process_group

    destroy_process_group()


@pytest.fixture(scope="module")
def apex_ddp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Two ranks of :func:`_apex_ddp_rank`, started once; a hang fails after two minutes.

    The ranks are judged by the records they saved: gloo's teardown can abort a process after its work is done.
    """
    out = tmp_path_factory.mktemp("apex_ddp")
    records = [out / f"rank{rank}.pt" for rank in (0, 1)]
    context = torch.multiprocessing.spawn(_apex_ddp_rank, args=(free_port(), str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail("the two apex DDP ranks did not finish within 120 s")
    except torch.multiprocessing.ProcessExitedException:
        if not all(record.exists() for record in records):
            raise
    return [torch.load(record) for record in records]


def expected_grads(params: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    """The gradients one rank computes alone, with rank 0's weights and its own input."""
    model = torch.nn.Linear(3, 2).to(params[0].dtype)
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), params, strict=True):
            mine.copy_(theirs)
    model(torch.full((2, 3), float(rank + 1), dtype=params[0].dtype)).sum().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.multiprocess
def test_apex_ddp_broadcasts_rank_zeros_parameters_at_construction(apex_ddp_ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = apex_ddp_ranks
    assert all(torch.equal(a, b) for a, b in zip(rank0["float32/params"], rank1["float32/params"], strict=True))


@pytest.mark.multiprocess
def test_apex_ddp_does_not_broadcast_buffers(apex_ddp_ranks: list[dict[str, Any]]) -> None:
    assert [r["float32/marker"].item() for r in apex_ddp_ranks] == [0.0, 1.0]


def assert_averaged(apex_ddp_ranks: list[dict[str, Any]], setup: str, attempt: str) -> None:
    params = apex_ddp_ranks[0][f"{setup}/params"]
    mean = [(a + b) / 2 for a, b in zip(expected_grads(params, 0), expected_grads(params, 1), strict=True)]
    for record in apex_ddp_ranks:
        for grad, expected in zip(record[f"{setup}/grads/{attempt}"], mean, strict=True):
            assert grad.dtype == expected.dtype
            torch.testing.assert_close(grad, expected)


@pytest.mark.multiprocess
@pytest.mark.parametrize("attempt", ["first", "second"])
def test_apex_ddp_averages_gradients_over_the_ranks(apex_ddp_ranks: list[dict[str, Any]], attempt: str) -> None:
    assert_averaged(apex_ddp_ranks, "float32", attempt)


@pytest.mark.multiprocess
@needs_cpu_fp16
def test_apex_ddp_averages_fp16_gradients_on_gloo(apex_ddp_ranks: list[dict[str, Any]]) -> None:
    assert_averaged(apex_ddp_ranks, "float16", "second")


@pytest.mark.multiprocess
def test_apex_ddp_with_delay_allreduce_averages_at_the_end_of_each_backward(
    apex_ddp_ranks: list[dict[str, Any]],
) -> None:
    assert_averaged(apex_ddp_ranks, "delayed", "second")


@pytest.mark.multiprocess
def test_apex_ddp_with_allreduce_disabled_keeps_each_ranks_gradients(apex_ddp_ranks: list[dict[str, Any]]) -> None:
    params = apex_ddp_ranks[0]["float32/params"]
    for rank, record in enumerate(apex_ddp_ranks):
        for grad, expected in zip(record["float32/grads/disabled"], expected_grads(params, rank), strict=True):
            torch.testing.assert_close(grad, expected)


@pytest.mark.multiprocess
def test_apex_ddp_refuses_a_second_backward_without_a_forward(apex_ddp_ranks: list[dict[str, Any]]) -> None:
    for record in apex_ddp_ranks:
        assert "attempting to replace an already-filled bucket slot" in record["second backward without a forward"]


# --- apex.parallel.DistributedDataParallel's refusals, on one rank in this process -------------------------------


@pytest.fixture
def one_rank_apex_ddp(apex_double: ModuleType) -> Iterator[type[torch.nn.Module]]:
    """The double's apex DistributedDataParallel class, inside a one-rank gloo group of this process."""
    from apex.parallel import DistributedDataParallel

    from lightning_ddp_amp.launch.process_group import destroy_process_group  # torch 2.1's teardown hang: see above

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield DistributedDataParallel
    finally:
        destroy_process_group()


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def test_apex_ddp_refuses_shared_param(one_rank_apex_ddp: type[torch.nn.Module]) -> None:
    with pytest.raises(ValueError, match=r"^shared_param is no longer supported"):
        one_rank_apex_ddp(torch.nn.Linear(3, 2), shared_param=True)


def test_apex_ddp_fails_when_the_forward_skips_the_wrapper(one_rank_apex_ddp: type[torch.nn.Module]) -> None:
    model = torch.nn.Linear(3, 2)
    one_rank_apex_ddp(model)
    with pytest.raises(AttributeError, match="needs_refresh"):
        model(torch.ones(1, 3)).sum().backward()


def test_apex_ddp_fails_when_a_later_backward_leaves_a_bucket_unfilled(
    one_rank_apex_ddp: type[torch.nn.Module],
) -> None:
    ddp = one_rank_apex_ddp(TwoHeads())
    ddp(torch.ones(1, 3)).sum().backward()  # the first backward builds the buckets from both heads
    with pytest.raises(RuntimeError, match="buckets were not allreduced"):
        ddp(torch.ones(1, 3), use_b=False).sum().backward()


def test_initialize_lets_a_model_wrapped_in_apex_ddp_through_as_apex_does(apex_double: ModuleType) -> None:
    # apex 25.05 guards this refusal with `'apex_DDP' in sys.modules`, which is never true.
    from apex.amp._initialize import check_models
    from apex.parallel import DistributedDataParallel as ApexDDP

    check_models([ApexDDP.__new__(ApexDDP)])


def test_copying_apex_ddp_off_nccl_fails_as_in_apex(one_rank_apex_ddp: type[torch.nn.Module]) -> None:
    wrapped = one_rank_apex_ddp(torch.nn.Linear(3, 2))
    with pytest.raises(KeyError, match=r"self\.bucket_streams"):
        copy.deepcopy(wrapped)
