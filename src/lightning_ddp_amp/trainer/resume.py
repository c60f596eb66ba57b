"""Surviving crashes and preemption: resume from the newest checkpoint, save one when SIGTERM arrives.

``EnvDDPStrategy(auto_resume=True)`` with a ``ModelCheckpoint(dirpath=..., every_n_train_steps=N)``:

* every ``trainer.fit`` without a ``ckpt_path`` starts from the newest checkpoint in that directory, so a run
  restarted by ``torchrun --max-restarts`` (or resubmitted by a scheduler) continues where it stopped;
* while the training loop runs, SIGTERM to any rank (a scheduler's preemption, torchrun shutting down) only raises
  a flag; within two accumulation boundaries every rank agrees, saves ``preempted-step=<N>.ckpt`` and exits with
  status 143 (128 + SIGTERM), so that launchers and schedulers see a preempted run, not a finished one;
* the first Ctrl-C (SIGINT) does the same, with status 130 (128 + SIGINT); a second one stops at once, unsaved.

A checkpoint saved mid-epoch continues on any number of ranks, with the data set, seed and order it was saved with
(see :mod:`lightning_ddp_amp.trainer.position`); otherwise the fit stops before its first batch, and :class:`ResumePoint`
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
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.errors import CheckpointError, StrategyConfigurationError
from lightning_ddp_amp.launch.preemption import PREEMPTION

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: Keys every checkpoint written by Lightning's Trainer has.
_LIGHTNING_KEYS = ("state_dict", "loops", "global_step")
_STEP_IN_NAME = re.compile(r"step=(\d+)")


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


#: The checkpoint entry envddp writes beside Lightning's: ``{"world_size": N}``.
CHECKPOINT_KEY = "envddp"


def record_world_size(checkpoint: dict[str, Any], world_size: int) -> None:
    """Note in ``checkpoint`` how many ranks saved it: a DataLoader that envddp does not position (an
    IterableDataset, the script's own sampler, ``Trainer(use_distributed_sampler=False)``) records no layout."""
    checkpoint[CHECKPOINT_KEY] = {"world_size": world_size}


@dataclass(frozen=True)
class ResumePoint:
    """The resume point: the checkpoint a fit continues from, as a whole, as far as the position of its training data
    goes (each training DataLoader's own place in it is a :class:`~lightning_ddp_amp.trainer.position.LoaderPosition`).

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
        saved_by = checkpoint.get(CHECKPOINT_KEY, {}).get("world_size")
        return cls(
            str(path),
            _lightning.saved_mid_epoch(checkpoint),
            len(_lightning.saved_loader_states(checkpoint)),
            auto_resumed,
            None if saved_by is None else int(saved_by),
        )

    def refuse(self, problem: str, continue_exactly: str) -> CheckpointError:
        """The error that stops a fit from continuing from this checkpoint, and the ways on.

        Args:
            problem: Why the samples the checkpoint had trained cannot be told apart in this run.
            continue_exactly: What continues it exactly, e.g. ``"relaunch with that run's layout (seed 0)"``.
        """
        if self.auto_resumed:
            directory = Path(self.path).parent
            problem = f"auto_resume picked it as the newest checkpoint in {directory}, but {problem}"
            elsewhere = (
                f"move {Path(self.path).name} out of {directory} (the next start resumes from the newest checkpoint"
                " left there), or pass trainer.fit(ckpt_path=...) a checkpoint saved at the end of an epoch"
            )
        else:
            elsewhere = "pass trainer.fit(ckpt_path=...) a checkpoint saved at the end of an epoch"
        return CheckpointError(
            "ckpt_path", self.path, problem, f"{continue_exactly} to continue exactly; or {elsewhere}"
        )


def check_step_schedulers(trainer: pl.Trainer, resuming: ResumePoint, world_size: int, start: int) -> None:
    """Stop a fit resumed on another number of ranks before it steps a scheduler sized by its total steps (such as
    ``OneCycleLR``) past its end, which would fail there.

    Args:
        trainer: The Trainer, at the start of training.
        resuming: The checkpoint it continues.
        world_size: This run's number of ranks.
        start: The batch index the resumed epoch continues at
            (:func:`lightning_ddp_amp.trainer.position.align_resumed_epoch`).

    Raises:
        CheckpointError: A step-wise scheduler with ``total_steps`` has fewer steps left than this fit takes.
    """
    if resuming.world_size in (None, world_size) or not trainer.lightning_module.automatic_optimization:
        return
    steps = _optimizer_steps_left(trainer, start)
    for config in trainer.lr_scheduler_configs:
        total = getattr(config.scheduler, "total_steps", None)
        if steps is None or config.interval != "step" or not isinstance(total, int):
            continue
        room = total - int(getattr(config.scheduler, "last_epoch", 0))
        needed = -(-steps // max(config.frequency, 1))
        if needed > room:
            name = type(config.scheduler).__name__
            raise CheckpointError(
                "ckpt_path",
                resuming.path,
                f"it was saved by {resuming.world_size} rank(s), and on {world_size} the rest of this fit takes"
                f" {steps} optimizer steps, but its {name}(total_steps={total}) has {room} left and would fail at"
                f" step {trainer.global_step + room + 1} (the number of steps per epoch changes with the world size)",
                f"relaunch with {resuming.world_size} rank(s), or EnvDDPStrategy(split_batches=True) to keep the"
                f" steps per epoch; or Trainer(max_steps={trainer.global_step + room}) to end the fit where the"
                " schedule ends",
            )


def _optimizer_steps_left(trainer: pl.Trainer, start: int) -> int | None:
    """The optimizer steps the rest of the fit takes, from batch ``start`` of the current epoch; None if unbounded."""
    batches, accumulate = trainer.num_training_batches, trainer.accumulate_grad_batches
    if batches == float("inf"):
        return None
    batches = int(batches)

    def steps(first: int) -> int:  # Lightning steps after every accumulate-th batch, and after the epoch's last
        return batches // accumulate - first // accumulate + (1 if batches % accumulate else 0)

    left: float = float("inf")
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        left = steps(start) + max(trainer.max_epochs - trainer.current_epoch - 1, 0) * steps(0)
    if trainer.max_steps >= 0:
        left = min(left, trainer.max_steps - trainer.global_step)
    return None if left == float("inf") else int(left)


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
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)  # remote storage: Lightning's writer
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
        # Created as open() creates files, 0o666 less the umask (tempfile.mkstemp would give 0o600).
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
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
        _fsync_directory(target.parent)


def _fsync_directory(directory: Path) -> None:
    """Flush ``directory`` to disk: POSIX keeps a rename in the directory's entries, not in the renamed file."""
    try:
        handle = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # Windows, and file systems whose directories cannot be opened: nothing to flush there
    try:
        os.fsync(handle)
    except OSError as error:
        # The checkpoint is complete and in place: a file system that does not flush directories (EINVAL; some
        # network and FUSE ones answer ENOTSUP or EBADF) keeps it as it keeps every rename.
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(handle)


class AutoResumeLauncher:
    """Runs each ``trainer.fit`` from the newest checkpoint, in each rank: the strategy's launcher
    (:class:`~lightning_ddp_amp.ddp.launcher.StartMissingRanks`) hands it the function; it starts no process.

    A ``trainer.fit(ckpt_path=...)`` given by the user is left alone.

    Args:
        resumed: Called with the checkpoint a fit resumes from.
    """

    is_interactive_compatible = True

    def __init__(self, resumed: Callable[[Path], None]) -> None:
        self._resumed = resumed

    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Run ``function`` in this process, resuming a fit without ``ckpt_path`` from the newest checkpoint."""
        given_ckpt_path = _lightning.launched_with_ckpt_path(function, args, kwargs)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or given_ckpt_path:
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


class AutoResume:
    """Auto-resume and preemption for one strategy: each of its hooks makes one call here.

    Args:
        enabled: ``auto_resume``. Without it nothing is resumed, and SIGTERM during training ends the process at
            once (see :class:`~lightning_ddp_amp.launch.preemption.Preemption`).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        #: The checkpoint the current fit resumed from; None for a fresh start or a ``ckpt_path`` given by the user.
        self.resumed_from: Path | None = None
        self._group: Any = None

    def launcher(self) -> AutoResumeLauncher | None:
        """The launcher that points each fit at the newest checkpoint; None without auto-resume."""
        return AutoResumeLauncher(self._resuming_from) if self.enabled else None

    def _resuming_from(self, checkpoint: Path) -> None:
        self.resumed_from = checkpoint
        rank_zero_info(f"envddp: auto_resume continues from {checkpoint}")

    def setup_distributed(self) -> None:
        """Once the process group exists: the group that preemption checks and checkpoint agreement run on."""
        if self.enabled:
            # CPU tensors on a group of their own, off the GPU stream and apart from the training's collectives,
            # so that a check can run while training goes on.
            self._group = dist.new_group(backend="gloo")

    def on_train_start(self, trainer: pl.Trainer) -> None:
        """Check that every rank resumed from the same file, and take SIGTERM over for the training loop.

        Raises:
            CheckpointError: The ranks resumed from different checkpoints.
        """
        if dist.is_initialized() and self.resumed_from is not None:
            self._check_same_checkpoint()
        # Lightning's own per-step SIGTERM broadcast waits for every rank at every step; SIGTERM is handled here.
        _lightning.disable_sigterm_broadcast(trainer)
        PREEMPTION.start(graceful=self.enabled, group=self._group)

    def on_train_batch_start(self, trainer: pl.Trainer, batch_idx: int) -> None:
        """At accumulation boundaries, after a SIGTERM or Ctrl-C on any rank: all ranks save together and stop.

        Raises:
            SIGTERMException: The ranks agreed to stop; the checkpoint is saved.
        """
        if not self.enabled:
            return
        if batch_idx % trainer.accumulate_grad_batches == 0 and (signum := PREEMPTION.agreed()):
            path = checkpoint_dirs(trainer)[0] / f"preempted-step={trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)  # rank 0 writes; every rank takes part
            PREEMPTION.saved(path)
            rank_zero_info(
                f"envddp: {signal.Signals(signum).name} received; saved {path}, the next start resumes from it"
            )
            # Lightning's exception for a stop signal (OnExceptionCheckpoint and on_exception hooks know it), with
            # the status a shell gives that signal: 143, or 130 after Ctrl-C.
            raise SIGTERMException(128 + signum)

    def stop(self) -> None:
        """Give SIGTERM back to its previous handler (training ended, or the Trainer tears down)."""
        PREEMPTION.stop()

    def _check_same_checkpoint(self) -> None:
        chosen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(chosen, str(self.resumed_from), group=self._group)
        if len(set(chosen)) > 1:
            raise CheckpointError(
                "ckpt_path",
                str(self.resumed_from),
                f"the ranks resumed from different checkpoints ({', '.join(sorted(set(chosen)))}): their checkpoint"
                " directories differ",
                "put the ModelCheckpoint dirpath on storage every node sees, or resume with an explicit ckpt_path",
            )
