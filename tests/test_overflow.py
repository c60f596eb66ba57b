"""``compare``'s overflow locator (:mod:`lightning_ddp_amp.commands.compare.overflow`), on models built to overflow in a known
layer: which module, which tensor, its dtype and how close to the top of its range it ran; and that training the step's
batch again changes nothing of the training.

The runs through a real Trainer (fp16 under torch's AMP and the apex double, a scale that keeps falling) are in
``test_compare.py``; here each case calls :func:`locate` directly, in float32 with a loss scale near its top, so the
same arithmetic overflows on every torch the suite runs on.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
import pytest
import torch
from conftest import needs_cpu_fp16

from lightning_ddp_amp.commands.compare import overflow
from lightning_ddp_amp.commands.compare.model_calls import CHECKED_CALLS, ModelCalls

F32_MAX = torch.finfo(torch.float32).max


class Scaled(torch.nn.Module):
    """``(x * gain) / gain``: nothing in exact arithmetic, inf where ``x * gain`` leaves the dtype's range."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.gain) / self.gain


class Model(L.LightningModule):
    def __init__(self, *layers: torch.nn.Module) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*layers)
        self.logged: list[Any] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.log("train_loss", 1.0)
        return self.net(batch).sum()

    def log(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.logged.append(args)


def locate(model: Model, batch: torch.Tensor, scale: float | None = None) -> dict[str, Any]:
    return overflow.locate(
        model, batch, 0, step=7, scale=scale, rng=(torch.get_rng_state(), None), context=contextlib.nullcontext
    )


def test_a_forward_overflow_names_the_innermost_module_its_dtype_and_the_largest_finite_value() -> None:
    torch.manual_seed(0)
    model = Model(torch.nn.Linear(4, 8), torch.nn.ReLU(), Scaled(1e38), torch.nn.Linear(8, 1))
    batch = 10 * torch.randn(16, 4)
    found = locate(model, batch)
    hidden = torch.relu(model.net[0](batch)).detach()
    finite = hidden[(hidden * 1e38).isfinite()]
    assert 0 < finite.numel() < hidden.numel()  # values above 3.4 overflow, the others stay
    assert found == {
        "step": 7,
        "loss_scale": None,
        "phase": "forward",
        "module": "net.2",  # not the Sequential holding it, whose output is the same inf
        "tensor": "output",
        "dtype": "torch.float32",
        "max_finite": pytest.approx(float(finite.abs().max())),
        "note": None,
    }


def test_a_backward_overflow_names_the_module_whose_backward_left_the_range() -> None:
    # d(sum)/d(out) is the scale (finite); net.1's weights of 2 make the gradient passed back to net.0's output 2x the
    # scale: inf in float32. net.1's own weight gradient is the scale times net.0's output, kept below 1.
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    with torch.no_grad():
        first.weight.fill_(0.01)
        first.bias.zero_()
        second.weight.fill_(2.0)
    model = Model(first, second)
    found = locate(model, torch.ones(1, 4), scale=F32_MAX / 1.5)
    assert (found["phase"], found["module"], found["dtype"]) == ("backward", "net.1", "torch.float32")
    assert found["tensor"] == "gradient passed back to its input (net.0's output)"
    assert found["loss_scale"] == pytest.approx(F32_MAX / 1.5)


def test_a_weight_gradient_overflow_names_its_module() -> None:
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    with torch.no_grad():
        first.weight.fill_(1.0)  # net.0's output: 4, so net.1's weight gradient is 4x the scale
        first.bias.zero_()
        second.weight.fill_(0.1)
    found = locate(Model(first, second), torch.ones(1, 4), scale=F32_MAX / 2)
    assert (found["phase"], found["module"], found["tensor"]) == ("backward", "net.1", "weight gradient")


def test_a_loss_the_scale_overflows_is_the_loss_and_a_finite_step_is_not_reproduced() -> None:
    model = Model(torch.nn.Linear(4, 1))
    with torch.no_grad():
        model.net[0].weight.fill_(1.0)
        model.net[0].bias.fill_(0.0)
    found = locate(model, torch.full((1, 4), 10.0), scale=F32_MAX / 2)  # loss 40: finite; times the scale: inf
    assert (found["phase"], found["module"]) == ("loss", "(the loss)")
    assert found["tensor"] == f"loss times the scale {F32_MAX / 2:g}" and found["max_finite"] == 40.0
    calm = locate(model, torch.full((1, 4), 10.0), scale=1.0)
    assert (calm["phase"], calm["module"]) == ("not reproduced", None)
    assert "trained again stays finite" in calm["note"]


def test_training_the_batch_again_changes_no_weight_gradient_buffer_random_state_or_log() -> None:
    torch.manual_seed(0)
    model = Model(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), Scaled(1e38), torch.nn.Linear(8, 1)
    )
    model.train()
    batch = 10 * torch.randn(16, 4)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    rng = torch.get_rng_state()
    found = locate(model, batch)
    assert found["module"] == "net.3"
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in weights.items())  # batchnorm statistics too
    assert all(parameter.grad is None for parameter in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.logged == [] and "log" not in vars(model)


def test_the_same_dropout_is_drawn_as_in_the_step_it_trains_again() -> None:
    # A random mask decides the overflow: only the step's own random state reproduces it. The first draw after
    # manual_seed(3) is 0.004 (kept: overflow), after manual_seed(1) 0.76 (dropped: finite).
    class Mask(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            keep = torch.rand(x.shape) < 0.5
            return torch.where(keep & (torch.arange(x.numel()).reshape(x.shape) == 0), x * 1e38 * 1e38, x)

    def state(seed: int) -> torch.Tensor:
        before = torch.get_rng_state()
        torch.manual_seed(seed)
        taken = torch.get_rng_state()
        torch.set_rng_state(before)
        return taken

    model = Model(Mask())
    for seed, phase in ((3, "forward"), (1, "not reproduced")):
        found = overflow.locate(
            model, torch.ones(1, 4), 0, step=0, scale=None, rng=(state(seed), None), context=contextlib.nullcontext
        )
        assert found["phase"] == phase, seed


def test_a_manual_optimization_step_is_not_trained_again() -> None:
    model = Model(torch.nn.Linear(4, 1))
    model.automatic_optimization = False
    found = locate(model, torch.ones(1, 4))
    assert (found["phase"], found["module"]) == ("not re-run", None)
    assert found["note"] == "manual optimization steps inside training_step"


def test_a_step_that_cannot_be_trained_again_is_reported_with_the_error_and_the_run_goes_on() -> None:
    class NeedsMore(Model):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            raise KeyError("the step wants the dataloader iterator")

    model = NeedsMore(Scaled(1e38))
    found = locate(model, torch.ones(1, 4))
    assert (found["phase"], found["module"]) == ("not re-run", None)
    assert found["note"] == "training the batch again failed: KeyError('the step wants the dataloader iterator')"
    assert all(not module._forward_hooks for module in model.modules())  # the watch took its hooks away


# A kept loop (Fabric): no training_step to run again, so the models' calls are recorded (ModelCalls) and run again
# (locate_calls). Each case is a two-model pipeline, model_a feeding model_b, the loss computed outside both.


def pipeline_step(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    batch: torch.Tensor,
    *,
    scale: float = 1.0,
    loss: Any = None,
    context: Any = contextlib.nullcontext,
) -> tuple[ModelCalls, list[Any]]:
    """One step of the loop: both models watched, forward, the loss outside them, the real backward under ``scale``."""
    calls = ModelCalls()
    handles = [calls.watch(model_a), calls.watch(model_b)]
    calls.start_step()
    with context():
        out = model_b(model_a(batch))
    value = out.float().sum() if loss is None else loss(out)
    (value * scale).backward()
    for handle in handles:
        handle.remove()
    return calls, calls.take()


def locate_calls(calls: list[Any], scale: float | None = None, context: Any = contextlib.nullcontext) -> dict[str, Any]:
    return overflow.locate_calls(calls, step=3, scale=scale, context=context)


@needs_cpu_fp16
def test_a_forward_overflow_under_the_steps_autocast_names_the_model_its_module_and_float16() -> None:
    torch.manual_seed(0)
    model_a, model_b = torch.nn.Sequential(torch.nn.Linear(4, 8), Scaled(1e5)), torch.nn.Linear(8, 1)
    batch = torch.randn(16, 4)

    def fp16() -> Any:
        return torch.autocast("cpu", dtype=torch.float16)

    _, calls = pipeline_step(model_a, model_b, batch, context=fp16)
    found = locate_calls(calls, context=fp16)
    assert (found["step"], found["phase"], found["module"]) == (3, "forward", "module0.1")
    assert (found["tensor"], found["dtype"]) == ("output", "torch.float16")
    assert 0 < found["max_finite"] < 65504
    # without the step's autocast the same calls stay finite: the located dtype is the step's own
    assert locate_calls(calls)["phase"] != "forward"


def test_a_backward_that_passes_an_inf_to_the_other_model_names_the_module_that_passed_it() -> None:
    # model_b's weights of 2 make the gradient it passes back to model_a's output 2x the scale: inf in float32, while
    # its own weight gradient (the scale times model_a's output, kept below 1) and the gradient it received stay finite.
    model_a, model_b = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 1))
    with torch.no_grad():
        model_a.weight.fill_(0.01)
        model_a.bias.zero_()
        model_b[0].weight.fill_(2.0)
    _, calls = pipeline_step(model_a, model_b, torch.ones(1, 4), scale=F32_MAX / 1.5)
    assert not bool(torch.isfinite(model_a.weight.grad).all())  # the real step overflowed
    found = locate_calls(calls, scale=F32_MAX / 1.5)
    assert (found["phase"], found["module"], found["dtype"]) == ("backward", "module1.0", "torch.float32")
    assert found["tensor"] == "gradient passed back to its input (module1's input)"
    assert found["loss_scale"] == pytest.approx(F32_MAX / 1.5)


