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

It costs nothing until a step overflows: the recording only compares the step's gradient norm, which it computes
anyway, with infinity. A step whose batch is one of several accumulated is re-run on its last batch only.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

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
    rng: tuple[Tensor, Tensor | None],
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
    device = torch.device(pl_module.device)
    cuda = [device] if device.type == "cuda" else []
    buffers = {name: buffer.detach().clone() for name, buffer in pl_module.named_buffers()}
    try:
        with torch.random.fork_rng(devices=cuda), _logging_off(pl_module), _Watch(pl_module) as watch:
            torch.set_rng_state(rng[0])
            if cuda and rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], cuda[0])
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
    finally:
        with torch.no_grad():
            for name, buffer in pl_module.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
    if found is not None:
        return located(step, scale, phase=BACKWARD, **found)
    return located(
        step,
        scale,
        phase=NOT_REPRODUCED,
        note="the step's last batch trained again stays finite (an earlier batch of its accumulation window, or"
        " nondeterminism)",
    )


def _training_step(pl_module: Any, batch: Any, batch_idx: int) -> Any:
    positional = [
        p
        for p in inspect.signature(pl_module.training_step).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in positional):
        return pl_module.training_step(batch, batch_idx)
    return pl_module.training_step(batch)


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

    def __init__(self, root: Any) -> None:
        self.root = root
        self.forward: dict[str, Any] | None = None
        self.order: list[str] = []  # modules in the order their forwards finished
        self.gradients: list[tuple[str, Tensor]] = []  # (module, gradient of its output), in backward order
        self._hooked: set[int] = set()
        self._handles: list[Any] = []
        self._owner = {
            id(p): name or type(m).__name__ for name, m in root.named_modules() for p in m.parameters(recurse=False)
        }

    def __enter__(self) -> _Watch:
        for name, module in self.root.named_modules():
            label = name or type(module).__name__
            self._handles.append(module.register_forward_hook(self._hook(label)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            self.order.append(name)
            for tensor in _floating(output):
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


def _floating(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _floating(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _floating(item)
