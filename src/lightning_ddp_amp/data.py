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

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_ddp_amp import _lightning
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
    rebuilt = _lightning.rebuild_dataloader(dataloader, sampler or dataloader.sampler, batch_size=batch_size)
    if isinstance(sampler, _ResumesMidEpoch) and progress is not None:
        _make_resumable(rebuilt, sampler, progress)
    return rebuilt


def warn_unshuffled_training_shards(train_dataloader: object) -> None:
    """Warn on rank 0, once for each sharded training DataLoader, when its shards keep the dataset's order.

    Args:
        train_dataloader: ``trainer.train_dataloader`` once the fit loop has set it up: a DataLoader, or lists,
            tuples and dicts of them.
    """
    loaders = list(_named_dataloaders(train_dataloader, ""))
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


def _named_dataloaders(loaders: object, key: str) -> Iterator[tuple[str, DataLoader[Any]]]:
    """Each DataLoader in ``loaders`` with where it sits, e.g. ``["images"]`` or ``[1]``."""
    if isinstance(loaders, DataLoader):
        yield key, loaders
    elif isinstance(loaders, dict):
        for name, inner in loaders.items():
            yield from _named_dataloaders(inner, f"{key}[{name!r}]")
    elif isinstance(loaders, (list, tuple)):
        for index, inner in enumerate(loaders):
            yield from _named_dataloaders(inner, f"{key}[{index}]")


class _ResumesMidEpoch:
    """For training samplers: the first pass over a resumed epoch leaves out the samples already trained on."""

    epoch: int
    _resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, samples: int) -> None:
        self._resume = (epoch, samples)

    def __iter__(self) -> Iterator[Any]:
        indices: Iterator[Any] = super().__iter__()  # type: ignore[misc]
        if self._resume is None or self._resume[0] != self.epoch:
            return indices
        skip = self._resume[1]
        self._resume = None
        return itertools.islice(indices, skip, None)


class ResumableDistributedSampler(_ResumesMidEpoch, DistributedSampler[Any]):
    """``DistributedSampler`` that can resume mid-epoch."""


class ResumableDistributedSamplerWrapper(_ResumesMidEpoch, DistributedSamplerWrapper):
    """Lightning's ``DistributedSamplerWrapper`` (shards a user's sampler) that can resume mid-epoch."""


def _distributed_sampler(
    dataloader: DataLoader[Any], source: Sampler[Any] | Iterable[Any], unrepeated: bool, **kwargs: Any
) -> Sampler[Any]:
    if isinstance(source, (RandomSampler, SequentialSampler)):
        shuffle = isinstance(source, RandomSampler)
        sampler_cls = _lightning.UnrepeatedDistributedSampler if unrepeated else ResumableDistributedSampler
        return sampler_cls(dataloader.dataset, shuffle=shuffle, **kwargs)
    wrapper_cls = _lightning.UnrepeatedDistributedSamplerWrapper if unrepeated else ResumableDistributedSamplerWrapper
    return wrapper_cls(source, shuffle=False, **kwargs)


def _make_resumable(loader: DataLoader[Any], sampler: Any, progress: Callable[[], tuple[int, int]]) -> None:
    """Give ``loader`` the ``state_dict`` / ``load_state_dict`` Lightning looks for in a resumable DataLoader.

    Lightning stores the state in checkpoints and hands it back before the first batch after a restart.
    """
    batch_size = loader.batch_size or 1
    layout = {"num_replicas": sampler.num_replicas, "seed": sampler.seed, "batch_size": batch_size}

    def state_dict() -> dict[str, Any]:
        batches, epoch_batches = progress()
        return {"epoch": sampler.epoch, "batches": batches, "epoch_batches": epoch_batches, **layout}

    def load_state_dict(state: dict[str, Any]) -> None:
        epoch, batches = int(state["epoch"]), int(state["batches"])
        # Set the epoch now: Lightning fetches the first batch before it sets the epoch of a resumed run.
        if batches >= int(state.get("epoch_batches", len(loader))):
            sampler.set_epoch(epoch + 1)  # the epoch was finished: the next starts from its beginning
            return
        saved = {key: state.get(key) for key in layout}
        if saved != layout:
            raise CheckpointError(
                "checkpoint",
                saved,
                f"it was saved in the middle of an epoch by a job sharded as {saved}, but this job is sharded as"
                f" {layout}, so the samples already trained on cannot be told apart",
                "resume with the same WORLD_SIZE, seed and batch size, or from a checkpoint saved at the end of an"
                " epoch",
            )
        # A loader shorter than the epoch cycles (Lightning's default "max_size_cycle"): it stands batches % len in.
        sampler.set_epoch(epoch)
        sampler.resume_at(epoch, batches % max(len(loader), 1) * batch_size)

    _lightning.make_stateful(loader, state_dict, load_state_dict)


def explain_loader_state_mismatch(exception: BaseException) -> None:
    """Explain Lightning's error when a checkpoint holds a sharded loader's position that this run cannot use."""
    if _lightning.is_loader_state_mismatch(exception) and exception.args:
        exception.args = (
            "The checkpoint holds the position of a training DataLoader sharded across several processes, saved in"
            " the middle of an epoch; this run does not shard its DataLoaders the same way (another WORLD_SIZE, or"
            " Trainer(use_distributed_sampler=False)). Resume with the original launch, or from a checkpoint saved"
            f" at the end of an epoch. Lightning said: {exception}",
            *exception.args[1:],
        )


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