def test_a_backward_overflow_inside_a_model_names_its_module() -> None:
    model_a = torch.nn.Linear(4, 4)
    model_b = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with torch.no_grad():
        model_a.weight.fill_(0.01)
        model_a.bias.zero_()
        model_b[0].weight.fill_(0.01)
        model_b[1].weight.fill_(2.0)
    _, calls = pipeline_step(model_a, model_b, torch.ones(1, 4), scale=F32_MAX / 1.5)
    found = locate_calls(calls, scale=F32_MAX / 1.5)
    assert (found["phase"], found["module"]) == ("backward", "module1.1")
    assert found["tensor"] == "gradient passed back to its input (module1.0's output)"


def test_a_loss_that_hands_an_inf_gradient_to_a_model_is_the_loss_with_that_gradients_bfloat16() -> None:
    model_a, model_b = torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 1).to(torch.bfloat16)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return (out.float() * F32_MAX).sum() * 4  # d(loss)/d(out) is 4x the largest float32

    _, calls = pipeline_step(model_a, model_b, torch.ones(1, 4, dtype=torch.bfloat16), loss=loss)
    found = locate_calls(calls)
    assert (found["phase"], found["module"], found["dtype"]) == ("loss", "(the loss)", "torch.bfloat16")
    assert found["tensor"] == "gradient of module1's output, computed outside the set-up models"


