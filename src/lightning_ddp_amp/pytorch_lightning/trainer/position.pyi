# Generated from ../../trainer/position.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""Where a training DataLoader is in its epoch, and continuing it on any number of ranks.

A training DataLoader that envddp shards (:mod:`lightning_ddp_amp.pytorch_lightning.trainer.sharding`) is resumable in Lightning's sense (it
has ``state_dict`` / ``load_state_dict``): a checkpoint records the epoch, how many of its samples were trained, the
order they were drawn in and the layout they were counted in. Resuming from it trains the rest of that epoch, each
remaining sample once, on any number of ranks (an elastic resume):

* the order of an epoch does not depend on the world size (``DistributedSampler``'s permutation of seed + epoch, or
  in one process without ``split_batches`` the ``RandomSampler``'s own order, whose generator state the checkpoint
  records), and ``b`` batches at world size ``W`` trained exactly its first ``b * global batch`` samples;
* the rest of the epoch, ``order[trained:]``, is padded to a multiple of the new world size with the epoch's first
  samples, as ``DistributedSampler`` pads, and rank ``r`` takes every ``W'``-th sample from ``r`` on. So with
  ``split_batches`` the global batches that follow are those of the uninterrupted run; without it each rank keeps
  its batch and the global batch becomes ``batch * W'`` (warned), the last step shortened on every rank alike;
* Lightning's count of the epoch's batches is moved so that the resumed epoch ends where an uninterrupted run at the
  new world size ends it (:func:`align_resumed_epoch`): ``batch_idx``, validation and gradient accumulation count
  in the new world size's batches, at the indices of that run's last batches.

A fit that continues a mid-epoch position in another data set, seed or order, or with ``split_batches`` another
global batch, or without the position a DataLoader needs, stops before its first batch with a ``CheckpointError``;
a checkpoint saved at the end of an epoch resumes under any layout.

The words, one type each:

* the *resume point* (:class:`~lightning_ddp_amp.pytorch_lightning.trainer.resume.ResumePoint`): the checkpoint a fit continues from, as a
  whole: its file, whether it was saved mid-epoch, how many positions it holds, how many ranks saved it. It words
  the errors;
* a *position* (:class:`LoaderPosition`): one training DataLoader's place in its epoch, which it saves in every
  checkpoint (epoch, batches, samples, order, layout) and continues from on resume;
* a *layout* (:class:`DataLayout`): what decides which samples the n-th batch holds on each rank; a position
  continues only in its own, except (counted in samples) for the number of ranks and, without ``split_batches``,
  the global batch;
* a *resumed epoch* (:class:`~lightning_ddp_amp.pytorch_lightning.trainer.samplers.ResumedEpoch`): what a restored position continues:
  the samples of its order already trained, and where this run picks the epoch up;
