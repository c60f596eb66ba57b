# Generated from ../data.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""Give every rank its shard of a DataLoader, as the classic recipe's ``DistributedSampler`` did.

Lightning's own sampler injection always shuffles the training set, whatever the DataLoader said. The recipe
kept the user's choice, and so does :func:`shard_dataloader`:

* ``shuffle=True`` (a ``RandomSampler``) becomes ``DistributedSampler(shuffle=True)``;
* ``shuffle=False`` (a ``SequentialSampler``) becomes ``DistributedSampler(shuffle=False)``;
* any other sampler keeps its own order and is sharded by ``DistributedSamplerWrapper``;
* a DataLoader that already has a ``DistributedSampler``, or iterates an ``IterableDataset``, is left alone.

The fit loop calls ``set_epoch`` on these samplers at the start of every epoch, so the order changes between
epochs exactly as in the recipe. A training DataLoader left at ``shuffle=False`` is the exception: the recipe's
``DistributedSampler`` shuffled by default, so a script migrated by dropping the sampler but keeping
``shuffle=False`` would train on the same order every epoch; :func:`warn_unshuffled_training_shards` says so.

A sharded training DataLoader is also resumable in Lightning's sense (it has ``state_dict`` / ``load_state_dict``):
a checkpoint records the epoch, how many batches of it were trained, and the :class:`DataLayout` they were counted
in; resuming from it skips exactly those samples, in the same shuffled order and the same shards, so a crash
mid-epoch costs only the steps since the checkpoint. In one process nothing is sharded and Lightning's behaviour is
kept, but the checkpoint records the layout too. A position saved mid-epoch names the same samples only under the
same layout, so a fit that continues one under another layout (another world size, data set, batch, seed or order),
or without the position a sharded DataLoader needs, stops before its first batch with a ``CheckpointError``; a
checkpoint saved at the end of an epoch resumes under any layout.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.errors import StrategyConfigurationError
from lightning_ddp_amp.pytorch_lightning.resume import ResumePoint

#: Stages whose DataLoaders this module shards. Lightning already shards prediction without duplicates.
SHARDED_STAGES = (
    RunningStage.TRAINING,
    RunningStage.SANITY_CHECKING,
    RunningStage.VALIDATING,
    RunningStage.TESTING,
)


def shard_dataloader(
    dataloader: object,
    *,
    stage: RunningStage | None,
    num_replicas: int,
    rank: int,
    seed: int,
    shard: bool = True,
    split_batches: bool = False,
    exact_eval: bool = False,
    progress: Callable[[], tuple[int, int, int]] | None = None,
    resuming: ResumePoint | None = None,
) -> object:
    """Return ``dataloader`` rebuilt so that this rank reads only its shard, in batches of its share.

    In one process (``num_replicas=1``) the DataLoader is returned as it is: nothing to shard or split. A training
    DataLoader with ``progress`` still records its position and layout in checkpoints.

    Args:
        dataloader: What the LightningModule or DataModule returned.
        stage: The loop asking for it.
        num_replicas: World size.
        rank: Global rank.
        seed: Seed of the shuffled order (the order also depends on the epoch).
        shard: Give each rank its shard (``Trainer(use_distributed_sampler=False)`` turns this off).
        split_batches: The DataLoader's ``batch_size`` is the global batch: divide it by the world size. Applies
            whether or not the strategy shards the data.
        exact_eval: Shard validation and test sets without padding, so every sample is evaluated exactly once.
        progress: For the training DataLoader: the current epoch, how many of its batches are trained, and how
            many it has, read when a checkpoint is saved. Makes the DataLoader resumable mid-epoch.
        resuming: The checkpoint this fit continues from, named when its position cannot be continued.

    Raises:
        StrategyConfigurationError: ``split_batches`` with a batch size that does not divide evenly, or with a
            custom batch sampler; ``exact_eval`` with an eval set it cannot shard exactly.
    """
    ...


def warn_unshuffled_training_shards(train_dataloader: object) -> None:
    """Warn on rank 0, once for each sharded training DataLoader, when its shards keep the dataset's order.

    Args:
        train_dataloader: ``trainer.train_dataloader`` once the fit loop has set it up: a DataLoader, or lists,
            tuples and dicts of them.
    """
    ...