def test_a_weight_the_loss_uses_outside_the_models_is_put_on_the_loss() -> None:
    model_a, model_b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.sum() + (model_b.weight * F32_MAX).sum() * 4  # a penalty on the weights, outside the forwards

    _, calls = pipeline_step(model_a, model_b, torch.ones(1, 4), loss=loss)
    assert not bool(torch.isfinite(model_b.weight.grad).all())
    found = locate_calls(calls)
    assert (found["phase"], found["module"], found["tensor"]) == ("loss", "(the loss)", None)
    assert found["note"].startswith("every set-up model's backward from the gradients its outputs received stays")


def test_each_call_runs_again_from_its_own_random_state() -> None:
    # model_b's random mask decides the overflow; the loop draws between the two calls, so only the random state
    # taken before model_b's own call reproduces it (see the dropout test above for the two seeds).
    class Mask(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            keep = torch.rand(x.shape) < 0.5
            return torch.where(keep & (torch.arange(x.numel()).reshape(x.shape) == 0), x * 1e38 * 1e38, x)

    model_a, model_b = torch.nn.Linear(4, 4), Mask()
    calls = ModelCalls()
    calls.watch(model_a)
    calls.watch(model_b)
    torch.manual_seed(1)
    hidden = model_a(torch.ones(1, 4))
    torch.manual_seed(3)
    model_b(hidden).sum().backward()
    torch.manual_seed(1)  # the state now is not the one model_b's call drew from
    found = locate_calls(calls.take())
    assert (found["phase"], found["module"]) == ("forward", "module1")


def test_a_model_that_draws_no_random_numbers_has_no_random_state_kept_after_its_first_calls() -> None:
    # Each call of a model with dropout keeps the random state before it; a model that drew nothing in its first
    # CHECKED_CALLS calls keeps none after them, and its pre-hook goes (one hook a call is what is left of the cost).
    plain, noisy = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    calls = ModelCalls()
    watched = [calls.watch(plain), calls.watch(noisy)]
    for _ in range(CHECKED_CALLS + 1):
        calls.start_step()
        (plain(torch.ones(2, 4)).sum() + noisy(torch.ones(2, 4)).sum()).backward()
    taken = calls.take()
    assert [(call.label, call.rng is None) for call in taken] == [("module0", True), ("module1", False)]
    assert (watched[0].draws, watched[1].draws) == (False, True)
    assert not plain._forward_pre_hooks and noisy._forward_pre_hooks


def test_a_model_that_starts_drawing_after_its_checked_calls_is_said_and_keeps_its_random_state_from_then() -> None:
    class LateMask(torch.nn.Module):  # draws from its call CHECKED_CALLS + 1 on (the re-run's too)
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls <= CHECKED_CALLS:
                return x * 2
            keep = torch.rand(x.shape) < 0.5
            return torch.where(keep & (torch.arange(x.numel()).reshape(x.shape) == 0), x * 1e38 * 1e38, x)

    model = LateMask()
    calls = ModelCalls()
    watched = calls.watch(model)
    for _ in range(CHECKED_CALLS + 1):
        calls.start_step()
        model(torch.ones(1, 4, requires_grad=True)).sum().backward()
    taken = calls.take()
    assert [call.rng for call in taken] == [None]  # trusted not to draw by then
    found = locate_calls(taken)
    assert found["note"].endswith(
        "module0 drew random numbers when run again, none in its first 3 calls: the random state before this step's"
        " call was not kept, so the re-run drew others and the place may differ (it is kept from now on)"
    )
    assert watched.draws is True and model._forward_pre_hooks  # the next call keeps it
    calls.take()  # the calls the re-run made, which the door drops too
    model(torch.ones(1, 4, requires_grad=True)).sum().backward()
    assert calls.take()[0].rng is not None


def test_running_the_calls_again_changes_no_weight_gradient_buffer_or_random_state() -> None:
    # Every forward and every backward runs again: the overflow is a penalty outside the models (put on the loss).
    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5))
    model_b = torch.nn.Linear(8, 1)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.sum() + (model_b.weight * F32_MAX).sum() * 4

    _, calls = pipeline_step(model_a, model_b, 10 * torch.randn(16, 4), loss=loss)
    models = (model_a, model_b)
    states = [{name: value.clone() for name, value in model.state_dict().items()} for model in models]
    grads = [{name: p.grad.clone() for name, p in model.named_parameters()} for model in models]
    rng = torch.get_rng_state()
    assert locate_calls(calls)["phase"] == "loss"
    for model, state, grad in zip(models, states, grads, strict=True):
        after = model.state_dict()
        assert all(torch.equal(after[name], value) for name, value in state.items())  # batchnorm statistics too
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grad[name], rtol=0, atol=0, equal_nan=True)
        assert all(not module._forward_hooks for module in model.modules())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_call_that_cannot_run_again_is_reported_with_the_error_and_the_hooks_go() -> None:
    class Once(torch.nn.Module):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("the batch iterator is spent")
            return x * 2

    model_a, model_b = torch.nn.Linear(4, 4), Once()
    _, calls = pipeline_step(model_a, model_b, torch.ones(1, 4))
    found = locate_calls(calls)
    assert (found["phase"], found["module"]) == ("not re-run", None)
    assert found["note"] == "running the models' calls again failed: RuntimeError('the batch iterator is spent')"
    assert all(not module._forward_hooks for module in (*model_a.modules(), model_b))


