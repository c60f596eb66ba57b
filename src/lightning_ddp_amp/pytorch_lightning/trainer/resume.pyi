# Generated from ../../trainer/resume.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""Surviving crashes and preemption: resume from the newest checkpoint, save one when SIGTERM arrives.

``EnvDDPStrategy(auto_resume=True)`` with a ``ModelCheckpoint(dirpath=..., every_n_train_steps=N)``:

* every ``trainer.fit`` without a ``ckpt_path`` starts from the newest checkpoint in that directory, so a run
  restarted by ``torchrun --max-restarts`` (or resubmitted by a scheduler) continues where it stopped;
* while the training loop runs, SIGTERM to any rank (a scheduler's preemption, torchrun shutting down) only raises
  a flag; within two accumulation boundaries every rank agrees, saves ``preempted-step=<N>.ckpt`` and exits with
  status 143 (128 + SIGTERM), so that launchers and schedulers see a preempted run, not a finished one;
* the first Ctrl-C (SIGINT) does the same, with status 130 (128 + SIGINT); a second one stops at once, unsaved.

A checkpoint saved mid-epoch continues on any number of ranks, with the data set, seed and order it was saved with
(see :mod:`lightning_ddp_amp.pytorch_lightning.trainer.position`); otherwise the fit stops before its first batch, and :class:`ResumePoint`
words the error: which file (and that ``auto_resume`` picked it), why, and the ways on.

:class:`AutoResume` is the one object the strategy's hooks call; the SIGTERM handler it drives is process-wide
(:data:`lightning_ddp_amp.launch.preemption.PREEMPTION`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]
from lightning_fabric.utilities.cloud_io import get_filesystem
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.exceptions import SIGTERMException
from typing_extensions import override

import lightning_ddp_amp.pytorch_lightning._lightning as _lightning
from lightning_ddp_amp.errors import CheckpointError, StrategyConfigurationError
from lightning_ddp_amp.launch.preemption import PREEMPTION

if TYPE_CHECKING:
    import pytorch_lightning as pl

#: Keys every checkpoint written by Lightning's Trainer has.
_LIGHTNING_KEYS = ("state_dict", "loops", "global_step")
_STEP_IN_NAME = re.compile(r"step=(\d+)")


def checkpoint_dirs(trainer: pl.Trainer) -> list[Path]:
    """The ``dirpath`` of every ``ModelCheckpoint`` that saves full checkpoints (weights-only ones cannot resume)."""
    ...


def newest_checkpoint(directories: list[Path]) -> Path | None:
    """The most recently written ``*.ckpt`` file in ``directories`` (ties: the higher ``step=`` in the name).

    Half-written files never qualify: checkpoints are written to a hidden temporary name, then renamed.
    """
    ...


def check_checkpoint(checkpoint: object, path: Any) -> None:
    """Raise a clear error unless ``checkpoint`` is what Lightning's Trainer writes."""
    ...


def unreadable_checkpoint(path: Any, error: Exception) -> CheckpointError:
    """The error for a checkpoint file that cannot be loaded (truncated, or not a torch checkpoint)."""
    ...


#: The checkpoint entry envddp writes beside Lightning's: ``{"world_size": N}``.
CHECKPOINT_KEY = "envddp"


def record_world_size(checkpoint: dict[str, Any], world_size: int) -> None:
    """Note in ``checkpoint`` how many ranks saved it: a DataLoader that envddp does not position (an
    IterableDataset, the script's own sampler, ``Trainer(use_distributed_sampler=False)``) records no layout."""
    ...


@dataclass(frozen=True)
class ResumePoint:
    """The resume point: the checkpoint a fit continues from, as a whole, as far as the position of its training data
    goes (each training DataLoader's own place in it is a :class:`~lightning_ddp_amp.pytorch_lightning.trainer.position.LoaderPosition`).

    Args:
        path: The checkpoint file.
        mid_epoch: It was saved after some, but not all, training batches of its epoch had finished.
        loader_states: How many training DataLoader positions it holds (Lightning saves those of resumable
            DataLoaders: envddp's, none from other strategies).
        auto_resumed: ``auto_resume`` picked it as the newest checkpoint of its directory.
        world_size: How many ranks saved it (:func:`record_world_size`); None for a checkpoint that does not say
            (another strategy's).
    """

    path: str
    mid_epoch: bool
    loader_states: int
    auto_resumed: bool = False
    world_size: int | None = None

    @classmethod
    def read(cls, checkpoint: dict[str, Any], path: Any, auto_resumed: bool) -> ResumePoint:
        """Where the loaded ``checkpoint`` (from ``path``) stands in its epoch."""
        ...

    def refuse(self, problem: str, continue_exactly: str) -> CheckpointError:
        """The error that stops a fit from continuing from this checkpoint, and the ways on.

        Args:
            problem: Why the samples the checkpoint had trained cannot be told apart in this run.
            continue_exactly: What continues it exactly, e.g. ``"relaunch with that run's layout (seed 0)"``.
        """
        ...


def check_step_schedulers(trainer: pl.Trainer, resuming: ResumePoint, world_size: int, start: int) -> None:
    """Stop a fit resumed on another number of ranks before it steps a scheduler sized by its total steps (such as
    ``OneCycleLR``) past its end, which would fail there.

    Args:
        trainer: The Trainer, at the start of training.
        resuming: The checkpoint it continues.
        world_size: This run's number of ranks.
        start: The batch index the resumed epoch continues at
            (:func:`lightning_ddp_amp.pytorch_lightning.trainer.position.align_resumed_epoch`).

    Raises:
        CheckpointError: A step-wise scheduler with ``total_steps`` has fewer steps left than this fit takes.
    """
    ...


def _optimizer_steps_left(trainer: pl.Trainer, start: int) -> int | None:
    """The optimizer steps the rest of the fit takes, from batch ``start`` of the current epoch; None if unbounded."""
    ...


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint format, written so that a kill halfway never damages the previous file.

    The checkpoint goes to a hidden temporary file in the target's own directory, is flushed to disk, and then
    renamed over the target; the directory is then flushed too, so that the rename survives a power loss. Lightning's
    own writer stages the file in the system's temporary directory and moves it, which is a copy (not atomic) when
    the checkpoint directory is on another filesystem. The file gets the mode Lightning's writer gives it, 0666 less
    the umask (0644 under the usual 022), so that an evaluation job or a teammate can read it.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        ...


def _fsync_directory(directory: Path) -> None:
    """Flush ``directory`` to disk: POSIX keeps a rename in the directory's entries, not in the renamed file."""
    ...


class AutoResumeLauncher:
    """Runs each ``trainer.fit`` from the newest checkpoint (a Lightning strategy launcher; starts no process).

    A ``trainer.fit(ckpt_path=...)`` given by the user is left alone.

    Args:
        resumed: Called with the checkpoint a fit resumes from.
    """

    is_interactive_compatible = True

    def __init__(self, resumed: Callable[[Path], None]) -> None:
        ...

    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Run ``function`` in this process, resuming a fit without ``ckpt_path`` from the newest checkpoint."""
        ...

    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher starts no processes."""


class AutoResume:
    """Auto-resume and preemption for one strategy: each of its hooks makes one call here.

    Args:
        enabled: ``auto_resume``. Without it nothing is resumed, and SIGTERM during training ends the process at
            once (see :class:`~lightning_ddp_amp.launch.preemption.Preemption`).
    """

    def __init__(self, enabled: bool) -> None:
        ...

    def launcher(self) -> AutoResumeLauncher | None:
        """The launcher that points each fit at the newest checkpoint; None without auto-resume."""
        ...

    def _resuming_from(self, checkpoint: Path) -> None:
        ...

    def setup_distributed(self) -> None:
        """Once the process group exists: the group that preemption checks and checkpoint agreement run on."""
        ...

    def on_train_start(self, trainer: pl.Trainer) -> None:
        """Check that every rank resumed from the same file, and take SIGTERM over for the training loop.

        Raises:
            CheckpointError: The ranks resumed from different checkpoints.
        """
        ...

    def on_train_batch_start(self, trainer: pl.Trainer, batch_idx: int) -> None:
        """At accumulation boundaries, after a SIGTERM or Ctrl-C on any rank: all ranks save together and stop.

        Raises:
            SIGTERMException: The ranks agreed to stop; the checkpoint is saved.
        """
        ...

    def stop(self) -> None:
        """Give SIGTERM back to its previous handler (training ended, or the Trainer tears down)."""
        ...

    def _check_same_checkpoint(self) -> None:
        ...
