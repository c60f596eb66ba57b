"""The calls of a kept loop's models, as the overflow locator needs them to train a step again without ``training_step``.

A Fabric script computes its loss between its models, in its own loop: nothing can call "the step" again. What can be
run again is each call of a set-up model's forward, so :class:`ModelCalls` keeps, for each call while a step runs:

* the module and its arguments (references: the tensors the step holds anyway until its backward);
* each floating output, told to ``retain_grad()``: after the real backward its ``.grad`` is the gradient that reached
  it (scaled, as the backward ran), summed where several backward passes reached it;
* the random state just before the call (CPU, and the module's CUDA device), so dropout draws the same mask, for a
  model whose forward draws random numbers. A model's first :data:`CHECKED_CALLS` calls tell: the state is taken before
  each and compared after it. A model that drew nothing in them (no dropout) needs none and has its pre-hook removed;
  if it draws at a later call all the same, the locator sees its re-run draw, says so, and the state is kept from then.

Per call that is a forward hook and ``retain_grad()`` per output (torch's own hook: no Python runs in the backward),
and for a model that draws, a forward pre-hook and one copy of the CPU random state (5 KB); nothing is read from the
device. A call under ``torch.no_grad`` (evaluation inside the loop) is not kept.
:func:`~lightning_ddp_amp.commands.compare.overflow.locate_calls` runs the calls again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

#: How many calls of a watched model are checked for random draws before a model that drew none in them is trusted
#: not to (its random state is then no longer taken before each call).
CHECKED_CALLS = 3

#: The CPU and (on CUDA) the device random state.
RandomState = tuple[Tensor, Tensor | None]


class Watched:
    """A model :meth:`ModelCalls.watch` keeps the calls of: its name, its device and whether its forward draws random
    numbers; ``remove()`` takes its hooks away (no cost left)."""

    __slots__ = ("_calls", "_hook", "_pre_hook", "checked", "device", "draws", "label", "module")

    def __init__(self, calls: ModelCalls, module: torch.nn.Module, label: str) -> None:
        self.module = module
        self.label = label  #: how the report names the model: ``module{i}`` in the order it was watched
        self.device: torch.device | None = None  #: its device at its first call (after setup moved it)
        self.draws: bool | None = None  #: whether its forward draws random numbers; None while its calls are checked
        self.checked = 0  #: its calls checked so far
        self._calls = calls
        self._pre_hook: RemovableHandle | None = module.register_forward_pre_hook(calls.before_call, with_kwargs=True)
        # with_kwargs: the call's keyword arguments, for a model whose pre-hook is gone; always_call: also on a raise
        self._hook: RemovableHandle | None = module.register_forward_hook(
            calls.after_call, with_kwargs=True, always_call=True
        )

    def keep_random_state(self) -> None:
        """From the next call on, take the random state before each: the model draws random numbers."""
        self.draws = True
        if self._pre_hook is None and self._hook is not None:
            self._pre_hook = self.module.register_forward_pre_hook(self._calls.before_call, with_kwargs=True)

    def checked_call(self, before: RandomState) -> None:
        """One of the first calls ran, from the random state ``before``: whether it drew is its answer."""
        self.checked += 1
        if drew(before, self.device):
            self.keep_random_state()
        elif self.checked >= CHECKED_CALLS:
            self.draws = False
            if self._pre_hook is not None:
                self._pre_hook.remove()
                self._pre_hook = None

    def remove(self) -> None:
        for handle in (self._pre_hook, self._hook):
            if handle is not None:
                handle.remove()
        self._pre_hook = self._hook = None


class Call:
    """One forward call of a watched model, and the gradients its outputs received."""

    __slots__ = ("args", "kwargs", "outputs", "rng", "watched")

    def __init__(
        self,
        watched: Watched,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        rng: RandomState | None,
        outputs: Sequence[Tensor | None],
    ) -> None:
        self.watched = watched
        self.args = args
        self.kwargs = kwargs
        self.rng = rng  #: the random state before the call; None for a model that draws none (or a call inside itself)
        #: per floating output, in :func:`floating` order: the output, retaining its gradient (None: it needs none)
        self.outputs = outputs

    @property
    def module(self) -> torch.nn.Module:
        return self.watched.module

    @property
    def label(self) -> str:
        return self.watched.label

    @property
    def device(self) -> torch.device:
        return self.watched.device or torch.device("cpu")

    @property
    def gradients(self) -> list[Tensor | None]:
        """Per floating output, the gradient it received in the real backward (None: none yet, or it needs none)."""
        return [None if output is None else output.grad for output in self.outputs]

    def received(self) -> bool:
        """Whether any output of the call received a gradient."""
        return received(self.outputs)


class ModelCalls:
    """The forward calls of the watched models since the last optimizer step, with their output gradients.

    ``watch`` each set-up model once (the module itself, not Fabric's wrapper: its forward is what runs again),
    call ``start_step`` after every optimizer step, and ``take`` the calls when a step overflowed.
    """

    def __init__(self) -> None:
        # This step's calls, as the fields of a Call (made only when a step is located: a tuple costs less a call).
        self._calls: list[
            tuple[Watched, tuple[Any, ...], dict[str, Any], RandomState | None, tuple[Tensor | None, ...]]
        ]
        self._calls = []
        self._carried: list[Call] = []  # the last step's calls whose outputs had no gradient yet
        self._watched: dict[int, Watched] = {}  # id(module) -> its watch
        self._open: dict[int, RandomState] = {}  # id(module) -> the random state before its forward, until it returns

    def watch(self, module: torch.nn.Module, label: str | None = None) -> Watched:
        """Keep every call of ``module`` from now on; the watch's ``remove()`` stops it.

        Args:
            module: The model as the script built it (``fabric_module.module`` after ``fabric.setup``).
            label: Its name in the report; ``module{i}``, ``i`` counting the modules watched, by default.
        """
        known = self._watched.get(id(module))
        watched = Watched(self, module, label or (known.label if known else f"module{len(self._watched)}"))
        self._watched[id(module)] = watched
        return watched

    def start_step(self) -> None:
        """A step begins (call it after each optimizer step): forget the calls the last step used.

        A call whose outputs have no gradient yet is carried through one step: a GAN computes ``G(z)`` before the
        discriminator's step and backpropagates through it in the generator's."""
        if self._calls:
            self._carried = [Call(*call) for call in self._calls if not received(call[4])]
            self._calls = []
        elif self._carried:
            self._carried = []

    def take(self) -> list[Call]:
        """The calls that can explain the step about to run, in the order they were made; forgotten here."""
        calls = self._carried + [Call(*call) for call in self._calls]
        self._carried, self._calls = [], []
        return calls

    def before_call(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():  # evaluation
            return
        watched = self._watched[id(module)]
        if watched.device is None:
            watched.device = _device(module)
        self._open[id(module)] = random_state(watched.device)

    def after_call(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        watched = self._watched[id(module)]
        rng = None
        if watched.draws is not False:
            rng = self._open.pop(id(module), None)
            if watched.draws is None and rng is not None:
                watched.checked_call(rng)
        if isinstance(output, Tensor):  # the usual output, without walking it
            if output.requires_grad and output.is_floating_point():
                output.retain_grad()
                self._calls.append((watched, args, kwargs, rng, (output,)))
            return
        outputs = tuple(tensor if tensor.requires_grad else None for tensor in floating(output))
        kept = False
        for tensor in outputs:
            if tensor is not None:
                tensor.retain_grad()
                kept = True
        if kept:
            self._calls.append((watched, args, kwargs, rng, outputs))


def received(outputs: Sequence[Tensor | None]) -> bool:
    """Whether any of a call's outputs received a gradient."""
    for output in outputs:  # noqa: SIM110 (no generator: it runs for every call)
        if output is not None and output.grad is not None:
            return True
    return False


def redrawn(calls: list[Call]) -> str | None:
    """What a located overflow says of ``calls``, whose models drew random numbers when run again though they drew none
    in their first :data:`CHECKED_CALLS` calls (their random state was not kept); their state is kept from now on."""
    if not calls:
        return None
    for call in calls:
        call.watched.keep_random_state()
    labels = sorted({call.label for call in calls})
    return (
        f"{' and '.join(labels)} drew random numbers when run again, none in {'their' if len(labels) > 1 else 'its'}"
        f" first {CHECKED_CALLS} calls: the random state before this step's call was not kept, so the re-run drew"
        " others and the place may differ (it is kept from now on)"
    )


def random_state(device: torch.device) -> RandomState:
    """The CPU random state, and ``device``'s where it is a GPU."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_random_state(rng: RandomState, device: torch.device) -> None:
    """Put the random state :func:`random_state` took back."""
    torch.set_rng_state(rng[0])
    if device.type == "cuda" and rng[1] is not None:
        torch.cuda.set_rng_state(rng[1], device)


def drew(before: RandomState, device: torch.device | None) -> bool:
    """Whether anything drew random numbers since ``before`` was taken (on the CPU or ``device``)."""
    if not torch.equal(torch.get_rng_state(), before[0]):
        return True
    return device is not None and before[1] is not None and not torch.equal(torch.cuda.get_rng_state(device), before[1])


def _device(module: torch.nn.Module) -> torch.device:
    for parameter in module.parameters():
        return parameter.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")


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
