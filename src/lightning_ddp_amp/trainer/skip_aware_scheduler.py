"""A step-interval LR scheduler that stands still when the loss scaler skipped its optimizer's step, as the apex
recipe's ``if not skipped: scheduler.step()`` did; the Trainer's AmpPrecision wraps each such scheduler in it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer


def skip_aware(config: LRSchedulerConfig, skipped: Callable[[Optimizer], bool]) -> LRSchedulerConfig:
    """``config`` with its scheduler wrapped in :class:`SkipAwareScheduler` when it steps with the optimizer (interval
    ``"step"``); an epoch-interval scheduler, or one without an optimizer, as it is."""
    if config.interval != "step" or not hasattr(config.scheduler, "optimizer"):
        return config
    guarded = SkipAwareScheduler(config.scheduler, skipped)
    return dataclasses.replace(config, scheduler=guarded)  # type: ignore[arg-type]


class SkipAwareScheduler:
    """A step-interval LR scheduler that stands still when its optimizer's step was skipped on overflow.

    Lightning steps schedulers after every training step; a step the loss scaler skipped did not happen, so
    the recipe's ``if not skipped: scheduler.step()`` is applied here. Everything else is the wrapped scheduler.

    Args:
        scheduler: The user's scheduler.
        skipped: Tells whether the last step of an optimizer was skipped.
    """

    _OWN = ("scheduler", "_skipped")

    def __init__(self, scheduler: Any, skipped: Callable[[Optimizer], bool]) -> None:
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "_skipped", skipped)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped scheduler's ``step``, unless the optimizer step it follows was skipped on overflow."""
        if self._skipped(self.scheduler.optimizer):
            return None
        return self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in self._OWN or name.startswith("__"):
            raise AttributeError(name)  # not set up yet (copy, pickle): do not recurse into the scheduler
        return getattr(self.scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.scheduler, name, value)
