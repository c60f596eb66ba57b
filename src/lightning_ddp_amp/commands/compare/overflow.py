"""Where a step's gradients stopped being finite: the module, the dtype, and how close to the limit it ran.

A step skipped on overflow (or the first step whose loss or gradients are not finite) leaves no trace of where it
happened: the loss scaler only sees that some gradient is inf or NaN. :func:`locate` finds the place by training the
step's batch once more, from the same weights and the same random state, with a hook on every module:

* **forward**: the first module (in the order forwards finish, so the innermost) whose output holds an inf or NaN;
* **backward**: else, the first module whose backward turned finite gradients into non-finite ones, either its
  weights' gradients or the gradient it passes back to its input, under the loss scale the step ran with;
* **loss**: else, the loss itself (a finite forward whose loss, or the loss times the scale, is not finite).

For that tensor it reports its dtype and the largest finite magnitude in it (for float16, near 65504 means the values
ran into the top of the range). The re-run changes nothing of the training: it runs on the LightningModule itself
(not the DDP wrapper, so no collective), takes gradients with ``torch.autograd.grad`` (so no ``.grad`` is touched),
turns ``self.log`` off, and puts the buffers (batchnorm statistics) and the random state back afterwards.

It costs nothing until a step overflows: the recording reads whether the step's loss is finite before the step, and
whether the loss scaler skipped it after (then the weights are the ones the step started from), and where it measures
the gradient norm, whether that is finite. A step whose batch is one of several accumulated is re-run on its last batch
only. Weights that are already not finite as the step starts (an earlier step, unchecked and unscaled, applied
gradients that were not finite while its loss was) are reported as such, ``not re-run``: the step before is the place.

A kept loop (Fabric) has no ``training_step``: :func:`locate_calls` runs again each recorded call of its set-up models
(:mod:`~lightning_ddp_amp.commands.compare.model_calls`), the forwards in order, then each backward from the gradient
its outputs received in the step. Both share the watch (:class:`_Watch`), :func:`located` and the restore of the
buffers and the random state.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_ddp_amp.commands.compare import model_calls
from lightning_ddp_amp.commands.compare.model_calls import Call, floating
from lightning_ddp_amp.commands.compare.schema import BACKWARD, FORWARD, LOSS, NOT_RE_RUN, NOT_REPRODUCED, Phase

#: The most steps a run locates; each costs one more forward and backward of that step's batch.
MAX_LOCATED = 20


def located(
    step: int,
    scale: float | None,
    *,
    phase: Phase,
    module: str | None = None,
    tensor: str | None = None,
    dtype: str | None = None,
    max_finite: float | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """One located overflow, as ``record.json`` keeps it."""
    return {
        "step": step,
        "loss_scale": scale,
        "phase": phase,
        "module": module,
        "tensor": tensor,
        "dtype": dtype,
        "max_finite": max_finite,
        "note": note,
    }


def locate(
    pl_module: Any,
    batch: Any,
    batch_idx: int,
    *,
    step: int,
    scale: float | None,
    rng: model_calls.RandomState,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> dict[str, Any]:
    """Train ``batch`` again from the current weights and say where it first stopped being finite.

    Args:
        pl_module: The LightningModule, holding the weights the overflowing step started from.
        batch: That step's batch, on the device, as ``training_step`` received it.
        batch_idx: Its index, for ``training_step``.
        step: The global step, for the report.
        scale: The loss scale the step's backward ran under; None without loss scaling.
        rng: The CPU and (on CUDA) the device random state taken before the step's batch, for the same dropout.
        context: The precision plugin's ``train_step_context``, for the same autocast.

    It never raises: a step that cannot be trained again (a ``training_step`` that needs more than its batch, memory
    that ran out) is reported as ``not re-run`` with the error, and the run goes on.
    """
    try:
        return _train_again(pl_module, batch, batch_idx, step, scale, rng, context)
    except Exception as error:  # the run under compare must not fail for its own instrument
        return located(step, scale, phase=NOT_RE_RUN, note=f"training the batch again failed: {error!r}")


def _train_again(
    pl_module: Any, batch: Any, batch_idx: int, step: int, scale: float | None, rng: Any, context: Any
) -> dict[str, Any]:
    if not pl_module.automatic_optimization:
        return located(step, scale, phase=NOT_RE_RUN, note="manual optimization steps inside training_step")
    broken = weights_not_finite([("", pl_module)], step, scale)
    if broken is not None:
        return broken
    device = torch.device(pl_module.device)
    with _restored([pl_module], [device]), _logging_off(pl_module), _Watch(pl_module) as watch:
        model_calls.set_random_state(rng, device)
        with context():
            output = _training_step(pl_module, batch, batch_idx)
        loss = output.get("loss") if isinstance(output, dict) else output
        if watch.forward is not None:
            return located(step, scale, phase=FORWARD, **watch.forward)
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            return located(step, scale, phase=NOT_REPRODUCED, note="training_step returned no loss to re-run")
        scaled = loss.float() * (1.0 if scale is None else scale)
        if not bool(torch.isfinite(scaled)):
            what = "loss" if not bool(torch.isfinite(loss)) else f"loss times the scale {scale:g}"
            return located(
                step, scale, phase=LOSS, module="(the loss)", tensor=what, dtype=str(loss.dtype),
                max_finite=None if not bool(torch.isfinite(loss)) else float(loss.detach().abs()),
            )  # fmt: skip
        parameters = [p for p in pl_module.parameters() if p.requires_grad]
        grads = torch.autograd.grad(scaled, parameters, allow_unused=True)
        found = watch.backward(dict(zip(map(id, parameters), grads, strict=True)))
    if found is not None:
        return located(step, scale, phase=BACKWARD, **found)
    return located(
        step,
        scale,
        phase=NOT_REPRODUCED,
        note="the step's last batch trained again stays finite (an earlier batch of its accumulation window, or"
        " nondeterminism)",
    )


def weights_not_finite(modules: list[tuple[str, Any]], step: int, scale: float | None) -> dict[str, Any] | None:
    """The first weight that is already not finite as step ``step`` starts, as a located ``not re-run``; None when
    every weight is finite. ``modules``: each with the name the report gives it (empty: the model itself)."""
    for label, module in modules:
        for name, parameter in module.named_parameters():
            if parameter.is_floating_point() and not bool(torch.isfinite(parameter).all()):
                owner, _, tensor = f"{label}.{name}".strip(".").rpartition(".")
                return located(
                    step,
                    scale,
                    phase=NOT_RE_RUN,
                    module=owner or label or "(the model)",
                    tensor=tensor,
                    dtype=str(parameter.dtype),
                    max_finite=_largest_finite(parameter.detach()),
                    note="the weights were already not finite as the step started: an earlier step applied gradients"
                    " that were not finite while its loss was, and no loss scaler skipped it. Run compare with"
                    " --grad-norm-every 1 to check every step's gradients and locate that step",
                )
    return None


def _training_step(pl_module: Any, batch: Any, batch_idx: int) -> Any:
    positional = [
        p
        for p in inspect.signature(pl_module.training_step).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in positional):
        return pl_module.training_step(batch, batch_idx)
    return pl_module.training_step(batch)


def locate_calls(
    calls: list[Call],
    *,
    step: int,
    scale: float | None,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> dict[str, Any]:
    """Run a kept loop's model calls again from the current weights and say where the step stopped being finite.

    Args:
        calls: The step's calls of its set-up models (:meth:`ModelCalls.take
            <lightning_ddp_amp.commands.compare.model_calls.ModelCalls.take>`), each with its arguments, the random
            state before it and the gradient its outputs received in the real backward.
        step: The step, for the report.
        scale: The loss scale the step's backward ran under; None without loss scaling.
        context: The precision plugin's ``forward_context``, for the same autocast as the step's forwards.

    The forwards run in the order the calls were made: the first module whose output is not finite is the place.
    Else the backwards, latest call first, each from the gradient its outputs received: the first module whose backward
    made a gradient non-finite (its weights' or the one passed back to its input). A received gradient that is itself
    not finite, while every later call's backward stays finite, came from the code between the models: the loss.

    It never raises: a call that cannot run again is reported as ``not re-run`` with the error.
    """
    unkept: list[Call] = []  # calls of a model trusted not to draw random numbers that drew when run again
    try:
        found = _run_calls_again(calls, step, scale, context, unkept)
    except Exception as error:  # the run under compare must not fail for its own instrument
        return located(step, scale, phase=NOT_RE_RUN, note=f"running the models' calls again failed: {error!r}")
    said = model_calls.redrawn(unkept)
    if said is not None:
        found["note"] = said if found["note"] is None else f"{found['note']}; {said}"
    return found


def _run_calls_again(
    calls: list[Call], step: int, scale: float | None, context: Any, unkept: list[Call]
) -> dict[str, Any]:
    backward = [call for call in calls if call.received()]
    if not backward:
        return located(
            step, scale, phase=NOT_REPRODUCED, note="no output of a set-up model received a gradient in the step"
        )
    labelled = list({id(call.module): (call.label, call.module) for call in calls}.values())
    modules = [module for _, module in labelled]
    broken = weights_not_finite(labelled, step, scale)
    if broken is not None:
        return broken
    with _restored(modules, [call.device for call in calls]):
        for call in calls:
            with torch.no_grad(), _Watch(call.module, call.label) as watch:
                _call_again(call, context, unkept)
            if watch.forward is not None:
                return located(step, scale, phase=FORWARD, **watch.forward)
        for call in reversed(backward):
            found = _received_not_finite(call) or _backward_again(call, context, unkept)
            if found is not None:
                return located(step, scale, **found)
    return located(
        step,
        scale,
        phase=LOSS,
        module="(the loss)",
        note="every set-up model's backward from the gradients its outputs received stays finite: the non-finite"
        " gradients came from the loss's own use of the weights (or from nondeterminism)",
    )


def _call_again(call: Call, context: Any, unkept: list[Call]) -> tuple[Any, list[Tensor]]:
    """The call's output, run from its random state (else the current one: if it draws, it joins ``unkept``) on its
    arguments, and those of them it can pass a gradient to."""
    inputs: list[Tensor] = []
    args, kwargs = _detached((call.args, call.kwargs), inputs)
    before = None
    if call.rng is None:
        before = model_calls.random_state(call.device)
    else:
        model_calls.set_random_state(call.rng, call.device)
    with context():
        output = call.module(*args, **kwargs)
    if before is not None and call not in unkept and model_calls.drew(before, call.device):
        unkept.append(call)
    return output, inputs


def _received_not_finite(call: Call) -> dict[str, Any] | None:
    for grad in call.gradients:
        if grad is not None and not bool(torch.isfinite(grad).all()):
            return {
                "phase": LOSS,
                "module": "(the loss)",
                "tensor": f"gradient of {call.label}'s output, computed outside the set-up models",
                "dtype": str(grad.dtype),
                "max_finite": _largest_finite(grad),
            }
    return None


def _backward_again(call: Call, context: Any, unkept: list[Call]) -> dict[str, Any] | None:
    with _Watch(call.module, call.label) as watch:
        output, inputs = _call_again(call, context, unkept)
        pairs = [
            (tensor, grad)
            for tensor, grad in zip(floating(output), call.gradients, strict=False)
            if grad is not None and tensor.requires_grad
        ]
        if not pairs:
            return None
        parameters = [p for p in call.module.parameters() if p.requires_grad]
        grads = torch.autograd.grad(
            [tensor for tensor, _ in pairs],
            parameters + inputs,
            grad_outputs=[grad for _, grad in pairs],
            allow_unused=True,
        )
    found = watch.backward(dict(zip(map(id, parameters), grads[: len(parameters)], strict=True)))
    if found is not None:
        return {"phase": BACKWARD, **found}
    for grad in grads[len(parameters) :]:
        if grad is not None and not bool(torch.isfinite(grad).all()):
            return {
                "phase": BACKWARD,
                "module": watch.order[0] if watch.order else call.label,
                "tensor": f"gradient passed back to its input ({call.label}'s input)",
                "dtype": str(grad.dtype),
                "max_finite": _largest_finite(grad),
            }
    return None


def _detached(value: Any, inputs: list[Tensor]) -> Any:
    """``value`` with its tensors detached from the step's graph; those that needed a gradient are new leaves that do,
    added to ``inputs``."""
    if isinstance(value, Tensor):
        leaf = value.detach()
        if value.requires_grad:
            leaf.requires_grad_(True)
            inputs.append(leaf)
        return leaf
    if isinstance(value, (list, tuple)):
        items = [_detached(item, inputs) for item in value]
        named = isinstance(value, tuple) and type(value) is not tuple  # a namedtuple takes its fields one by one
        return type(value)(*items) if named else type(value)(items)
    if isinstance(value, dict):
        return {key: _detached(item, inputs) for key, item in value.items()}
    return value


@contextlib.contextmanager
def _restored(modules: list[Any], devices: list[torch.device]) -> Iterator[None]:
    """Whatever runs inside leaves the random state and the buffers of ``modules`` (batchnorm statistics) as they were.

    The re-run trains on copies of the buffers, put in their place and taken out again: the buffers themselves are
    never written, so a graph of the real step that saved them (batchnorm saves its running statistics for its
    backward; a GAN backpropagates ``G(z)`` in a later step) still finds them at the version it saved.
    """
    owned = [
        (owner, name, buffer)
        for module in modules
        for owner in module.modules()
        for name, buffer in owner.named_buffers(recurse=False)
    ]
    cuda = list({device for device in devices if device.type == "cuda"})
    for owner, name, buffer in owned:
        setattr(owner, name, buffer.detach().clone())
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        for owner, name, buffer in owned:
            setattr(owner, name, buffer)


@contextlib.contextmanager
def _logging_off(pl_module: Any) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing while the batch trains again (its step was logged once)."""
    for name in ("log", "log_dict"):
        setattr(pl_module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            delattr(pl_module, name)


def _largest_finite(tensor: Tensor) -> float:
    values = tensor.detach().abs()
    finite = values[torch.isfinite(values)]
    return float(finite.max()) if finite.numel() else 0.0


class _Watch:
    """Forward hooks on every module: the first non-finite output, and each output's gradient in backward order."""

    def __init__(self, root: Any, prefix: str = "") -> None:
        self.root = root
        self.prefix = prefix  # the model's name when the report names several: ``module0.net.2``
        self.forward: dict[str, Any] | None = None
        self.order: list[str] = []  # modules in the order their forwards finished
        self.gradients: list[tuple[str, Tensor]] = []  # (module, gradient of its output), in backward order
        self._hooked: set[int] = set()
        self._handles: list[Any] = []
        self._owner = {
            id(p): self._label(name, m) for name, m in root.named_modules() for p in m.parameters(recurse=False)
        }

    def __enter__(self) -> _Watch:
        for name, module in self.root.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(self._label(name, module))))
        return self

    def _label(self, name: str, module: Any) -> str:
        if self.prefix:
            return f"{self.prefix}.{name}" if name else self.prefix
        return name or type(module).__name__

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            self.order.append(name)
            for tensor in floating(output):
                if self.forward is None and not bool(torch.isfinite(tensor).all()):
                    self.forward = {
                        "module": name,
                        "tensor": "output",
                        "dtype": str(tensor.dtype),
                        "max_finite": _largest_finite(tensor),
                    }
                if tensor.requires_grad and id(tensor) not in self._hooked:  # a container's output is its child's
                    self._hooked.add(id(tensor))
                    tensor.register_hook(lambda grad, name=name: self._gradient(name, grad))  # type: ignore[no-untyped-call]

        return hook

    def _gradient(self, name: str, grad: Tensor) -> None:
        self.gradients.append((name, grad.detach()))

    def backward(self, parameter_grads: dict[int, Tensor | None]) -> dict[str, Any] | None:
        """The module whose backward first made a gradient non-finite: the one that used an output whose gradient is
        the first non-finite one (``(the loss)`` for the last output), or, if earlier in backward, one whose weights'
        gradients are non-finite while the gradient of its output is finite."""
        by_module: dict[str, list[Tensor]] = {}
        for key, grad in parameter_grads.items():
            if grad is not None:
                by_module.setdefault(self._owner[key], []).append(grad)
        for index, (name, grad) in enumerate(self.gradients):
            if not bool(torch.isfinite(grad).all()):
                user = self.gradients[index - 1][0] if index else "(the loss)"
                return {
                    "module": user,
                    "tensor": f"gradient passed back to its input ({name}'s output)",
                    "dtype": str(grad.dtype),
                    "max_finite": _largest_finite(grad),
                }
            found = _bad_weights(name, by_module)
            if found:
                return found
        for name in reversed(self.order):  # no output gradient was caught: the latest module with bad weights
            found = _bad_weights(name, by_module)
            if found:
                return found
        return None


def _bad_weights(name: str, by_module: dict[str, list[Tensor]]) -> dict[str, Any] | None:
    """The module's weight gradients, when some are not finite."""
    bad = [g for g in by_module.get(name, []) if not bool(torch.isfinite(g).all())]
    if not bad:
        return None
    return {
        "module": name,
        "tensor": "weight gradient",
        "dtype": str(bad[0].dtype),
        "max_finite": max(_largest_finite(g) for g in bad),
    }