def _named_dataloaders(loaders: object, key: str) -> Iterator[tuple[str, DataLoader[Any]]]:
    """Each DataLoader in ``loaders`` with where it sits, e.g. ``["images"]`` or ``[1]``."""
    ...


class _ResumesMidEpoch:
    """For training samplers: the first pass over a resumed epoch leaves out the samples already trained on."""

    epoch: int
    _resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, samples: int) -> None:
        ...

    def __iter__(self) -> Iterator[Any]:
        ...


class ResumableDistributedSampler(_ResumesMidEpoch, DistributedSampler[Any]):
    """``DistributedSampler`` that can resume mid-epoch."""


class ResumableDistributedSamplerWrapper(_ResumesMidEpoch, DistributedSamplerWrapper):
    """Lightning's ``DistributedSamplerWrapper`` (shards a user's sampler) that can resume mid-epoch."""


def _distributed_sampler(
    dataloader: DataLoader[Any], source: Sampler[Any] | Iterable[Any], unrepeated: bool, **kwargs: Any
) -> Sampler[Any]:
    ...


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


def _saved_layout(state: Mapping[str, Any]) -> dict[str, Any]:
    """The layout a DataLoader position was saved in; of a position saved before layouts were, what it records."""
    ...


def _named(field: str) -> str:
    """A layout field as messages name it: ``world_size`` -> ``world size``; arguments keep their spelling."""
    ...


class _Position:
    """A training DataLoader's place in its epoch, in its layout: Lightning saves ``state_dict()`` in checkpoints
    and hands it back to ``load_state_dict`` before the first batch of a resumed fit.

    Args:
        loader: The DataLoader each rank reads.
        layout: Its layout.
        progress: The current epoch, how many of its batches are trained, and how many it has.
        sampler: The sampler that skips what a resumed epoch already trained; None in one process, where the
            DataLoader starts its epoch over (Lightning's behaviour for a DataLoader it cannot resume).
        resuming: The checkpoint this fit continues from, for errors.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        layout: DataLayout,
        progress: Callable[[], tuple[int, int, int]],
        sampler: Any,
        resuming: ResumePoint | None,
    ) -> None:
        ...

    def attach(self) -> None:
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: skip the samples its epoch already trained.

        Raises:
            CheckpointError: ``state`` was saved mid-epoch in another layout, or records none; or it is not a
                position envddp saved (a DataLoader that saves its own, e.g. torchdata's, saved by one process).
        """
        ...

    def _check_layout(self, saved: dict[str, Any], trained: str) -> None:
        ...


def _position_of(loader: object) -> _Position | None:
    ...


def _resumable_of_its_own(loader: DataLoader[Any]) -> bool:
    """Whether the user's DataLoader saves and restores its own position (torchdata's ``StatefulDataLoader``)."""
    ...


def _shardable(source: Sampler[Any] | Iterable[Any] | None) -> TypeGuard[Sampler[Any] | Iterable[Any]]:
    """Whether the strategy shards a DataLoader whose order ``source`` decides (None: an IterableDataset)."""
    ...


def _warn_new_pass(resuming: ResumePoint) -> None:
    ...


def check_resumed_positions(train_dataloader: object, resuming: ResumePoint | None, world_size: int) -> None:
    """At the start of training: stop a fit that continues mid-epoch but whose training DataLoader got no position
    it can continue from.

    A DataLoader envddp shards would start its epoch over while Lightning counts the saved batches as trained: the
    checkpoint was written by a run that did not record its position (one process before lightning_ddp_amp recorded
    layouts, another strategy, ``Trainer(use_distributed_sampler=False)``), or Lightning did not hand the position
    over. A DataLoader envddp does not position (an IterableDataset, a sampler of the script's own,
    ``use_distributed_sampler=False``) starts its epoch over too, which names other samples on another number of
    ranks. With the world size the checkpoint was saved at, or in one process, that is Lightning's behaviour for a
    DataLoader it cannot resume, and Lightning or envddp warns.

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


def _check_exact_eval(
    dataloader: DataLoader[Any], source: Sampler[Any] | Iterable[Any] | None, num_replicas: int
) -> None:
    ...


def _user_sampler(dataloader: DataLoader[Any]) -> Sampler[Any] | Iterable[Any]:
    """The sampler that decides the order: a custom batch sampler's own sampler, else the DataLoader's."""
    ...


def _per_rank_batch_size(dataloader: DataLoader[Any], num_replicas: int) -> int:
    ...
