"""What the TEST DOUBLE adds to ``apex.amp`` for tests. Real apex has none of this.

- ``events``: what amp was asked to do, in order, as dicts (``{"event": "initialize", ...}``).
- :func:`backward_outside_scale_loss`: how many parameter gradients were computed outside ``amp.scale_loss``.
- :func:`unpatch_torch_for_tests`: undo O1's patching of torch, which apex never undoes.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

#: What the double was asked to do, in order, for tests to inspect.
events: list[dict[str, Any]] = []

_MARK = "_apex_test_double_replaced"


class _BackwardWatch:
    """TEST-ONLY: whether a ``scale_loss`` block is open, and the gradients counted outside one."""

    inside_scale_loss = False
    outside = 0


def record(event: str, **fields: Any) -> None:
    """TEST-ONLY: append one event to :data:`events`."""
    events.append({"event": event, **fields})


def watch_backward(models: Iterable[torch.nn.Module]) -> None:
    """TEST-ONLY: count every gradient the models' parameters receive while no ``scale_loss`` block is open."""

    def count(grad: torch.Tensor) -> torch.Tensor:
        if not _BackwardWatch.inside_scale_loss:
            _BackwardWatch.outside += 1
        return grad

    for model in models:
        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(count)


@contextlib.contextmanager
def inside_scale_loss() -> Iterator[None]:
    """TEST-ONLY: gradients computed in this block are inside ``scale_loss``."""
    _BackwardWatch.inside_scale_loss = True
    try:
        yield
    finally:
        _BackwardWatch.inside_scale_loss = False


def backward_outside_scale_loss() -> int:
    """TEST-ONLY: how many parameter gradients were computed outside ``scale_loss`` since this double was imported."""
    return _BackwardWatch.outside


def mark_replacement(new_fn: Callable[..., Any], mod: Any, name: str, replaced: Any) -> None:
    """TEST-ONLY: note on an O1 wrapper what it replaced, and whether ``mod`` (a module, class, object or dict)
    held it itself (not through a base class)."""
    setattr(new_fn, _MARK, (replaced, name in (mod if isinstance(mod, dict) else vars(mod))))


def _is_wrapper(value: Any) -> bool:
    """TEST-ONLY: whether ``value`` is an O1 wrapper marked by :func:`mark_replacement`."""
    # Only a function can be a wrapper; some of torch's namespaces answer any attribute name.
    return inspect.isfunction(value) and _MARK in vars(value)


def _unwrapped(wrapper: Any) -> tuple[Any, bool]:
    """TEST-ONLY: what the first of a stack of O1 wrappers replaced, and whether its module held it itself."""
    original, own = vars(wrapper)[_MARK]
    while _is_wrapper(original):
        original, own = vars(original)[_MARK]
    return original, own


def unpatch_torch_for_tests() -> None:
    """TEST-ONLY: put back every torch function and Tensor method that any copy of the double's O1 patched, the
    entries of ``torch.nn.modules.rnn._rnn_impls``, and torch's own ``_VF`` in ``torch.nn.modules.rnn`` (O1's
    shim goes, with the RNN casts on it).

    apex patches torch for the rest of the process; a test suite that imports the double afresh for each test
    (conftest's ``apex_double`` fixture) calls this at teardown so that later tests see torch as it was. The
    wrappers carry what they replaced, so re-imported copies of the double, and stacked patches from several
    ``amp.initialize`` calls, are all undone. Functions registered by the user (``register_*_function``) on other
    modules than these are not undone.
    """
    for mod in (torch, torch.nn.functional, torch.Tensor):
        for name, value in list(vars(mod).items()):
            if not _is_wrapper(value):
                continue
            original, own = _unwrapped(value)
            if own:
                setattr(mod, name, original)
            else:
                delattr(mod, name)
    rnn = torch.nn.modules.rnn
    for name, value in list(rnn._rnn_impls.items()):
        if _is_wrapper(value):
            rnn._rnn_impls[name] = _unwrapped(value)[0]
    rnn._VF = torch._VF  # type: ignore[attr-defined]
