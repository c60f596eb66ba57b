"""Surviving crashes and preemption: resume from the newest checkpoint, save one when SIGTERM arrives.

``EnvDDPStrategy(auto_resume=True)`` with a ``ModelCheckpoint(dirpath=..., every_n_train_steps=N)``:

* every ``trainer.fit`` without a ``ckpt_path`` starts from the newest checkpoint in that directory, so a run
  restarted by ``torchrun --max-restarts`` (or resubmitted by a scheduler) continues where it stopped;
* a SIGTERM to any rank (a scheduler's preemption, torchrun shutting down) makes every rank agree, at the next
  training step, to save ``preempted-step=<N>.ckpt`` there before the process exits.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from lightning_ddp_amp.errors import CheckpointError, StrategyConfigurationError

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: Keys every checkpoint written by Lightning's Trainer has.
_LIGHTNING_KEYS = ("state_dict", "loops", "global_step")


def checkpoint_dirs(trainer: pl.Trainer) -> list[Path]:
    """The ``dirpath`` of every ``ModelCheckpoint`` callback that has one."""
    return [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]


def newest_checkpoint(directories: list[Path]) -> Path | None:
    """The most recently written ``*.ckpt`` in ``directories``, or None.

    Half-written files never qualify: Lightning writes a checkpoint to a temporary file and renames it.
    """
    found = [path for directory in directories if directory.is_dir() for path in directory.glob("*.ckpt")]
    return max(found, key=lambda path: path.stat().st_mtime_ns, default=None)


def check_checkpoint(checkpoint: object, path: Any) -> None:
    """Raise a clear error unless ``checkpoint`` is what Lightning's Trainer writes."""
    missing = [key for key in _LIGHTNING_KEYS if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise CheckpointError(
            "ckpt_path",
            str(path),
            f"it is not a checkpoint written by a Lightning Trainer (no {', '.join(missing)})",
            "resume from a file the Trainer saved (ModelCheckpoint or trainer.save_checkpoint), or move this file"
            " out of the checkpoint directory",
        )


def unreadable_checkpoint(path: Any, error: Exception) -> CheckpointError:
    return CheckpointError(
        "ckpt_path",
        str(path),
        f"it cannot be read ({type(error).__name__}: {error}); it is truncated or not a torch checkpoint",
        "delete it (the run resumes from the previous checkpoint) or resume from another file; start without"
        " ckpt_path only if a fresh start is what you want",
    )


class AutoResumeLauncher:
    """Runs each ``trainer.fit`` from the newest checkpoint (a Lightning strategy launcher; starts no process).

    A ``trainer.fit(ckpt_path=...)`` given by the user still wins.

    Args:
        resumed: Called with the checkpoint a fit resumes from.
    """

    is_interactive_compatible = True

    def __init__(self, resumed: Callable[[Path], None]) -> None:
        self._resumed = resumed

    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return function(*args, **kwargs)
        directories = checkpoint_dirs(trainer)
        if not directories:
            raise StrategyConfigurationError(
                "auto_resume",
                True,
                "no ModelCheckpoint callback has a dirpath, so a restarted run could not find its checkpoints",
                "add ModelCheckpoint(dirpath='checkpoints', every_n_train_steps=N) to the Trainer's callbacks",
            )
        newest = newest_checkpoint(directories)
        if newest is None:
            return function(*args, **kwargs)
        self._resumed(newest)
        trainer.ckpt_path = newest  # Lightning's public way to pick the checkpoint of the next fit
        try:
            return function(*args, **kwargs)
        finally:
            trainer.ckpt_path = None

    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher starts no processes."""


class Preemption:
    """Notices SIGTERM, and lets every rank agree at a step boundary to save a checkpoint before exiting.

    There is one per process (:data:`PREEMPTION`): a signal has one handler, whichever strategy is training.
    """

    def __init__(self) -> None:
        self.requested = False
        self.saved = False
        self.active = False
        self._previous: Any = None

    def install(self) -> None:
        """Catch SIGTERM while training (only the main thread can); a handler already there still runs too."""
        if signal.getsignal(signal.SIGTERM) != self._on_sigterm:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.requested = self.saved = False
        self.active = True

    def uninstall(self) -> None:
        """Give SIGTERM back to whoever had it before, so that after fit it ends the process as usual."""
        self.active = False
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous
        if self.active:
            # Only a flag: a signal handler must not start collectives, which could interleave with training's.
            self.requested = True
            if callable(previous):
                previous(signum, frame)
            return
        # Not training any more (Lightning may restore this handler after fit): do what was done before it.
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop. Every rank must call this at the same point of the step."""
        if not dist.is_initialized():
            return self.requested
        flag = torch.tensor([int(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.requested = bool(flag.item())
        return self.requested

    def save(self, trainer: pl.Trainer) -> Path:
        """Save ``preempted-step=<N>.ckpt`` in the first checkpoint directory (rank 0 writes; all ranks call)."""
        path = checkpoint_dirs(trainer)[0] / f"preempted-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        self.saved = True
        return path


#: The process's one SIGTERM watcher.
PREEMPTION = Preemption()
