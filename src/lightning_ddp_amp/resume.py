"""Surviving crashes and preemption: resume from the newest checkpoint, save one when SIGTERM arrives.

``EnvDDPStrategy(auto_resume=True)`` with a ``ModelCheckpoint(dirpath=..., every_n_train_steps=N)``:

* every ``trainer.fit`` without a ``ckpt_path`` starts from the newest checkpoint in that directory, so a run
  restarted by ``torchrun --max-restarts`` (or resubmitted by a scheduler) continues where it stopped;
* while the training loop runs, SIGTERM to any rank (a scheduler's preemption, torchrun shutting down) only raises
  a flag; within two accumulation boundaries every rank agrees, saves ``preempted-step=<N>.ckpt`` and exits with
  status 143 (128 + SIGTERM), so that launchers and schedulers see a preempted run, not a finished one.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_ddp_amp.errors import CheckpointError, StrategyConfigurationError

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: Keys every checkpoint written by Lightning's Trainer has.
_LIGHTNING_KEYS = ("state_dict", "loops", "global_step")
_STEP_IN_NAME = re.compile(r"step=(\d+)")
#: The exit status of a run stopped by SIGTERM.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


def checkpoint_dirs(trainer: pl.Trainer) -> list[Path]:
    """The ``dirpath`` of every ``ModelCheckpoint`` that saves full checkpoints (weights-only ones cannot resume)."""
    return [
        Path(cb.dirpath)
        for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint) and cb.dirpath and not cb.save_weights_only
    ]


def newest_checkpoint(directories: list[Path]) -> Path | None:
    """The most recently written ``*.ckpt`` file in ``directories`` (ties: the higher ``step=`` in the name).

    Half-written files never qualify: checkpoints are written to a hidden temporary name, then renamed.
    """
    candidates: list[tuple[int, int, Path]] = []
    for directory in directories:
        for path in directory.glob("*.ckpt") if directory.is_dir() else ():
            with contextlib.suppress(OSError):  # a dangling link, or a file removed meanwhile
                if path.is_file():
                    step = _STEP_IN_NAME.search(path.name)
                    candidates.append((path.stat().st_mtime_ns, int(step.group(1)) if step else -1, path))
    return max(candidates, default=(0, 0, None))[2]


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
    """The error for a checkpoint file that cannot be loaded (truncated, or not a torch checkpoint)."""
    return CheckpointError(
        "ckpt_path",
        str(path),
        f"it cannot be read ({type(error).__name__}: {error}); it is truncated or not a torch checkpoint",
        "delete it (the run resumes from the previous checkpoint) or resume from another file; start without"
        " ckpt_path only if a fresh start is what you want",
    )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint format, written so that a kill halfway never damages the previous file.

    The checkpoint goes to a hidden temporary file in the target's own directory, is flushed to disk, and then
    renamed over the target. Lightning's own writer stages the file in the system's temporary directory and
    moves it, which is a copy (not atomic) when the checkpoint directory is on another filesystem.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)  # remote storage: Lightning's writer
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


class AutoResumeLauncher:
    """Runs each ``trainer.fit`` from the newest checkpoint (a Lightning strategy launcher; starts no process).

    A ``trainer.fit(ckpt_path=...)`` given by the user is left alone.

    Args:
        resumed: Called with the checkpoint a fit resumes from.
    """

    is_interactive_compatible = True

    def __init__(self, resumed: Callable[[Path], None]) -> None:
        self._resumed = resumed

    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Run ``function`` in this process, resuming a fit without ``ckpt_path`` from the newest checkpoint."""
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or _given_ckpt_path(function, args, kwargs):
            return function(*args, **kwargs)
        directories = checkpoint_dirs(trainer)
        if not directories:
            raise StrategyConfigurationError(
                "auto_resume",
                True,
                "no ModelCheckpoint callback saves full checkpoints to a dirpath, so a restarted run could not find"
                " its checkpoints",
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


def _given_ckpt_path(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get("ckpt_path") is not None


class Preemption:
    """Owns SIGTERM while the training loop runs.

    With ``graceful`` (``auto_resume=True``) SIGTERM only raises a flag, and every rank learns at an accumulation
    boundary whether any rank was signalled: the question goes out as a non-blocking all-reduce at one boundary
    and its answer is read at the next, so the check costs the training loop no waiting. Without ``graceful``,
    SIGTERM ends the process at once (its peers then stop with a "peer is gone" error), and nothing is checked.
    Outside the training loop SIGTERM keeps whatever handler it had.

    There is one per process (:data:`PREEMPTION`): a signal has one handler, whichever strategy is training.
    """

    def __init__(self) -> None:
        self.requested = False
        self.saved = False
        self._previous: Any = None
        self._group: Any = None
        self._question: tuple[torch.Tensor, Any] | None = None

    def start(self, graceful: bool, group: Any = None) -> None:
        """Take SIGTERM over (only the main thread can), until :meth:`stop`.

        Args:
            graceful: Raise a flag to agree on (True), or end the process at once (False).
            group: The gloo process group the ranks agree on, apart from the training's collectives.
        """
        self.requested = self.saved = False
        self._group = group
        self._question = None
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm if graceful else signal.SIG_DFL)

    def stop(self) -> None:
        """Collect the last question, and give SIGTERM back to the handler it had before :meth:`start`."""
        if self._question is not None:
            self._question[1].wait()
            self._question = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: a signal handler must not start collectives, which could interleave with training's.
        self.requested = True

    def agreed(self) -> bool:
        """Whether every rank knows that some rank was asked to stop (as of the previous boundary).

        Every rank must call this at the same boundaries. Without peers the answer is immediate.
        """
        if not dist.is_initialized() or self._group is None:
            return self.requested
        agreed = False
        if self._question is not None:
            flag, work = self._question
            work.wait()
            agreed = bool(flag.item())
        flag = torch.tensor([int(self.requested)])
        self._question = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True))
        if agreed:
            self._question[1].wait()  # every rank stops here: leave no question open
            self._question = None
        return agreed

    def save(self, trainer: pl.Trainer) -> Path:
        """Save ``preempted-step=<N>.ckpt`` in the first checkpoint directory (rank 0 writes; all ranks call)."""
        path = checkpoint_dirs(trainer)[0] / f"preempted-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        self.saved = True
        return path


#: The process's one SIGTERM watcher.
PREEMPTION = Preemption()