* an *order* (``{"kind": ...}``, :func:`~lightning_ddp_amp.pytorch_lightning.trainer.samplers.epoch_order`) and the samplers that note
  and continue it (:mod:`lightning_ddp_amp.pytorch_lightning.trainer.samplers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.pytorch_lightning.trainer.resume import ResumePoint
from lightning_ddp_amp.pytorch_lightning.trainer.samplers import (
    ResumableRandomSampler,
    ResumableSampler,
    ResumableSequentialSampler,
    ResumedEpoch,
)


@dataclass(frozen=True)
class DataLayout:
    """What decides which samples the n-th batch of an epoch holds on each rank.

    "b batches of epoch e are trained" names the same samples only under the same layout.

    Args:
        world_size: Number of ranks (1 for one process).
        dataset_length: ``len(dataset)``; None for a dataset without one.
        global_batch: Samples per step over all ranks; None for a batch sampler without a ``batch_size``.
        split_batches: ``EnvDDPStrategy(split_batches=...)``.
        seed: Seed of the shuffled order (``PL_GLOBAL_SEED``).
        shuffle: ``DataLoader(shuffle=...)``; None when a sampler of the user's own decides the order.
    """

    world_size: int
    dataset_length: int | None
    global_batch: int | None
    split_batches: bool
    seed: int
    shuffle: bool | None

    @classmethod
    def of(
        cls,
        loader: DataLoader[Any],
        source: Sampler[Any] | Iterable[Any] | None,
        *,
        num_replicas: int,
        seed: int,
        split_batches: bool,
    ) -> DataLayout:
        """The layout of ``loader`` as each rank reads it, whose order ``source`` (the user's sampler) decides."""
        ...

    def differences(self, saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """``{field: (saved value, this layout's value)}`` for each field ``saved`` records with another value."""
        ...


def _named(field: str) -> str:
    """A layout field as messages name it: ``world_size`` -> ``world size``; arguments keep their spelling."""
    ...


class LoaderPosition:
    """A training DataLoader's place in its epoch, in its layout: Lightning saves ``state_dict()`` in checkpoints
    and hands it back to ``load_state_dict`` before the first batch of a resumed fit.

    Args:
        loader: The DataLoader each rank reads.
        layout: Its layout.
        progress: The current epoch, how many of its batches are trained, and how many it has.
        sampler: The sampler that notes its order and leaves out what a resumed epoch already trained; None for a
            one-process DataLoader with a sampler of the script's own, which starts a resumed epoch over
            (Lightning's behaviour for a DataLoader it cannot resume) unless the fit continues one mid-epoch.
        resuming: The checkpoint this fit continues from, for errors.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        layout: DataLayout,
        progress: Callable[[], tuple[int, int, int]],
        sampler: ResumableSampler | None,
        resuming: ResumePoint | None,
    ) -> None:
        ...

    def attach(self) -> None:
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def _trained(self, epoch: int, batches: int, global_batch: int) -> int:
        """How many samples of the current pass's order ``batches`` of ``epoch`` trained.

        A DataLoader shorter than the epoch cycles (Lightning's default "max_size_cycle"): its pass is ``batches``
        modulo its length in.
        """
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: leave out the samples its epoch already trained.

        Raises:
            CheckpointError: ``state`` was saved mid-epoch with another data set, seed, order or (with
                ``split_batches``) global batch, or (by a batch sampler without a ``batch_size``) by another
                number of ranks; or it is not a position envddp saved (a DataLoader that saves its own, e.g.
                torchdata's, saved by one process).
        """
        ...

    def _batches_left(self, samples: int) -> int:
        """How many batches this DataLoader yields on each rank for the rest of a pass of which ``samples`` trained."""
        ...

    def _check_layout(self, saved: Mapping[str, Any], trained: str, elastic: bool) -> None:
        ...

    def _warn_new_global_batch(self, saved: Mapping[str, Any]) -> None:
        ...


def position_of(loader: object) -> LoaderPosition | None:
    """The position envddp gave ``loader``; None for a DataLoader it did not position."""
    ...


def named_dataloaders(loaders: object, key: str = "") -> Iterator[tuple[str, DataLoader[Any]]]:
    """Each DataLoader in ``loaders`` (a DataLoader, or lists, tuples and dicts of them) with where it sits, e.g.
    ``["images"]`` or ``[1]``."""
    ...


def _warn_new_pass(resuming: ResumePoint) -> None:
    ...


def align_resumed_epoch(trainer: Any) -> int | None:
    """Once the training DataLoaders got their positions: have Lightning count the resumed epoch's batches in this
    run's world size, so that the epoch ends when the remaining samples are done.

    Lightning restored how many batches the epoch had trained in the saving run's batches, and ends the epoch when
    that count reaches the length of the DataLoader at this world size. The count is moved to that length minus the
    batches left (of the DataLoader with the most left), so the resumed epoch takes the batch indices of the last
    batches of an uninterrupted epoch at this world size: ``batch_idx``, validation and gradient accumulation count
    as they would there. At the saving world size nothing moves.

    Args:
        trainer: The Trainer, at the start of training.

    Returns:
        The batch index the resumed epoch continues at; None when no training DataLoader continues an epoch.
    """
    ...


def check_resumed_positions(train_dataloader: object, resuming: ResumePoint | None, world_size: int) -> None:
    """At the start of training: stop a fit that continues mid-epoch but whose training DataLoader got no position
    it can continue from.

    A DataLoader envddp shards would start its epoch over while Lightning counts the saved batches as trained: the
    checkpoint was written by a run that did not record its position (another strategy,
    ``Trainer(use_distributed_sampler=False)``), or Lightning did not hand the position over. A DataLoader envddp
    does not position (an IterableDataset, a sampler of the script's own, ``use_distributed_sampler=False``) starts
    its epoch over too, which names other samples on another number of ranks. With the world size the checkpoint was
    saved at, or in one process, that is Lightning's behaviour for a DataLoader it cannot resume, and Lightning or
    envddp warns.

    Args:
        train_dataloader: ``trainer.train_dataloader`` once the fit loop has set it up.
        resuming: The checkpoint the fit continues from; None for a fresh start.
        world_size: This run's number of ranks.

    Raises:
        CheckpointError: The checkpoint was saved mid-epoch, and a training DataLoader got no position while the
            checkpoint was saved by another number of ranks, or a sharded one got none.
    """
    ...


def explain_loader_state_mismatch(exception: BaseException, resuming: ResumePoint | None) -> None:
    """Explain Lightning's error when a checkpoint holds DataLoader positions that this run has no DataLoaders for.

    Args:
        exception: What the fit raised.
        resuming: The checkpoint the fit continues from, named in the explanation.
    """
    ...
