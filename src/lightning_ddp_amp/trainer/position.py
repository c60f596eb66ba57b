"""Where a training DataLoader is in its epoch, and continuing it on any number of ranks.

A training DataLoader that envddp shards (:mod:`lightning_ddp_amp.trainer.sharding`) is resumable in Lightning's sense (it
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

* the *resume point* (:class:`~lightning_ddp_amp.trainer.resume.ResumePoint`): the checkpoint a fit continues from, as a
  whole: its file, whether it was saved mid-epoch, how many positions it holds, how many ranks saved it. It words
  the errors;
* a *position* (:class:`LoaderPosition`): one training DataLoader's place in its epoch, which it saves in every
  checkpoint (epoch, batches, samples, order, layout) and continues from on resume;
* a *layout* (:class:`DataLayout`): what decides which samples the n-th batch holds on each rank; a position
  continues only in its own, except (counted in samples) for the number of ranks and, without ``split_batches``,
  the global batch;
* a *resumed epoch* (:class:`~lightning_ddp_amp.trainer.samplers.ResumedEpoch`): what a restored position continues:
  the samples of its order already trained, and where this run picks the epoch up;
* an *order* (``{"kind": ...}``, :func:`~lightning_ddp_amp.trainer.samplers.epoch_order`) and the samplers that note
  and continue it (:mod:`lightning_ddp_amp.trainer.samplers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.trainer.resume import ResumePoint
from lightning_ddp_amp.trainer.samplers import (
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
        per_rank = (
            loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
        )
        try:
            length: int | None = len(loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            length = None
        order = {
            RandomSampler: True,
            ResumableRandomSampler: True,
            SequentialSampler: False,
            ResumableSequentialSampler: False,
        }.get(type(source))
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


def _named(field: str) -> str:
    """A layout field as messages name it: ``world_size`` -> ``world size``; arguments keep their spelling."""
    return field if field == "split_batches" else field.replace("_", " ")


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
        self.loader = loader
        self.layout = layout
        self._progress = progress
        self._sampler = sampler
        self._resuming = resuming or ResumePoint("checkpoint", mid_epoch=True, loader_states=1)
        #: Whether a checkpoint handed this DataLoader a position.
        self.restored = False
        #: The epoch this fit resumed in the middle of, once restored; moved by :func:`align_resumed_epoch`.
        self.resumed: ResumedEpoch | None = None

    def attach(self) -> None:
        _lightning.make_stateful(self.loader, self.state_dict, self.load_state_dict)

    def state_dict(self) -> dict[str, Any]:
        epoch, batches, epoch_batches = self._progress()
        state: dict[str, Any] = {
            "epoch": epoch,
            "batches": batches,
            "epoch_batches": epoch_batches,
            "layout": dataclasses.asdict(self.layout),
        }
        if self.layout.global_batch is not None:
            state["samples"] = self._trained(epoch, batches, self.layout.global_batch)
        order = self._sampler.order_of_pass if self._sampler is not None else {"kind": "sampler"}
        if order is not None:
            state["order"] = dict(order)
        return state

    def _trained(self, epoch: int, batches: int, global_batch: int) -> int:
        """How many samples of the current pass's order ``batches`` of ``epoch`` trained.

        A DataLoader shorter than the epoch cycles (Lightning's default "max_size_cycle"): its pass is ``batches``
        modulo its length in.
        """
        passes = max(len(self.loader), 1)
        resumed = self.resumed
        if resumed is None or resumed.epoch != epoch:
            return batches % passes * global_batch
        since = batches - resumed.start
        if since < resumed.batches:  # still in the resumed pass
            return resumed.samples + since * global_batch
        return (since - resumed.batches) % passes * global_batch

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: leave out the samples its epoch already trained.

        Raises:
            CheckpointError: ``state`` was saved mid-epoch with another data set, seed, order or (with
                ``split_batches``) global batch, or (by a batch sampler without a ``batch_size``) by another
                number of ranks; or it is not a position envddp saved (a DataLoader that saves its own, e.g.
                torchdata's, saved by one process).
        """
        self.restored = True
        if not {"epoch", "batches", "epoch_batches", "layout"} <= state.keys():
            raise self._resuming.refuse(
                f"the training DataLoader position it holds is not one envddp saved (it has {sorted(state)}: a"
                " DataLoader that saves its own position, in one process), so this run cannot tell which samples"
                " that epoch has already trained",
                "relaunch as that run was launched",
            )
        epoch, batches = int(state["epoch"]), int(state["batches"])
        epoch_batches = int(state["epoch_batches"])
        if batches >= epoch_batches:
            # The epoch was finished: the next starts from its beginning, in any layout. Set the epoch now:
            # Lightning fetches the first batch before it sets the epoch of a resumed run.
            if self._sampler is not None:
                self._sampler.set_epoch(epoch + 1)
            return
        saved = state["layout"]
        # Without a global batch (a batch sampler without a batch_size) a position cannot count its samples: it
        # continues only in its own layout.
        elastic = "samples" in state
        self._check_layout(saved, f"{batches} of the {epoch_batches} batches of epoch {epoch}", elastic)
        if self._sampler is None or ("order" not in state and saved.get("world_size") == 1):
            _warn_new_pass(self._resuming)  # the order of that pass is not known
            return
        if self.layout.global_batch is None:
            raise self._resuming.refuse(
                f"it was saved after {batches} batches of epoch {epoch}, and this run's training DataLoader has a"
                f" batch sampler ({type(self.loader.batch_sampler).__name__}) without a batch_size, so the number of"
                " samples those batches took is unknown",
                "give the batch sampler a fixed batch_size attribute",
            )
        # A sampler saved before its first pass noted no order: its own.
        samples, order = int(state["samples"]), state.get("order") or self._sampler.own_order()
        self._warn_new_global_batch(saved)
        self._sampler.set_epoch(epoch)
        resumed = ResumedEpoch(epoch, samples, order, start=batches, batches=self._batches_left(samples))
        self._sampler.resume_at(resumed)
        self.resumed = resumed

    def _batches_left(self, samples: int) -> int:
        """How many batches this DataLoader yields on each rank for the rest of a pass of which ``samples`` trained."""
        assert self._sampler is not None and self.layout.global_batch is not None
        world = self.layout.world_size
        per_rank = -(-(self._sampler.order_length() - samples) // world)
        batch = self.layout.global_batch // world
        drop_last = getattr(self.loader.batch_sampler, "drop_last", False)
        return per_rank // batch if drop_last else -(-per_rank // batch)

    def _check_layout(self, saved: Mapping[str, Any], trained: str, elastic: bool) -> None:
        differences = self.layout.differences(saved)
        if elastic:  # another number of ranks, and without split_batches another global batch, continue
            for name in ("world_size", "split_batches", *(() if self.layout.split_batches else ("global_batch",))):
                differences.pop(name, None)
        if differences:
            then = ", ".join(f"{_named(name)} {old}" for name, (old, _) in differences.items())
            told = "; ".join(f"{_named(name)} {old} then, {new} now" for name, (old, new) in differences.items())
            raise self._resuming.refuse(
                f"it was saved after {trained} had trained, by a run that laid the training data out otherwise"
                f" ({told}), so this run cannot tell which samples that epoch has already trained",
                f"relaunch with that run's layout ({then})",
            )

    def _warn_new_global_batch(self, saved: Mapping[str, Any]) -> None:
        before, now, ranks = saved.get("global_batch"), self.layout.global_batch, saved.get("world_size")
        if before is None or now is None or before == now:
            return
        rank_zero_warn(
            f"envddp: {self._resuming.path} was saved by {ranks} rank(s) training {before} samples per step; this run"
            f" of {self.layout.world_size} rank(s) keeps each rank's batch of {now // self.layout.world_size}, so"
            f" the rest of the epoch trains {now} samples per step (each remaining sample once). The learning rate"
            f" is left as it was: scaling it to the new global batch (e.g. by {now}/{before}) is your choice."
            " EnvDDPStrategy(split_batches=True) keeps the global batch instead."
        )


def position_of(loader: object) -> LoaderPosition | None:
    """The position envddp gave ``loader``; None for a DataLoader it did not position."""
    owner = getattr(getattr(loader, "state_dict", None), "__self__", None)
    return owner if isinstance(owner, LoaderPosition) else None


def named_dataloaders(loaders: object, key: str = "") -> Iterator[tuple[str, DataLoader[Any]]]:
    """Each DataLoader in ``loaders`` (a DataLoader, or lists, tuples and dicts of them) with where it sits, e.g.
    ``["images"]`` or ``[1]``."""
    if isinstance(loaders, DataLoader):
        yield key, loaders
    elif isinstance(loaders, dict):
        for name, inner in loaders.items():
            yield from named_dataloaders(inner, f"{key}[{name!r}]")
    elif isinstance(loaders, (list, tuple)):
        for index, inner in enumerate(loaders):
            yield from named_dataloaders(inner, f"{key}[{index}]")


def _warn_new_pass(resuming: ResumePoint) -> None:
    rank_zero_warn(
        f"envddp: {resuming.path} was saved in the middle of an epoch, and in one process the training DataLoader"
        " cannot be resumed there (Lightning's behaviour for a DataLoader that keeps its own order): the rest of"
        " this epoch comes from a new pass over it, so some samples are trained twice this epoch and others not at"
        " all. Resume from a checkpoint saved at the end of an epoch to train each sample once per epoch."
    )


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
    positions = [
        position
        for _, loader in named_dataloaders(trainer.train_dataloader)
        if (position := position_of(loader)) is not None and position.resumed is not None
    ]
    if not positions:
        return None
    trained, total = _lightning.epoch_progress(trainer)
    left = max(position.resumed.batches for position in positions if position.resumed is not None)
    start = max(0, total - left) if total != float("inf") else trained
    if start != trained:
        _lightning.move_epoch_batches(trainer, start - trained)
    for position in positions:
        assert position.resumed is not None
        position.resumed = dataclasses.replace(position.resumed, start=start)
    return int(start)


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
    if resuming is None or not resuming.mid_epoch:
        return
    for key, loader in named_dataloaders(train_dataloader):
        position = position_of(loader)
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
                "holds no position of a training DataLoader (a checkpoint of another strategy, or of"
                " Trainer(use_distributed_sampler=False))"
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
