# Generated from ../../ddp/data.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
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

A training DataLoader is also resumable in Lightning's sense (it has ``state_dict`` / ``load_state_dict``): a
checkpoint records the epoch, how many of its samples were trained, the order they were drawn in and the
:class:`DataLayout` they were counted in. Resuming from it trains the rest of that epoch, each remaining sample once,
on any number of ranks (an elastic resume):

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

Without ``split_batches`` a one-process run keeps its DataLoader, as the plain script did (its ``RandomSampler``
yields what it always did; it only notes the state each pass starts from). With ``split_batches``, which promises
the same global batches at every world size, one process reads from the sampler the ranks get, with one replica:
a job moved between 1 and W processes, or resumed on another number, trains the same order in every epoch. A fit that continues a mid-epoch position in another data set, seed or order, or with
``split_batches`` another global batch, or without the position a DataLoader needs, stops before its first batch
with a ``CheckpointError``; a checkpoint saved at the end of an epoch resumes under any layout.

The words, one type each:

* the *resume point* (:class:`~lightning_ddp_amp.pytorch_lightning.ddp.resume.ResumePoint`): the checkpoint a fit continues from, as a
  whole: its file, whether it was saved mid-epoch, how many positions it holds, how many ranks saved it. It words
  the errors;
* a *position* (:class:`LoaderPosition`): one training DataLoader's place in its epoch, which it saves in every
  checkpoint (epoch, batches, samples, order, layout) and continues from on resume;
* a *layout* (:class:`DataLayout`): what decides which samples the n-th batch holds on each rank; a position
  continues only in its own, except (counted in samples) for the number of ranks and, without ``split_batches``,
  the global batch;
* a *resumed epoch* (:class:`ResumedEpoch`): what a restored position continues: the samples of its order already
  trained, and where this run picks the epoch up;
* an *order* (``{"kind": ...}``, :func:`epoch_order`), and the samplers that note it and continue an epoch
  (:class:`ResumableSampler`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.pytorch_lightning.ddp.resume import ResumePoint
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


def epoch_order(order: Mapping[str, Any], length: int, epoch: int) -> list[int]:
    """The positions of an epoch's ``length`` samples in the order a checkpoint recorded, before padding and sharding.

    ``order["kind"]`` is ``"permutation"`` (``DistributedSampler(shuffle=True)``: torch's permutation of
    ``seed + epoch``), ``"generator"`` (a one-process ``RandomSampler``: its permutation from the generator state
    its pass started from), ``"sequential"``, or ``"sampler"`` (a sampler of the script's own: positions in the
    order it yields).
    """
    ...


def rest_of_epoch(order: list[int], trained: int, num_replicas: int) -> list[int]:
    """What an epoch in ``order`` has left after its first ``trained`` samples, for ``num_replicas`` ranks: padded to
    a multiple of ``num_replicas`` with the epoch's first samples, as ``DistributedSampler`` pads its epoch."""
    ...


@dataclass(frozen=True)
class ResumedEpoch:
    """The epoch a restored position continues: ``samples`` of its ``order`` (see :func:`epoch_order`) were trained.

    This run picks it up at Lightning's batch ``start`` (the saving run's count until
    :func:`align_resumed_epoch` moves it), with ``batches`` of the DataLoader left.
    """

    epoch: int
    samples: int
    order: Mapping[str, Any]
    start: int
    batches: int


class ResumableSampler:
    """A training sampler that notes the order of each pass, which checkpoints record, and whose first pass over a
    resumed epoch yields only this rank's share of what that epoch had left.

    Each subclass names the sampler it extends first, then this class, which only adds what that sampler lacks (a
    one-process sampler's class is swapped in place, :func:`make_resumable`, and CPython allows the swap only when
    the new class's first base is the old class). A subclass says what order a pass of its own takes
    (:meth:`own_order`) and iterates through :meth:`_pass` (``RandomSampler``, which notes its order as it draws,
    through :meth:`_rest_of_resumed_epoch`).
    """

    #: One process, unless the sampler (a ``DistributedSampler``) has its own.
    num_replicas: int = 1
    rank: int = 0
    epoch: int = 0
    #: The order of the pass being iterated (see :func:`epoch_order`); None before the first pass.
    order_of_pass: Mapping[str, Any] | None = None
    _resumed: ResumedEpoch | None = None
    #: The data set: a ``DistributedSampler``'s (the sharding wrapper's: its sampler, as a data set), a
    #: ``RandomSampler``'s or ``SequentialSampler``'s.
    dataset: Any
    data_source: Any

    def set_epoch(self, epoch: int) -> None:
        """Lightning sets the epoch of a sampler that has this method; the order itself does not depend on it."""
        ...

    def resume_at(self, resumed: ResumedEpoch) -> None:
        """Have the next pass over ``resumed.epoch`` yield only what that epoch had left."""
        ...

    def own_order(self) -> dict[str, Any]:
        """The order of a pass that continues nothing, as it is known before the pass starts."""
        ...

    def order_length(self) -> int:
        """How many samples an epoch's order has: the data set's (the sharding wrapper's: its sampler's)."""
        ...

    def _pass(self, own_pass: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """A pass: the rest of a resumed epoch, once; else ``own_pass()``, in :meth:`own_order`."""
        ...

    def _rest_of_resumed_epoch(self) -> list[int] | None:
        """This rank's positions of what a resumed epoch has left, once, noting its order; None for a pass that
        continues nothing."""
        ...

    def _at(self, positions: list[int]) -> Iterator[Any]:
        """The samples at ``positions`` of the epoch's order."""
        ...


class ResumableDistributedSampler(DistributedSampler[Any], ResumableSampler):
    """``DistributedSampler`` that can resume mid-epoch, on any number of ranks."""

    def own_order(self) -> dict[str, Any]:
        ...

    def __iter__(self) -> Iterator[Any]:
        ...


class ResumableDistributedSamplerWrapper(DistributedSamplerWrapper, ResumableSampler):
    """Lightning's ``DistributedSamplerWrapper`` (shards a user's sampler) that can resume mid-epoch."""

    def own_order(self) -> dict[str, Any]:
        ...

    def __iter__(self) -> Iterator[Any]:
        ...

    def _at(self, positions: list[int]) -> Iterator[Any]:
        ...


class ResumableRandomSampler(RandomSampler, ResumableSampler):
    """A one-process ``RandomSampler`` that notes the generator state each pass starts from."""

    def own_order(self) -> dict[str, Any]:
        # A pass notes its generator when it draws, at its first sample. A position saved before the first pass had
        # trained none of its epoch, which then goes in the data set's order.
        ...

    def __iter__(self) -> Iterator[int]:
        # A generator function, as RandomSampler's own: its draw from the global RNG happens at the first sample.
        ...


class ResumableSequentialSampler(SequentialSampler, ResumableSampler):
    """A one-process ``SequentialSampler`` that can continue an epoch."""

    def own_order(self) -> dict[str, Any]:
        ...

    def __iter__(self) -> Iterator[int]:
        ...


def make_resumable(source: Sampler[Any] | Iterable[Any]) -> ResumableSampler | None:
    """Have a one-process training DataLoader's ``RandomSampler`` or ``SequentialSampler`` note its order, and
    continue an epoch.

    The instance's class becomes a subclass that yields the same samples: the DataLoader, which does not allow its
    sampler to be replaced, stays the user's. None for any other sampler, and for a ``RandomSampler`` that draws
    with replacement or another number of samples than the data set has.
    """
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
