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
number of ranks (:mod:`lightning_ddp_amp.trainer.position`); its sampler is one that can continue an epoch
(:mod:`lightning_ddp_amp.trainer.samplers`). Without ``split_batches`` a one-process run keeps its DataLoader, as the
plain script did (its ``RandomSampler`` yields what it always did; it only notes the state each pass starts from).
With ``split_batches``, which promises the same global batches at every world size, one process reads from the
sampler the ranks get, with one replica: a job moved between 1 and W processes, or resumed on another number,
trains the same order in every epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeGuard

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.errors import StrategyConfigurationError
from lightning_ddp_amp.trainer.position import DataLayout, LoaderPosition, named_dataloaders, position_of
from lightning_ddp_amp.trainer.resume import ResumePoint
from lightning_ddp_amp.trainer.samplers import (
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


@dataclass(frozen=True)
class Sharding:
    """How a fit hands its DataLoaders to the ranks: the same for every DataLoader :func:`shard_dataloader` rebuilds.

    Args:
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
    """

    num_replicas: int
    rank: int
    seed: int
    shard: bool = True
    split_batches: bool = False
    exact_eval: bool = False
    progress: Callable[[], tuple[int, int, int]] | None = None
    resuming: ResumePoint | None = None


def shard_dataloader(dataloader: object, stage: RunningStage | None, sharding: Sharding) -> object:
    """Return ``dataloader`` rebuilt so that this rank reads only its shard, in batches of its share.

    In one process (``num_replicas=1``) the DataLoader is returned as it is, nothing to shard or split, except two
    kinds of training DataLoader that get one replica of the ranks' sampler (:func:`_in_one_process`).

    Args:
        dataloader: What the LightningModule or DataModule returned.
        stage: The loop asking for it.
        sharding: How the fit shards its DataLoaders.

    Raises:
        StrategyConfigurationError: ``split_batches`` with a batch size that does not divide evenly, or with a
            custom batch sampler; ``exact_eval`` with an eval set it cannot shard exactly.
    """
    if stage not in SHARDED_STAGES or not isinstance(dataloader, DataLoader):
        return dataloader
    source = None if isinstance(dataloader.dataset, IterableDataset) else _user_sampler(dataloader)
    if sharding.num_replicas == 1:
        return _in_one_process(dataloader, source, stage, sharding)
    return _rebuilt(dataloader, source, stage, sharding)


def _in_one_process(
    dataloader: DataLoader[Any], source: Sampler[Any] | Iterable[Any] | None, stage: RunningStage, sharding: Sharding
) -> DataLoader[Any]:
    """One process keeps the script's DataLoader, as the plain script did; its training DataLoader still records its
    position, order and layout in checkpoints, so that a checkpoint holds a position for the same DataLoaders at
    every world size, as Lightning needs to hand them back.

    Two training DataLoaders are rebuilt with one replica of the ranks' sampler instead: under ``split_batches`` one
    whose ``RandomSampler`` or ``SequentialSampler`` must yield the global batches of every world size, and one whose
    sampler of the script's own cannot leave out what a resumed epoch already trained (the sharding wrapper yields
    the sampler's order unchanged, and can).
    """
    training = stage == RunningStage.TRAINING and sharding.shard and _shardable(source)
    if not training or _resumable_of_its_own(dataloader):
        return dataloader
    assert _shardable(source)
    if sharding.split_batches and isinstance(source, (RandomSampler, SequentialSampler)):
        return _rebuilt(dataloader, source, stage, sharding)
    if sharding.progress is None:
        return dataloader
    resumable = make_resumable(source)
    resuming = sharding.resuming
    if resumable is None and resuming is not None and resuming.mid_epoch:
        return _rebuilt(dataloader, source, stage, sharding)
    layout = DataLayout.of(dataloader, source, num_replicas=1, seed=sharding.seed, split_batches=sharding.split_batches)
    LoaderPosition(dataloader, layout, sharding.progress, resumable, resuming).attach()
    return dataloader


def _rebuilt(
    dataloader: DataLoader[Any], source: Sampler[Any] | Iterable[Any] | None, stage: RunningStage, sharding: Sharding
) -> DataLoader[Any]:
    """The DataLoader with the ranks' sampler and each rank's share of the global batch; itself when neither
    changes. A training DataLoader with ``progress`` records its position, order and layout in checkpoints."""
    unrepeated = sharding.exact_eval and stage != RunningStage.TRAINING
    if unrepeated:
        _check_exact_eval(dataloader, source, sharding.num_replicas)
    # One process has nothing to split: its batch sampler, even one of the script's own, stays as it is.
    split = sharding.split_batches and sharding.num_replicas > 1
    batch_size = _per_rank_batch_size(dataloader, sharding.num_replicas, sharding.resuming) if split else None
    sampler = _distributed_sampler(dataloader, source, unrepeated, sharding) if sharding.shard else None
    if sampler is None and batch_size is None:
        return dataloader
    rebuilt = _lightning.rebuild_dataloader(dataloader, sampler or dataloader.sampler, batch_size=batch_size)
    if isinstance(sampler, ResumableSampler) and sharding.progress is not None:
        layout = DataLayout.of(
            rebuilt,
            source,
            num_replicas=sharding.num_replicas,
            seed=sharding.seed,
            split_batches=sharding.split_batches,
        )
        LoaderPosition(rebuilt, layout, sharding.progress, sampler, sharding.resuming).attach()
    return rebuilt


def warn_unshuffled_training_shards(train_dataloader: object) -> None:
    """Warn on rank 0, once for each sharded training DataLoader, when its shards keep the dataset's order.

    Args:
        train_dataloader: ``trainer.train_dataloader`` once the fit loop has set it up: a DataLoader, or lists,
            tuples and dicts of them.
    """
    loaders = list(named_dataloaders(train_dataloader))
    for key, loader in loaders:
        sampler = _user_sampler(loader)
        if not isinstance(sampler, ResumableDistributedSampler) or sampler.shuffle:
            continue
        name = "the training DataLoader" + (f" {key}" if len(loaders) > 1 else "")
        rank_zero_warn(
            f"envddp: {name} (over {type(loader.dataset).__name__}) does not shuffle, so each rank's shard keeps"
            " the dataset's order in every epoch; the classic recipe's DistributedSampler shuffled by default, and"
            " so would Lightning's own sampler. Fix: DataLoader(..., shuffle=True); to keep the order on purpose,"
            " pass a sampler of your own, e.g. sampler=DistributedSampler(dataset, shuffle=False), or"
            " Trainer(use_distributed_sampler=False) and shard the data yourself."
        )


def _distributed_sampler(
    dataloader: DataLoader[Any], source: Sampler[Any] | Iterable[Any] | None, unrepeated: bool, sharding: Sharding
) -> Sampler[Any] | None:
    """The sampler that gives this rank its shard of ``source``'s order; None where the strategy does not shard."""
    if not _shardable(source):
        return None
    replicas, rank, seed = sharding.num_replicas, sharding.rank, sharding.seed
    if isinstance(source, (RandomSampler, SequentialSampler)):
        shuffle = isinstance(source, RandomSampler)
        sampler_cls = _lightning.UnrepeatedDistributedSampler if unrepeated else ResumableDistributedSampler
        return sampler_cls(dataloader.dataset, num_replicas=replicas, rank=rank, seed=seed, shuffle=shuffle)
    wrapper_cls = _lightning.UnrepeatedDistributedSamplerWrapper if unrepeated else ResumableDistributedSamplerWrapper
    return wrapper_cls(source, num_replicas=replicas, rank=rank, seed=seed, shuffle=False)


def _resumable_of_its_own(loader: DataLoader[Any]) -> bool:
    """Whether the user's DataLoader saves and restores its own position (torchdata's ``StatefulDataLoader``)."""
    own = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    return own and position_of(loader) is None


def _shardable(source: Sampler[Any] | Iterable[Any] | None) -> TypeGuard[Sampler[Any] | Iterable[Any]]:
    """Whether the strategy shards a DataLoader whose order ``source`` decides (None: an IterableDataset)."""
    return source is not None and not isinstance(source, DistributedSampler)


def _check_exact_eval(
    dataloader: DataLoader[Any], source: Sampler[Any] | Iterable[Any] | None, num_replicas: int
) -> None:
    if source is None:
        raise StrategyConfigurationError(
            "exact_eval",
            True,
            "an evaluation DataLoader iterates an IterableDataset, which the strategy cannot shard",
            "shard the IterableDataset by rank yourself and drop exact_eval, or evaluate a map-style dataset",
        )
    if isinstance(source, DistributedSampler):
        raise StrategyConfigurationError(
            "exact_eval",
            True,
            "an evaluation DataLoader already has a DistributedSampler, which pads the shards with duplicates",
            "drop the DistributedSampler from the evaluation DataLoader: the strategy shards it",
        )
    size = len(dataloader.dataset)  # type: ignore[arg-type]
    if size < num_replicas:
        raise StrategyConfigurationError(
            "exact_eval",
            True,
            f"an evaluation set of {size} sample(s) leaves some of the WORLD_SIZE={num_replicas} ranks without data",
            "evaluate at least one sample per rank, or drop exact_eval",
        )


def _user_sampler(dataloader: DataLoader[Any]) -> Sampler[Any] | Iterable[Any]:
    """The sampler that decides the order: a custom batch sampler's own sampler, else the DataLoader's."""
    batch_sampler = dataloader.batch_sampler
    inner: Sampler[Any] | None = getattr(batch_sampler, "sampler", None)
    return inner if inner is not None else dataloader.sampler


def _per_rank_batch_size(dataloader: DataLoader[Any], num_replicas: int, resuming: ResumePoint | None) -> int:
    global_batch = dataloader.batch_size
    if global_batch is None:
        raise StrategyConfigurationError(
            "split_batches",
            True,
            f"the DataLoader has a custom batch_sampler ({type(dataloader.batch_sampler).__name__}), so there is"
            " no global batch size to split",
            "pass DataLoader(batch_size=<global batch>), or use EnvDDPStrategy(split_batches=False) and size the"
            " batch sampler per rank",
        )
    if global_batch % num_replicas:
        problem = f"DataLoader(batch_size={global_batch}) does not divide evenly across WORLD_SIZE={num_replicas} ranks"
        fix = f"use a batch_size that is a multiple of {num_replicas}, or EnvDDPStrategy(split_batches=False)"
        if resuming is not None and resuming.mid_epoch:
            ranks = [str(n) for n in range(1, global_batch + 1) if global_batch % n == 0]
            problem += f", and {resuming.path} continues an epoch whose steps each trained {global_batch} samples"
            fix = (
                f"launch {', '.join(ranks)} rank(s) to continue it with the same global batches; or {fix} (the"
                " global batch then changes)"
            )
        raise StrategyConfigurationError("split_batches", True, problem, fix)
    return global_batch // num_replicas
