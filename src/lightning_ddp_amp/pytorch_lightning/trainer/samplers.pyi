# Generated from ../../trainer/samplers.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""The training samplers that note the order of each pass and continue a resumed epoch, on any number of ranks.

A checkpoint records the order of the epoch it was saved in (an *order*, ``{"kind": ...}``, see :func:`epoch_order`).
A fit resumed from it hands the training sampler a :class:`ResumedEpoch`, and the sampler's next pass over that epoch
yields only this rank's share of what the epoch had left (:func:`rest_of_epoch`). What they share,
:class:`ResumableSampler`, is written once; each sampler adds only how it orders a pass of its own:

* :class:`ResumableDistributedSampler`: ``DistributedSampler``, for a DataLoader's ``shuffle=True`` or ``False`` on
  several ranks (and under ``split_batches`` in one process);
* :class:`ResumableDistributedSamplerWrapper`: Lightning's wrapper that shards a sampler of the script's own;
* :class:`ResumableRandomSampler`, :class:`ResumableSequentialSampler`: a one-process DataLoader's own sampler,
  whose class :func:`make_resumable` swaps in place.

:mod:`lightning_ddp_amp.pytorch_lightning.trainer.sharding` builds them; a DataLoader's position (:mod:`lightning_ddp_amp.pytorch_lightning.trainer.position`)
records their order and resumes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DistributedSampler, RandomSampler, Sampler, SequentialSampler


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
    :func:`~lightning_ddp_amp.pytorch_lightning.trainer.position.align_resumed_epoch` moves it), with ``batches`` of the DataLoader left.
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
