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
a checkpoint records the epoch and how many batches of it were trained, and resuming from it skips exactly those
samples, in the same shuffled order and the same shards, so a crash mid-epoch costs only the steps since the
checkpoint.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.errors import CheckpointError, StrategyConfigurationError

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
    progress: Callable[[], tuple[int, int]] | None = None,
) -> object:
    """Return ``dataloader`` rebuilt so that this rank reads only its shard, in batches of its share.

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
        progress: For the training DataLoader: how many batches of the current epoch are trained, and how many
            the epoch has, read when a checkpoint is saved. Makes the DataLoader resumable mid-epoch.

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


def _make_resumable(loader: DataLoader[Any], sampler: Any, progress: Callable[[], tuple[int, int]]) -> None:
    """Give ``loader`` the ``state_dict`` / ``load_state_dict`` Lightning looks for in a resumable DataLoader.

    Lightning stores the state in checkpoints and hands it back before the first batch after a restart.
    """
    ...


def explain_loader_state_mismatch(exception: BaseException) -> None:
    """Explain Lightning's error when a checkpoint holds a sharded loader's position that this run cannot use."""
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
