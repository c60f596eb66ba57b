# Generated from ../../trainer/sharding.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
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

A training DataLoader also gets a position in its epoch, which checkpoints record and a resumed fit continues on any
number of ranks (:mod:`lightning_ddp_amp.pytorch_lightning.trainer.position`); its sampler is one that can continue an epoch
(:mod:`lightning_ddp_amp.pytorch_lightning.trainer.samplers`). Without ``split_batches`` a one-process run keeps its DataLoader, as the
plain script did (its ``RandomSampler`` yields what it always did; it only notes the state each pass starts from).
With ``split_batches``, which promises the same global batches at every world size, one process reads from the
sampler the ranks get, with one replica: a job moved between 1 and W processes, or resumed on another number,
trains the same order in every epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeGuard

from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.errors import StrategyConfigurationError
from lightning_ddp_amp.pytorch_lightning.trainer.position import DataLayout, LoaderPosition, named_dataloaders, position_of
from lightning_ddp_amp.pytorch_lightning.trainer.resume import ResumePoint
from lightning_ddp_amp.pytorch_lightning.trainer.samplers import (
    ResumableDistributedSampler,
    ResumableDistributedSamplerWrapper,
    ResumableSampler,
    make_resumable,
)

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
    DataLoader with ``progress`` still records its position, order and layout in checkpoints; one with a sampler of
    the script's own that continues an epoch is rebuilt with one replica of the sharding wrapper, which yields the
    sampler's order unchanged but can leave out what the epoch already trained. Under ``split_batches`` a training
    ``RandomSampler`` or ``SequentialSampler`` is replaced by one replica of the ranks' ``DistributedSampler``, so
    that one process trains the global batches of every world size.

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


def _distributed_sampler(
    dataloader: DataLoader[Any], source: Sampler[Any] | Iterable[Any], unrepeated: bool, **kwargs: Any
) -> Sampler[Any]:
    ...


def _resumable_of_its_own(loader: DataLoader[Any]) -> bool:
    """Whether the user's DataLoader saves and restores its own position (torchdata's ``StatefulDataLoader``)."""
    ...


def _shardable(source: Sampler[Any] | Iterable[Any] | None) -> TypeGuard[Sampler[Any] | Iterable[Any]]:
    """Whether the strategy shards a DataLoader whose order ``source`` decides (None: an IterableDataset)."""
    ...


def _check_exact_eval(
    dataloader: DataLoader[Any], source: Sampler[Any] | Iterable[Any] | None, num_replicas: int
) -> None:
    ...


def _user_sampler(dataloader: DataLoader[Any]) -> Sampler[Any] | Iterable[Any]:
    """The sampler that decides the order: a custom batch sampler's own sampler, else the DataLoader's."""
    ...


def _per_rank_batch_size(dataloader: DataLoader[Any], num_replicas: int, resuming: ResumePoint | None) -> int:
    ...
