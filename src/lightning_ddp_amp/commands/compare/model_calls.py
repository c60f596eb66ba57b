"""The calls of a kept loop's models, as the overflow locator needs them to train a step again without ``training_step``.

A Fabric script computes its loss between its models, in its own loop: nothing can call "the step" again. What can be
run again is each call of a set-up model's forward, so :class:`ModelCalls` keeps, for each call while a step runs:

* the module and its arguments (references: the tensors the step holds anyway until its backward);
* the random state just before the call (CPU, and the module's CUDA device), so dropout draws the same mask;
* each floating output, told to ``retain_grad()``: after the real backward its ``.grad`` is the gradient that reached
  it (scaled, as the backward ran), summed where several backward passes reached it.

Per call that is a forward pre-hook, a forward hook, ``retain_grad()`` per output (torch's own hook: no Python runs in
the backward), and one copy of the CPU random state (5 KB); nothing is read from the device. A call under
``torch.no_grad`` (evaluation inside the loop) is not kept. :func:`~lightning_ddp_amp.commands.compare.overflow.locate_calls` runs the calls again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle


@dataclass
class Call:
    """One forward call of a watched model, and the gradients its outputs received."""

    module: torch.nn.Module
    label: str  #: how the report names the model: ``module{i}`` in the order it was watched
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: tuple[Tensor, Tensor | None]  #: the CPU and (on CUDA) the module's device random state before the call
    device: torch.device
    #: per floating output, in :func:`floating` order: the output, retaining its gradient (None: it needs none)
    outputs: list[Tensor | None] = field(default_factory=list)
    stepped: bool = False  #: an optimizer step has run since the call

    @property
    def gradients(self) -> list[Tensor | None]:
        """Per floating output, the gradient it received in the real backward (None: none yet, or it needs none)."""
        return [None if output is None else output.grad for output in self.outputs]

    def received(self) -> bool:
        """Whether any output of the call received a gradient."""
        return any(output is not None and output.grad is not None for output in self.outputs)


class ModelCalls:
    """The forward calls of the watched models since the last optimizer step, with their output gradients.

    ``watch`` each set-up model once (the module itself, not Fabric's wrapper: its forward is what runs again),
    call ``start_step`` after every optimizer step, and ``take`` the calls when a step overflowed.
    """

    def __init__(self) -> None:
        self._calls: list[Call] = []
        self._open: dict[int, Call] = {}  # id(module) -> its call whose forward has not returned
        self._labels: dict[int, str] = {}
        self._devices: dict[int, torch.device] = {}  # id(module) -> its device at its first call (after setup moved it)

    def watch(self, module: torch.nn.Module, label: str | None = None) -> Watching:
        """Keep every call of ``module`` from now on; the handle's ``remove()`` stops it (no cost left).

        Args:
            module: The model as the script built it (``fabric_module.module`` after ``fabric.setup``).
            label: Its name in the report; ``module{i}``, ``i`` counting the modules watched, by default.
        """
        self._labels.setdefault(id(module), label or f"module{len(self._labels)}")
        return Watching(
            module.register_forward_pre_hook(self._before, with_kwargs=True),
            module.register_forward_hook(self._after, always_call=True),  # also when the forward raised
        )

    def start_step(self) -> None:
        """A step begins (call it after each optimizer step): forget the calls the last step used.

        A call whose outputs have no gradient yet is kept through one step: a GAN computes ``G(z)`` before the
        discriminator's step and backpropagates through it in the generator's."""
        if not self._calls:
            return
        self._calls = [call for call in self._calls if not call.stepped and not call.received()]
        for call in self._calls:
            call.stepped = True

    def take(self) -> list[Call]:
        """The calls that can explain the step about to run, in the order they were made; forgotten here."""
        calls, self._calls = self._calls, []
        return calls

    def _before(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled() or self._open:  # evaluation, or a watched model called inside another
            return
        key = id(module)
        device = self._devices.get(key)
        if device is None:
            device = self._devices[key] = _device(module)
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self._open[key] = Call(module, self._labels[key], args, kwargs, (torch.get_rng_state(), cuda), device)

    def _after(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        call = self._open.pop(id(module), None)
        if call is None:
            return
        call.outputs = [tensor if tensor.requires_grad else None for tensor in floating(output)]
        kept = False
        for tensor in call.outputs:
            if tensor is not None:
                tensor.retain_grad()
                kept = True
        if kept:
            self._calls.append(call)


def _device(module: torch.nn.Module) -> torch.device:
    for parameter in module.parameters():
        return parameter.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")


class Watching:
    """The hooks :meth:`ModelCalls.watch` put on a module; ``remove()`` takes them away."""

    def __init__(self, *handles: RemovableHandle) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def floating(value: Any) -> Iterator[Tensor]:
    """The floating tensors in a module's output (a tensor, or lists, tuples and dicts of them), in a fixed order."""
    if isinstance(value, Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from floating(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from floating(item)
