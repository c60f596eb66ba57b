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

from lightning_ddp_amp.commands.compare import overflow

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
