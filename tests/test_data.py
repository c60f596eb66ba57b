"""shard_dataloader: the sampler each rank gets, checked in one process by building every rank's loader."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import Torchrun, check
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Sampler,
    SequentialSampler,
    TensorDataset,
)

from lightning_ddp_amp import StrategyConfigurationError
from lightning_ddp_amp.trainer.sharding import Sharding, shard_dataloader, warn_unshuffled_training_shards

DATASET = TensorDataset(torch.arange(10))
TRAIN = RunningStage.TRAINING
VAL = RunningStage.VALIDATING


def shards(
    loader: DataLoader, world: int = 2, stage: RunningStage = TRAIN, epoch: int = 0, **kwargs: bool
) -> list[list[int]]:
    """The sample indices each rank reads, in order."""
    result = []
    for rank in range(world):
        sharded = shard_dataloader(loader, stage, Sharding(num_replicas=world, rank=rank, seed=0, **kwargs))
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
    sharded = shard_dataloader(loader, TRAIN, Sharding(num_replicas=2, rank=0, seed=0))
    assert isinstance(sharded.batch_sampler, Pairs)
    assert shards(loader) == [[0, 4, 8, 3, 7], [2, 6, 1, 5, 9]]


def test_a_loader_already_sharded_by_the_user_is_left_alone() -> None:
    loader = DataLoader(DATASET, sampler=DistributedSampler(DATASET, num_replicas=2, rank=0))
    assert shard_dataloader(loader, TRAIN, Sharding(num_replicas=2, rank=1, seed=0)) is loader


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


def test_iterable_datasets_are_left_alone() -> None:
    loader = DataLoader(Stream(), batch_size=2)
    assert shard_dataloader(loader, TRAIN, Sharding(num_replicas=2, rank=1, seed=0)) is loader


def test_prediction_is_left_to_lightning() -> None:
    loader = DataLoader(DATASET, batch_size=2)
    assert shard_dataloader(loader, RunningStage.PREDICTING, Sharding(num_replicas=2, rank=1, seed=0)) is loader


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
        DataLoader(DATASET, batch_size=4), TRAIN, Sharding(num_replicas=2, rank=0, seed=0, split_batches=True)
    )
    assert sharded.batch_size == 2


def test_split_batches_with_a_positional_batch_size() -> None:
    sharded = shard_dataloader(
        DataLoader(DATASET, 4), TRAIN, Sharding(num_replicas=2, rank=0, seed=0, split_batches=True)
    )
    assert sharded.batch_size == 2


def test_split_batches_with_an_indivisible_batch_is_an_error() -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        shard_dataloader(
            DataLoader(DATASET, batch_size=5), TRAIN, Sharding(num_replicas=2, rank=0, seed=0, split_batches=True)
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
        shard_dataloader(loader, TRAIN, Sharding(num_replicas=2, rank=0, seed=0, split_batches=True))


def test_split_batches_applies_when_the_user_shards_the_data_himself() -> None:
    loader = DataLoader(DATASET, batch_size=4)
    sharded = shard_dataloader(loader, TRAIN, Sharding(num_replicas=2, rank=0, seed=0, shard=False, split_batches=True))
    assert sharded.batch_size == 2
    assert isinstance(sharded.sampler, type(loader.sampler))


def test_split_batches_applies_to_iterable_datasets() -> None:
    sharded = shard_dataloader(
        DataLoader(Stream(), batch_size=4), TRAIN, Sharding(num_replicas=2, rank=0, seed=0, split_batches=True)
    )
    assert [len(batch) for batch in sharded] == [2, 2]


def global_batches(loader: DataLoader, world: int, epoch: int) -> list[list[int]]:
    """The samples of each step over all ``world`` ranks under ``split_batches``, in the order of the epoch's
    permutation (rank r reads its j-th sample from position j * world + r)."""
    per_rank = []
    for rank in range(world):
        sharded = shard_dataloader(loader, TRAIN, Sharding(num_replicas=world, rank=rank, seed=0, split_batches=True))
        assert isinstance(sharded, DataLoader)
        sharded.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        per_rank.append([batch.tolist() for (batch,) in sharded])
    return [[i for row in zip(*step, strict=True) for i in row] for step in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("epoch", [0, 1])
def test_split_batches_in_one_process_draws_the_global_batches_of_every_world_size(epoch: int) -> None:
    # The sampler the ranks get, with one replica: a job moved between 1 and W processes (or resumed on another
    # number) trains the same global batches in every epoch, not the DataLoader's own RandomSampler's.
    loader = DataLoader(TensorDataset(torch.arange(12)), batch_size=6, shuffle=True)
    alone = global_batches(loader, 1, epoch)
    assert alone == global_batches(loader, 2, epoch) == global_batches(loader, 3, epoch)
    recipe = DistributedSampler(range(12), num_replicas=1, rank=0, shuffle=True, seed=0)
    recipe.set_epoch(epoch)
    assert [i for batch in alone for i in batch] == list(recipe)


def test_split_batches_in_one_process_keeps_a_batch_sampler_of_the_script() -> None:
    # Several ranks refuse it (no global batch to split); one process has nothing to split.
    loader = DataLoader(DATASET, batch_sampler=Pairs(EvenFirst(), batch_size=2, drop_last=False))
    alone = shard_dataloader(loader, TRAIN, Sharding(num_replicas=1, rank=0, seed=0, split_batches=True))
    assert [batch.tolist() for (batch,) in alone] == [[0, 2], [4, 6], [8, 1], [3, 5], [7, 9]]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("stage", [TRAIN, VAL])
def test_without_split_batches_one_process_keeps_the_scripts_loader(shuffle: bool, stage: RunningStage) -> None:
    # The plain script: its DataLoader, its sampler (and, shuffled, its draws from the global generator).
    loader = DataLoader(DATASET, batch_size=4, shuffle=shuffle)
    sampler = loader.sampler
    assert shard_dataloader(loader, stage, Sharding(num_replicas=1, rank=0, seed=0)) is loader
    assert loader.sampler is sampler


def test_split_batches_in_one_process_leaves_evaluation_loaders_alone() -> None:
    loader = DataLoader(DATASET, batch_size=4, shuffle=True)
    assert shard_dataloader(loader, VAL, Sharding(num_replicas=1, rank=0, seed=0, split_batches=True)) is loader


def test_without_sharding_or_splitting_the_loader_is_untouched() -> None:
    loader = DataLoader(DATASET, batch_size=4)
    assert shard_dataloader(loader, TRAIN, Sharding(num_replicas=2, rank=0, seed=0, shard=False)) is loader


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
        shard_dataloader(loader, VAL, Sharding(num_replicas=2, rank=0, seed=0, exact_eval=True))
    assert str(raised.value).startswith("exact_eval=True: ")
    assert words in str(raised.value)


def sharded(loader: DataLoader, stage: RunningStage = TRAIN, **kwargs: bool) -> object:
    """Rank 0's copy of ``loader`` on 2 ranks, as the strategy hands it to the loop."""
    return shard_dataloader(loader, stage, Sharding(num_replicas=2, rank=0, seed=0, **kwargs))


