"""Give every rank its shard of a DataLoader, as the classic recipe's ``DistributedSampler`` did.

Lightning's own sampler injection always shuffles the training set, whatever the DataLoader said. The recipe
kept the user's choice, and so does :func:`shard_dataloader`:

* ``shuffle=True`` (a ``RandomSampler``) becomes ``DistributedSampler(shuffle=True)``;
* ``shuffle=False`` (a ``SequentialSampler``) becomes ``DistributedSampler(shuffle=False)``;
* any other sampler keeps its own order and is sharded by ``DistributedSamplerWrapper``;
* a DataLoader that already has a ``DistributedSampler``, or iterates an ``IterableDataset``, is left alone.

The fit loop calls ``set_epoch`` on these samplers at the start of every epoch, so the order changes between
epochs exactly as in the recipe.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler, UnrepeatedDistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.errors import StrategyConfigurationError

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

    Raises:
        StrategyConfigurationError: ``split_batches`` with a batch size that does not divide evenly, or with a
            custom batch sampler; ``exact_eval`` with an eval set it cannot shard exactly.
    """
    if stage not in SHARDED_STAGES or not isinstance(dataloader, DataLoader):
        return dataloader
    iterable = isinstance(dataloader.dataset, IterableDataset)
    source = None if iterable else _user_sampler(dataloader)
    unrepeated = exact_eval and stage != RunningStage.TRAINING
    if unrepeated:
        _check_exact_eval(dataloader, source, num_replicas)
    batch_size = _per_rank_batch_size(dataloader, num_replicas) if split_batches else None
    sampler: Sampler[Any] | Iterable[Any] | None = None
    if shard and source is not None and not isinstance(source, DistributedSampler):
        sampler = _distributed_sampler(dataloader, source, unrepeated, num_replicas=num_replicas, rank=rank, seed=seed)
    if sampler is None and batch_size is None:
        return dataloader
    return _lightning.rebuild_dataloader(dataloader, sampler or dataloader.sampler, batch_size=batch_size)


def _distributed_sampler(
    dataloader: DataLoader[Any], source: Sampler[Any] | Iterable[Any], unrepeated: bool, **kwargs: Any
) -> Sampler[Any]:
    if isinstance(source, (RandomSampler, SequentialSampler)):
        shuffle = isinstance(source, RandomSampler)
        sampler_cls = UnrepeatedDistributedSampler if unrepeated else DistributedSampler
        return sampler_cls(dataloader.dataset, shuffle=shuffle, **kwargs)
    wrapper_cls = UnrepeatedDistributedSamplerWrapper if unrepeated else DistributedSamplerWrapper
    return wrapper_cls(source, shuffle=False, **kwargs)


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


def _per_rank_batch_size(dataloader: DataLoader[Any], num_replicas: int) -> int:
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
        raise StrategyConfigurationError(
            "split_batches",
            True,
            f"DataLoader(batch_size={global_batch}) does not divide evenly across WORLD_SIZE={num_replicas} ranks",
            f"use a batch_size that is a multiple of {num_replicas}, or EnvDDPStrategy(split_batches=False)",
        )
    return global_batch // num_replicas
