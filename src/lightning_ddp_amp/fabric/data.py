"""The classic loop's data order under Fabric: the epoch the script sets wins over Fabric's own count, and one process
keeps the script's own sampler.

The classic loop calls ``sampler.set_epoch(epoch)`` at the top of every epoch, and a resumed run starts at the saved
epoch. Fabric's DataLoader wrapper also calls ``set_epoch``, at every ``iter()``, with its own count of iterations
in this process, which a resumed run starts at 0: it would shuffle as in epoch 0, not as in the saved epoch. So the
distributed sampler envddp finds in a set-up DataLoader keeps the script's epoch: of the ``set_epoch`` calls made
since its last iteration began, Fabric's (always the last, made as iteration begins) counts only when the script
made none.

In one process envddp swaps in no sampler (as the Trainer's envddp and Fabric's single-device strategy): the order is
the script's own, from its seed, as in apex's and torch's ImageNet examples, which build a ``DistributedSampler`` only
when ``WORLD_SIZE > 1``. The kept line ``loader.sampler.set_epoch(epoch)`` then meets a ``RandomSampler`` or
``SequentialSampler``, which gets a ``set_epoch`` that changes nothing, so that the line runs unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

_KEEPING: dict[type[Any], type[Any]] = {}
_EPOCH_FREE: dict[type[Any], type[Any]] = {}


def _keeping(sampler_class: type[Any]) -> type[Any]:
    """``sampler_class`` whose ``set_epoch`` keeps the script's epoch (see the module), of the same name; one class
    per sampler class. A subclass with nothing but methods, so that a sampler's class can be swapped for it."""
    if sampler_class not in _KEEPING:

        def set_epoch(self: Any, epoch: int) -> None:
            vars(self).setdefault("_epochs_set", []).append(epoch)
            sampler_class.set_epoch(self, epoch)

        def __iter__(self: Any) -> Iterator[Any]:
            calls = vars(self).pop("_epochs_set", [])
            if len(calls) > 1:  # the script's, then Fabric's as iteration began
                sampler_class.set_epoch(self, calls[0])
            return sampler_class.__iter__(self)  # type: ignore[no-any-return]

        namespace = {"set_epoch": set_epoch, "__iter__": __iter__, "keeps_script_epoch": True}
        _KEEPING[sampler_class] = type(
            sampler_class.__name__, (sampler_class,), namespace | {"__module__": sampler_class.__module__}
        )
    return _KEEPING[sampler_class]


def keep_script_epoch(loader: object) -> None:
    """Make the distributed samplers of ``loader`` (its sampler, its batch sampler's) keep the script's epoch."""
    samplers = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    for sampler in samplers:
        if isinstance(sampler, DistributedSampler) and not getattr(sampler, "keeps_script_epoch", False):
            sampler.__class__ = _keeping(type(sampler))


def _epoch_free(sampler_class: type[Any]) -> type[Any]:
    """``sampler_class`` with a ``set_epoch`` that changes nothing, of the same name; one class per sampler class."""
    if sampler_class not in _EPOCH_FREE:

        def set_epoch(self: Any, epoch: int) -> None:
            """One process shuffles from the script's seed, whatever the epoch (see the module)."""

        namespace = {"set_epoch": set_epoch, "__module__": sampler_class.__module__}
        _EPOCH_FREE[sampler_class] = type(sampler_class.__name__, (sampler_class,), namespace)
    return _EPOCH_FREE[sampler_class]


def accept_set_epoch(loader: object) -> None:
    """Give the ``RandomSampler`` or ``SequentialSampler`` of ``loader`` (one process) a ``set_epoch`` that changes
    nothing, so that the classic loop's ``loader.sampler.set_epoch(epoch)`` runs unchanged."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, (RandomSampler, SequentialSampler)) and not hasattr(sampler, "set_epoch"):
        sampler.__class__ = _epoch_free(type(sampler))