def order_warnings(train_dataloader: object) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_unshuffled_training_shards(train_dataloader)
    return [str(w.message) for w in caught]


def test_an_unshuffled_training_loader_is_told_that_its_shards_keep_their_order() -> None:
    # The recipe's DistributedSampler(ds) shuffled; dropping it but keeping shuffle=False no longer does.
    (message,) = order_warnings(sharded(DataLoader(DATASET, batch_size=2, shuffle=False)))
    assert message.startswith("envddp: the training DataLoader (over TensorDataset) does not shuffle, so each rank's")
    assert "keeps the dataset's order in every epoch" in message
    assert "Fix: DataLoader(..., shuffle=True)" in message
    assert "sampler=DistributedSampler(dataset, shuffle=False)" in message
    assert "Trainer(use_distributed_sampler=False)" in message


def test_an_unshuffled_custom_batch_sampler_is_told_too() -> None:
    loader = DataLoader(DATASET, batch_sampler=Pairs(SequentialSampler(DATASET), batch_size=2, drop_last=False))
    assert len(order_warnings(sharded(loader))) == 1


def test_each_unshuffled_loader_of_several_is_named_once() -> None:
    unshuffled, shuffled = DataLoader(DATASET), DataLoader(DATASET, shuffle=True)
    loaders = {"images": sharded(unshuffled), "text": [sharded(shuffled), sharded(unshuffled)]}
    named = [message.split(" (over")[0] for message in order_warnings(loaders)]
    assert named == ["envddp: the training DataLoader ['images']", "envddp: the training DataLoader ['text'][1]"]


@pytest.mark.parametrize(
    "loader",
    [
        DataLoader(DATASET, shuffle=True),
        DataLoader(DATASET, sampler=EvenFirst()),
        DataLoader(DATASET, sampler=DistributedSampler(DATASET, num_replicas=2, rank=0, shuffle=False)),
        DataLoader(Stream(), batch_size=2),
    ],
    ids=["shuffled", "custom-sampler", "user-distributed-sampler", "iterable"],
)
def test_loaders_that_shuffle_or_choose_their_order_are_not_warned_about(loader: DataLoader) -> None:
    assert order_warnings(sharded(loader)) == []


def test_a_loader_the_strategy_does_not_shard_is_not_warned_about() -> None:
    # One process, or Trainer(use_distributed_sampler=False): the strategy leaves the loader as it is.
    assert order_warnings(sharded(DataLoader(DATASET), shard=False)) == []
    assert order_warnings(DataLoader(DATASET)) == []


def test_only_rank_zero_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert order_warnings(sharded(DataLoader(DATASET))) == []


@pytest.mark.multiprocess
def test_fitting_on_two_ranks_warns_once_about_the_unshuffled_training_loader_only(
    torchrun: Torchrun, tmp_path: Path
) -> None:
    # Two epochs of fit, then validate and predict with unshuffled loaders: one warning, from rank 0, at fit start.
    result = check(torchrun.run("train_envddp.py", "--out", str(tmp_path), "--batch-size", "4", "--no-shuffle"))
    assert result.stdout.count("does not shuffle, so each rank's shard keeps") == 1
    assert "envddp: the training DataLoader (over TensorDataset) does not shuffle" in result.stdout
