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

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.errors import StrategyConfigurationError
from lightning_ddp_amp.resume import ResumePoint

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
    if stage not in SHARDED_STAGES or not isinstance(dataloader, DataLoader):
        return dataloader
    iterable = isinstance(dataloader.dataset, IterableDataset)
    source = None if iterable else _user_sampler(dataloader)
    if num_replicas == 1:
        # Nothing to shard or split. The training DataLoader still records its position and layout: a checkpoint
        # then holds a position for the same DataLoaders at every world size, as Lightning needs to hand them back.
        training = stage == RunningStage.TRAINING and shard and _shardable(source)
        if training and progress is not None and not _resumable_of_its_own(dataloader):
            layout = DataLayout.of(dataloader, source, num_replicas=1, seed=seed, split_batches=split_batches)
            _Position(dataloader, layout, progress, None, resuming).attach()
        return dataloader
    unrepeated = exact_eval and stage != RunningStage.TRAINING
    if unrepeated:
        _check_exact_eval(dataloader, source, num_replicas)
    batch_size = _per_rank_batch_size(dataloader, num_replicas) if split_batches else None
    sampler: Sampler[Any] | Iterable[Any] | None = None
    if shard and _shardable(source):
        sampler = _distributed_sampler(dataloader, source, unrepeated, num_replicas=num_replicas, rank=rank, seed=seed)
    if sampler is None and batch_size is None:
        return dataloader
    rebuilt = _lightning.rebuild_dataloader(dataloader, sampler or dataloader.sampler, batch_size=batch_size)
    if isinstance(sampler, _ResumesMidEpoch) and progress is not None:
        layout = DataLayout.of(rebuilt, source, num_replicas=num_replicas, seed=seed, split_batches=split_batches)
        _Position(rebuilt, layout, progress, sampler, resuming).attach()
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
        per_rank = (
            loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
        )
        try:
            length: int | None = len(loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            length = None
        order = {RandomSampler: True, SequentialSampler: False}.get(type(source))
        return cls(
            world_size=num_replicas,
            dataset_length=length,
            global_batch=per_rank * num_replicas if isinstance(per_rank, int) else None,
            split_batches=split_batches,
            seed=seed,
            shuffle=order,
        )

    def differences(self, saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """``{field: (saved value, this layout's value)}`` for each field ``saved`` records with another value."""
        current = dataclasses.asdict(self)
        return {
            name: (saved[name], current[name]) for name in current if name in saved and saved[name] != current[name]
        }


def _saved_layout(state: Mapping[str, Any]) -> dict[str, Any]:
    """The layout a DataLoader position was saved in; of a position saved before layouts were, what it records."""
    if "layout" in state:
        return dict(state["layout"])
    # Before: the world size, the seed and the batch size of each rank.
    saved = {"world_size": state.get("num_replicas"), "seed": state.get("seed")}
    if state.get("num_replicas") is not None and state.get("batch_size") is not None:
        saved["global_batch"] = int(state["batch_size"]) * int(state["num_replicas"])
    return {name: value for name, value in saved.items() if value is not None}


def _named(field: str) -> str:
    """A layout field as messages name it: ``world_size`` -> ``world size``; arguments keep their spelling."""
    return field if field == "split_batches" else field.replace("_", " ")


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
        self.loader = loader
        self.layout = layout
        self._progress = progress
        self._sampler = sampler
        self._resuming = resuming or ResumePoint("checkpoint", mid_epoch=True, loader_states=1)
        #: Whether a checkpoint handed this DataLoader a position.
        self.restored = False

    def attach(self) -> None:
        _lightning.make_stateful(self.loader, self.state_dict, self.load_state_dict)

    def state_dict(self) -> dict[str, Any]:
        epoch, batches, epoch_batches = self._progress()
        return {
            "epoch": epoch,
            "batches": batches,
            "epoch_batches": epoch_batches,
            "layout": dataclasses.asdict(self.layout),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: skip the samples its epoch already trained.

        Raises:
            CheckpointError: ``state`` was saved mid-epoch in another layout, or records none; or it is not a
                position envddp saved (a DataLoader that saves its own, e.g. torchdata's, saved by one process).
        """
        self.restored = True
        if not {"epoch", "batches"} <= state.keys():
            raise self._resuming.refuse(
                f"the training DataLoader position it holds is not one envddp saved (it has {sorted(state)}: a"
                " DataLoader that saves its own position, in one process), so this run cannot tell which samples"
                " that epoch has already trained",
                "relaunch as that run was launched",
            )
        epoch, batches = int(state["epoch"]), int(state["batches"])
        epoch_batches = int(state.get("epoch_batches", len(self.loader)))
        if batches >= epoch_batches:
            # The epoch was finished: the next starts from its beginning, in any layout. Set the epoch now:
            # Lightning fetches the first batch before it sets the epoch of a resumed run.
            if self._sampler is not None:
                self._sampler.set_epoch(epoch + 1)
            return
        self._check_layout(_saved_layout(state), f"{batches} of the {epoch_batches} batches of epoch {epoch}")
        if self._sampler is None:
            _warn_new_pass(self._resuming)
            return
        if self.layout.global_batch is None:
            raise self._resuming.refuse(
                f"it was saved after {batches} batches of epoch {epoch}, and this run's training DataLoader has a"
                f" batch sampler ({type(self.loader.batch_sampler).__name__}) without a batch_size, so the number of"
                " samples those batches took is unknown",
                "give the batch sampler a fixed batch_size attribute",
            )
        per_rank = self.layout.global_batch // self.layout.world_size
        # A loader shorter than the epoch cycles (Lightning's default "max_size_cycle"): it stands batches % len in.
        self._sampler.set_epoch(epoch)
        self._sampler.resume_at(epoch, batches % max(len(self.loader), 1) * per_rank)

    def _check_layout(self, saved: dict[str, Any], trained: str) -> None:
        differences = self.layout.differences(saved)
        if "world_size" not in saved or differences:
            then = ", ".join(f"{_named(name)} {old}" for name, (old, _) in differences.items())
            told = (
                "; ".join(f"{_named(name)} {old} then, {new} now" for name, (old, new) in differences.items())
                or "it records no layout"
            )
            raise self._resuming.refuse(
                f"it was saved after {trained} had trained, by a run that laid the training data out otherwise"
                f" ({told}), so this run cannot tell which samples that epoch has already trained",
                f"relaunch with that run's layout ({then})" if then else "relaunch as that run was launched",
            )
        unchecked = [name for name in dataclasses.asdict(self.layout) if name not in saved]
        if unchecked:
            rank_zero_warn(
                f"envddp: {self._resuming.path} was saved mid-epoch by an older lightning_ddp_amp, which recorded"
                f" only the world size, seed and batch size of the training data; they match, but its"
                f" {', '.join(map(_named, unchecked))} could not be compared. If the training data"
                " changed since, resume from a checkpoint saved at the end of an epoch."
            )


def _position_of(loader: object) -> _Position | None:
    owner = getattr(getattr(loader, "state_dict", None), "__self__", None)
    return owner if isinstance(owner, _Position) else None


def _resumable_of_its_own(loader: DataLoader[Any]) -> bool:
    """Whether the user's DataLoader saves and restores its own position (torchdata's ``StatefulDataLoader``)."""
    own = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    return own and _position_of(loader) is None


def _shardable(source: Sampler[Any] | Iterable[Any] | None) -> TypeGuard[Sampler[Any] | Iterable[Any]]:
    """Whether the strategy shards a DataLoader whose order ``source`` decides (None: an IterableDataset)."""
    return source is not None and not isinstance(source, DistributedSampler)


def _warn_new_pass(resuming: ResumePoint) -> None:
    rank_zero_warn(
        f"envddp: {resuming.path} was saved in the middle of an epoch, and in one process the training DataLoader"
        " cannot be resumed there (Lightning's behaviour for a DataLoader that keeps its own order): the rest of"
        " this epoch comes from a new pass over it, so some samples are trained twice this epoch and others not at"
        " all. Resume from a checkpoint saved at the end of an epoch to train each sample once per epoch."
    )


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
    if resuming is None or not resuming.mid_epoch:
        return
    for key, loader in _named_dataloaders(train_dataloader, ""):
        position = _position_of(loader)
        if position is not None and position.restored:
            continue
        if resuming.world_size is not None and resuming.world_size != world_size:
            name = "the training DataLoader" + key
            raise resuming.refuse(
                f"it was saved in the middle of an epoch by {resuming.world_size} rank(s), and {name} of this run of"
                f" {world_size} got no position envddp can check (an IterableDataset, a sampler of the script's own,"
                " Trainer(use_distributed_sampler=False), or a position Lightning did not hand over), so this run"
                " cannot tell which samples that epoch has already trained",
                f"relaunch with {resuming.world_size} rank(s)",
            )
        if position is None:
            continue  # not envddp's to position, at the world size it was saved at: Lightning's behaviour, warned
        if world_size == 1:
            _warn_new_pass(resuming)
            continue
        if resuming.loader_states == 0:
            held = (
                "holds no position of a training DataLoader (a checkpoint of one process before lightning_ddp_amp"
                " recorded them, of another strategy, or of Trainer(use_distributed_sampler=False))"
            )
            continue_exactly = "relaunch as that run was launched"
        else:
            # Lightning hands saved positions over only when it sets the training DataLoader up after restoring the
            # checkpoint; reading trainer.estimated_stepping_batches in configure_optimizers sets it up before.
            held = (
                f"holds {resuming.loader_states} DataLoader position(s), but Lightning handed none to this one (it"
                " does not when the training DataLoader was set up before the checkpoint was restored, as reading"
                " trainer.estimated_stepping_batches in configure_optimizers does)"
            )
            continue_exactly = (
                "compute the number of steps in configure_optimizers without trainer.estimated_stepping_batches"
                " (from the DataLoader's length and max_epochs)"
            )
        raise resuming.refuse(
            f"it was saved in the middle of an epoch and {held}, so this run of {world_size} ranks"
            " cannot tell which samples that epoch has already trained",
            continue_exactly,
        )


def explain_loader_state_mismatch(exception: BaseException, resuming: ResumePoint | None) -> None:
    """Explain Lightning's error when a checkpoint holds DataLoader positions that this run has no DataLoaders for.

    Args:
        exception: What the fit raised.
        resuming: The checkpoint the fit continues from, named in the explanation.
    """
    if not (_lightning.is_loader_state_mismatch(exception) and exception.args):
        return
    problem = (
        "it holds the positions of training DataLoaders saved in the middle of an epoch, but this run has another"
        " number of training DataLoaders that take one (other DataLoaders, or Trainer(use_distributed_sampler=...)"
        " changed)"
    )
    fix = "resume with the original DataLoaders and launch"
    explained = (
        str(resuming.refuse(problem, fix))
        if resuming is not None
        else f"The checkpoint {problem}. Fix: {fix}, or from a checkpoint saved at the end of an epoch"
    )
    exception.args = (f"{explained}. Lightning said: {exception}", *exception.args[1:])


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
