"""The classic resume's data order under Fabric: the epoch the script sets wins over Fabric's own count.

The classic loop calls ``sampler.set_epoch(epoch)`` at the top of every epoch, and a resumed run starts at the saved
epoch. Fabric's DataLoader wrapper also calls ``set_epoch``, at every ``iter()``, with its own count of iterations
in this process, which a resumed run starts at 0: it would shuffle as in epoch 0, not as in the saved epoch. So the
distributed sampler envddp finds in a set-up DataLoader keeps the script's epoch: of the ``set_epoch`` calls made
since its last iteration began, Fabric's (always the last, made as iteration begins) counts only when the script
made none.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler

_KEEPING: dict[type[Any], type[Any]] = {}


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
