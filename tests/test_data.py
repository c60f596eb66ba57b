"""shard_dataloader: the sampler each rank gets, checked in one process by building every rank's loader."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler, TensorDataset

from lightning_ddp_amp import StrategyConfigurationError
from lightning_ddp_amp.data import shard_dataloader

DATASET = TensorDataset(torch.arange(10))
TRAIN = RunningStage.TRAINING
VAL = RunningStage.VALIDATING


def shards(
    loader: DataLoader, world: int = 2, stage: RunningStage = TRAIN, epoch: int = 0, **kwargs: bool
) -> list[list[int]]:
    """The sample indices each rank reads, in order."""
    result = []
    for rank in range(world):
        sharded = shard_dataloader(loader, stage=stage, num_replicas=world, rank=rank, seed=0, **kwargs)
        assert isinstance(sharded, DataLoader)
        for sampler in (sharded.sampler, getattr(sharded.batch_sampler, "sampler", None)):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        result.append([int(i) for (batch,) in sharded for i in batch])
    return result


def test_unshuffled_training_set_stays_in_order() -> None:
    # Lightning's own injection would shuffle it; the recipe's DistributedSampler(shuffle=False) does not.
    assert shards(DataLoader(DATASET, batch_size=2)) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


def test_shuffled_training_set_is_disjoint_complete_and_reshuffled_each_epoch() -> None:
    loader = DataLoader(DATASET, batch_size=2, shuffle=True)
    epoch0, epoch1 = shards(loader, epoch=0), shards(loader, epoch=1)
    for epoch in (epoch0, epoch1):
        assert sorted(epoch[0] + epoch[1]) == list(range(10))
    assert epoch0 != epoch1
    assert epoch0 != [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


def test_shuffled_order_matches_the_recipes_distributed_sampler() -> None:
    loader = DataLoader(DATASET, batch_size=2, shuffle=True)
    recipe = DistributedSampler(DATASET, num_replicas=2, rank=1, shuffle=True, seed=0)
    recipe.set_epoch(3)
    assert shards(loader, epoch=3)[1] == list(recipe)


class EvenFirst(Sampler[int]):
    """A user sampler with an order of its own."""

    def __iter__(self) -> Iterator[int]:
        return iter([0, 2, 4, 6, 8, 1, 3, 5, 7, 9])

    def __len__(self) -> int:
        return 10


def test_custom_sampler_keeps_its_order_and_is_sharded() -> None:
    assert shards(DataLoader(DATASET, batch_size=5, sampler=EvenFirst())) == [[0, 4, 8, 3, 7], [2, 6, 1, 5, 9]]


class Pairs(BatchSampler):
    """A user batch sampler (a BatchSampler subclass, as Lightning requires for injection)."""


def test_custom_batch_sampler_receives_the_distributed_sampler() -> None:
    loader = DataLoader(DATASET, batch_sampler=Pairs(EvenFirst(), batch_size=2, drop_last=False))
    sharded = shard_dataloader(loader, stage=TRAIN, num_replicas=2, rank=0, seed=0)
    assert isinstance(sharded.batch_sampler, Pairs)
    assert shards(loader) == [[0, 4, 8, 3, 7], [2, 6, 1, 5, 9]]


def test_a_loader_already_sharded_by_the_user_is_left_alone() -> None:
    loader = DataLoader(DATASET, sampler=DistributedSampler(DATASET, num_replicas=2, rank=0))
    assert shard_dataloader(loader, stage=TRAIN, num_replicas=2, rank=1, seed=0) is loader


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


def test_iterable_datasets_are_left_alone() -> None:
    loader = DataLoader(Stream(), batch_size=2)
    assert shard_dataloader(loader, stage=TRAIN, num_replicas=2, rank=1, seed=0) is loader


def test_prediction_is_left_to_lightning() -> None:
    loader = DataLoader(DATASET, batch_size=2)
    assert shard_dataloader(loader, stage=RunningStage.PREDICTING, num_replicas=2, rank=1, seed=0) is loader


def test_default_eval_shards_pad_with_duplicates() -> None:
    # This is what exact_eval exists to avoid: 11 samples on 2 ranks → 12 evaluations.
    loader = DataLoader(TensorDataset(torch.arange(11)), batch_size=4)
    evaluated = [i for shard in shards(loader, stage=VAL) for i in shard]
    assert len(evaluated) == 12


@pytest.mark.parametrize("stage", [RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING])
def test_exact_eval_evaluates_every_sample_once(stage: RunningStage) -> None:
    loader = DataLoader(TensorDataset(torch.arange(11)), batch_size=4)
    evaluated = [i for shard in shards(loader, world=3, stage=stage, exact_eval=True) for i in shard]
    assert sorted(evaluated) == list(range(11))


def test_exact_eval_does_not_change_training_shards() -> None:
    loader = DataLoader(TensorDataset(torch.arange(11)), batch_size=4)
    assert sum(len(shard) for shard in shards(loader, exact_eval=True)) == 12


def test_split_batches_divides_the_global_batch() -> None:
    sharded = shard_dataloader(
        DataLoader(DATASET, batch_size=4), stage=TRAIN, num_replicas=2, rank=0, seed=0, split_batches=True
    )
    assert sharded.batch_size == 2


def test_split_batches_with_a_positional_batch_size() -> None:
    sharded = shard_dataloader(DataLoader(DATASET, 4), stage=TRAIN, num_replicas=2, rank=0, seed=0, split_batches=True)
    assert sharded.batch_size == 2


def test_split_batches_with_an_indivisible_batch_is_an_error() -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        shard_dataloader(
            DataLoader(DATASET, batch_size=5), stage=TRAIN, num_replicas=2, rank=0, seed=0, split_batches=True
        )
    assert str(raised.value).startswith(
        "split_batches=True: DataLoader(batch_size=5) does not divide evenly across WORLD_SIZE=2 ranks. Fix: use a"
        " batch_size that is a multiple of 2"
    )


def test_split_batches_with_a_custom_batch_sampler_is_an_error() -> None:
    loader = DataLoader(DATASET, batch_sampler=Pairs(EvenFirst(), batch_size=2, drop_last=False))
    with pytest.raises(
        StrategyConfigurationError, match=r"^split_batches=True: the DataLoader has a custom batch_sampler \(Pairs\)"
    ):
        shard_dataloader(loader, stage=TRAIN, num_replicas=2, rank=0, seed=0, split_batches=True)


def test_split_batches_applies_when_the_user_shards_the_data_himself() -> None:
    loader = DataLoader(DATASET, batch_size=4)
    sharded = shard_dataloader(loader, stage=TRAIN, num_replicas=2, rank=0, seed=0, shard=False, split_batches=True)
    assert sharded.batch_size == 2
    assert isinstance(sharded.sampler, type(loader.sampler))


def test_split_batches_applies_to_iterable_datasets() -> None:
    sharded = shard_dataloader(
        DataLoader(Stream(), batch_size=4), stage=TRAIN, num_replicas=2, rank=0, seed=0, split_batches=True
    )
    assert [len(batch) for batch in sharded] == [2, 2]


def test_without_sharding_or_splitting_the_loader_is_untouched() -> None:
    loader = DataLoader(DATASET, batch_size=4)
    assert shard_dataloader(loader, stage=TRAIN, num_replicas=2, rank=0, seed=0, shard=False) is loader


@pytest.mark.parametrize(
    ("loader", "words"),
    [
        (DataLoader(Stream(), batch_size=2), "iterates an IterableDataset"),
        (
            DataLoader(DATASET, sampler=DistributedSampler(DATASET, num_replicas=2, rank=0)),
            "already has a DistributedSampler",
        ),
        (DataLoader(TensorDataset(torch.arange(1)), batch_size=2), "an evaluation set of 1 sample(s) leaves some"),
    ],
    ids=["iterable", "user-distributed-sampler", "fewer-samples-than-ranks"],
)
def test_exact_eval_refuses_what_it_cannot_make_exact(loader: DataLoader, words: str) -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        shard_dataloader(loader, stage=VAL, num_replicas=2, rank=0, seed=0, exact_eval=True)
    assert str(raised.value).startswith("exact_eval=True: ")
    assert words in str(raised.value)