def test_a_step_whose_models_received_no_gradient_is_not_reproduced() -> None:
    model = torch.nn.Linear(4, 1)
    calls = ModelCalls()
    calls.watch(model)
    model(torch.ones(1, 4))
    found = locate_calls(calls.take())
    assert (found["phase"], found["note"]) == (
        "not reproduced",
        "no output of a set-up model received a gradient in the step",
    )


def test_model_calls_keep_the_calls_of_the_step_a_gan_trains_its_generator_on() -> None:
    # The discriminator's step uses G(z) detached; the generator's step backpropagates through the same G(z), computed
    # before the discriminator stepped. Evaluation under no_grad is not kept.
    generator, discriminator = torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)
    calls = ModelCalls()
    calls.watch(generator, "generator")
    watching = calls.watch(discriminator, "discriminator")
    real = torch.ones(3, 4)
    fake = generator(torch.randn(3, 2))
    (discriminator(real).sum() - discriminator(fake.detach()).sum()).backward()
    calls.start_step()  # the discriminator stepped
    with torch.no_grad():
        discriminator(real)
    discriminator(fake).sum().backward()
    taken = calls.take()
    assert [call.label for call in taken] == ["generator", "discriminator"]
    assert all(call.received() for call in taken)
    assert torch.equal(taken[1].args[0], fake) and taken[1].gradients[0] is not None
    calls.start_step()
    watching.remove()
    discriminator(real).sum().backward()
    assert calls.take() == []


def test_weights_already_not_finite_are_named_as_such_and_not_re_run_through_either_door() -> None:
    torch.manual_seed(0)
    model = Model(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        model.net[2].weight[0, 3] = float("nan")
    found = locate(model, torch.randn(16, 4), scale=1024.0)
    assert (found["step"], found["loss_scale"], found["phase"]) == (7, 1024.0, "not re-run")
    assert (found["module"], found["tensor"], found["dtype"]) == ("net.2", "weight", "torch.float32")
    weight = model.net[2].weight.detach()
    assert found["max_finite"] == pytest.approx(float(weight[weight.isfinite()].abs().max()))
    assert "already not finite as the step started" in found["note"] and not model.logged  # nothing ran again

    model_a, model_b = torch.nn.Linear(4, 8), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 1))
    _, calls = pipeline_step(model_a, model_b, torch.randn(16, 4))
    with torch.no_grad():
        model_b[1].bias.fill_(float("inf"))
    found = locate_calls(calls)
    assert (found["phase"], found["module"], found["tensor"], found["max_finite"]) == (
        "not re-run",
        "module1.1",
        "bias",
        0,
    )
