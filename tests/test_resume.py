"""auto_resume in one process: where it looks, what it refuses, and how a preemption request is noticed."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import drop_loader_positions
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import RunningStage
from pytorch_lightning_flavour import copied_modules
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset

from lightning_ddp_amp import CheckpointError, EnvDDPStrategy, StrategyConfigurationError
from lightning_ddp_amp.launch.preemption import PREEMPTION
from lightning_ddp_amp.trainer.position import check_resumed_positions, position_of
from lightning_ddp_amp.trainer.resume import AtomicCheckpointIO, ResumePoint, checkpoint_dirs, newest_checkpoint
from lightning_ddp_amp.trainer.sharding import Sharding, shard_dataloader

DATA = TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), torch.randn(16, 1))


class Small(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.started_at_step = -1
        self.trained_batches = 0

    def on_train_start(self) -> None:
        self.started_at_step = self.global_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained_batches += 1
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    directory: Path | None, max_epochs: int = 1, data: TensorDataset = DATA, model: Small | None = None, **kwargs: Any
) -> tuple[L.Trainer, Small]:
    callbacks = [ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)] if directory else []
    trainer = L.Trainer(
        strategy=EnvDDPStrategy(auto_resume=True),
        accelerator="cpu",
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    model = model or Small()
    trainer.fit(model, DataLoader(data, batch_size=4))
    return trainer, model


def test_a_fit_continues_from_the_newest_checkpoint(tmp_path: Path) -> None:
    fit(tmp_path)
    trainer, model = fit(tmp_path, max_epochs=2)
    assert trainer.strategy.resumed_from == tmp_path / "epoch=0-step=4.ckpt"
    assert model.started_at_step == 4
    assert trainer.global_step == 8
    assert trainer.ckpt_path is None  # a later trainer.test() is not pointed at the resume checkpoint


def test_the_first_start_has_nothing_to_resume(tmp_path: Path) -> None:
    trainer, model = fit(tmp_path)
    assert trainer.strategy.resumed_from is None
    assert model.started_at_step == 0


def test_auto_resume_needs_a_checkpoint_directory() -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        fit(None, enable_checkpointing=False)
    assert str(raised.value).startswith("auto_resume=True: no ModelCheckpoint callback saves full checkpoints")
    assert "ModelCheckpoint(dirpath='checkpoints', every_n_train_steps=N)" in str(raised.value)


def test_a_truncated_newest_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    fit(tmp_path)
    newest = tmp_path / "epoch=0-step=4.ckpt"
    newest.write_bytes(newest.read_bytes()[:300])
    with pytest.raises(CheckpointError) as raised:
        fit(tmp_path, max_epochs=2)
    message = str(raised.value)
    assert message.startswith(f"ckpt_path='{newest}': it cannot be read")
    assert "truncated or not a torch checkpoint" in message


def test_a_foreign_file_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    torch.save({"model": {}}, tmp_path / "weights.ckpt")
    with pytest.raises(CheckpointError) as raised:
        fit(tmp_path)
    assert "it is not a checkpoint written by a Lightning Trainer (no state_dict, loops, global_step)" in str(
        raised.value
    )


def test_newest_checkpoint_goes_by_write_time_and_skips_other_files(tmp_path: Path) -> None:
    older, newer = tmp_path / "b.ckpt", tmp_path / "a.ckpt"
    older.write_bytes(b"")
    newer.write_bytes(b"")
    os.utime(older, ns=(1, 1_000_000_000))
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / ".tmp-half-written").write_bytes(b"")
    assert newest_checkpoint([tmp_path, tmp_path / "missing"]) == newer
    assert newest_checkpoint([tmp_path / "missing"]) is None


# --- writing a checkpoint: its mode, and what reaches the disk before and after the rename --------------------------

CHECKPOINT = {"state_dict": {"w": torch.arange(4.0)}, "loops": {}, "global_step": 3}


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=oct)
def test_a_checkpoint_gets_the_mode_lightnings_writer_gives_it_0666_less_the_umask(tmp_path: Path, umask: int) -> None:
    # 0644 under 022: an evaluation job or a teammate can read it (a temporary file of tempfile's is 0600); 077 keeps
    # it private, as the user's umask asks.
    before = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint(CHECKPOINT, tmp_path / "step=3.ckpt")
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "step=3.ckpt").stat().st_mode) == 0o666 & ~umask


def save_recording_disk_writes(monkeypatch: pytest.MonkeyPatch, target: Path) -> list[tuple[Any, ...]]:
    """Save a checkpoint to ``target``, recording in order each rename and each fsync: of which inode, and how many
    bytes it held then (None for a directory)."""
    events: list[tuple[Any, ...]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        info = os.fstat(fd)
        events.append(("fsync", info.st_ino, info.st_size if stat.S_ISREG(info.st_mode) else None))
        fsync(fd)

    def recording_replace(source: Any, destination: Any) -> None:
        events.append(("replace", str(destination)))
        replace(source, destination)

    with monkeypatch.context() as patched:
        patched.setattr(os, "fsync", recording_fsync)
        patched.setattr(os, "replace", recording_replace)
        AtomicCheckpointIO().save_checkpoint(CHECKPOINT, target)
    return events


def test_the_whole_checkpoint_reaches_the_disk_before_it_is_renamed_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Otherwise a power loss after the rename can leave an empty or partial file under the checkpoint's name.
    target = tmp_path / "step=3.ckpt"
    events = save_recording_disk_writes(monkeypatch, target)
    written = target.stat()  # the rename keeps the inode
    assert events.index(("fsync", written.st_ino, written.st_size)) < events.index(("replace", str(target)))
    assert sorted(os.listdir(tmp_path)) == ["step=3.ckpt"]


def test_the_rename_is_made_durable_by_flushing_the_directory_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # POSIX keeps a rename in the directory's entries: until the directory reaches the disk, a power loss can bring
    # back the previous checkpoint, or none.
    target = tmp_path / "step=3.ckpt"
    events = save_recording_disk_writes(monkeypatch, target)
    assert events.index(("fsync", tmp_path.stat().st_ino, None)) > events.index(("replace", str(target)))


def test_where_a_directory_cannot_be_opened_the_checkpoint_is_written_without_flushing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on Windows, which opens no directory: the rename is then as durable as the platform makes it.
    open_file = os.open

    def files_only(path: Any, flags: int, *args: Any) -> int:
        if Path(path).is_dir():
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return open_file(path, flags, *args)

    monkeypatch.setattr(os, "open", files_only)
    AtomicCheckpointIO().save_checkpoint(CHECKPOINT, tmp_path / "step=3.ckpt")
    assert torch.load(tmp_path / "step=3.ckpt")["global_step"] == 3
    assert sorted(os.listdir(tmp_path)) == ["step=3.ckpt"]


def test_a_save_that_fails_halfway_leaves_the_previous_checkpoint_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk, or a kill, in the middle of torch.save: the name still holds the last complete checkpoint.
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(CHECKPOINT, target)

    def half_written(checkpoint: Any, file: Any) -> None:
        file.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(OSError, match="No space left on device"):
        AtomicCheckpointIO().save_checkpoint({**CHECKPOINT, "global_step": 4}, target)
    assert torch.load(target)["global_step"] == 3
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


# --- the position of the training DataLoader, and the layout it counts in ------------------------------------

MID_EPOCH = ResumePoint("/runs/epoch=0-step=3.ckpt", mid_epoch=True, loader_states=1)
FRESH_LAYOUT = {"dataset_length": 16, "global_batch": 4, "split_batches": False, "seed": 0, "shuffle": True}


def training_loader(
    world: int,
    progress: tuple[int, int, int] = (0, 3, 4),
    *,
    length: int = 16,
    batch_size: int = 2,
    shuffle: bool = True,
    seed: int = 0,
    rank: int = 0,
    **kwargs: Any,
) -> DataLoader:
    """Rank ``rank``'s training DataLoader over ``length`` samples on ``world`` ranks, as the strategy hands it to
    Lightning."""
    loader = DataLoader(TensorDataset(torch.arange(length)), batch_size=batch_size, shuffle=shuffle)
    kwargs.setdefault("resuming", MID_EPOCH)
    sharded = shard_dataloader(
        loader,
        RunningStage.TRAINING,
        Sharding(num_replicas=world, rank=rank, seed=seed, progress=lambda: progress, **kwargs),
    )
    assert isinstance(sharded, DataLoader)
    return sharded


def test_a_checkpoint_records_the_position_its_samples_their_order_and_the_data_layout() -> None:
    loader = training_loader(2)
    next(iter(loader))  # the pass under way names its order
    assert loader.state_dict() == {
        "epoch": 0,
        "batches": 3,
        "epoch_batches": 4,
        "samples": 12,  # 3 steps of 2 ranks of 2 samples
        "order": {"kind": "permutation", "seed": 0},
        "layout": {"world_size": 2, **FRESH_LAYOUT},
    }


def test_one_process_keeps_its_dataloader_and_records_its_layout_with_world_size_one() -> None:
    loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True)
    same = shard_dataloader(
        loader, RunningStage.TRAINING, Sharding(num_replicas=1, rank=0, seed=0, progress=lambda: (0, 3, 4))
    )
    assert same is loader
    assert isinstance(loader.sampler, RandomSampler)
    assert loader.state_dict()["layout"] == {"world_size": 1, **FRESH_LAYOUT}


def test_one_process_leaves_a_dataloader_that_saves_its_own_position_alone() -> None:
    class OwnPosition(DataLoader):
        def state_dict(self) -> dict[str, Any]:
            return {"own": True}

        def load_state_dict(self, state: dict[str, Any]) -> None: ...

    loader = OwnPosition(TensorDataset(torch.arange(16)), batch_size=4)
    shard_dataloader(
        loader, RunningStage.TRAINING, Sharding(num_replicas=1, rank=0, seed=0, progress=lambda: (0, 3, 4))
    )
    assert loader.state_dict() == {"own": True}


@pytest.mark.parametrize(
    ("saved", "resumed", "told"),
    [
        (training_loader(2), training_loader(2, length=40), "dataset length 16 then, 40 now"),
        (training_loader(1), training_loader(3, length=40), "dataset length 16 then, 40 now"),
        (training_loader(2), training_loader(2, seed=1), "seed 0 then, 1 now"),
        (training_loader(2), training_loader(1, shuffle=False), "shuffle True then, False now"),
        (
            training_loader(2, batch_size=4, split_batches=True),
            training_loader(3, batch_size=6, split_batches=True),
            "global batch 4 then, 6 now",
        ),
    ],
    ids=["other-dataset", "other-dataset-one-process", "seed", "shuffle", "split-other-global-batch"],
)
def test_a_mid_epoch_position_in_another_layout_is_refused_naming_each_saved_value(
    saved: DataLoader, resumed: DataLoader, told: str
) -> None:
    next(iter(saved))
    with pytest.raises(CheckpointError) as raised:
        resumed.load_state_dict(saved.state_dict())
    message = str(raised.value)
    assert message.startswith(
        "ckpt_path='/runs/epoch=0-step=3.ckpt': it was saved after 3 of the 4 batches of epoch 0 had trained, by a"
        f" run that laid the training data out otherwise ({told}), so this run cannot tell which samples that epoch"
        " has already trained. Fix: relaunch with that run's layout ("
    )
    assert "or pass trainer.fit(ckpt_path=...) a checkpoint saved at the end of an epoch" in message


def samples_of(loader: DataLoader) -> list[int]:
    return [i for (batch,) in loader for i in batch.tolist()]


def distributed_order(length: int, epoch: int, shuffle: bool = True) -> list[int]:
    """An epoch's order as torch's own DistributedSampler draws it (one replica: no padding, no sharding)."""
    sampler = DistributedSampler(range(length), num_replicas=1, rank=0, shuffle=shuffle, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_a_position_saved_on_two_ranks_continues_on_any_number_with_each_remaining_sample_once(world: int) -> None:
    saved = training_loader(2, (1, 3, 4))  # 3 steps of epoch 1 on 2 ranks of 2: the order's first 12 samples
    next(iter(saved))
    state = saved.state_dict()
    shards = []
    for rank in range(world):
        resumed = training_loader(world, (1, 3, 4), rank=rank)
        resumed.load_state_dict(state)
        shards.append(samples_of(resumed))
    order = distributed_order(16, epoch=1)
    # The rest, padded to a multiple of the world size with the epoch's first samples; rank r takes every world-th.
    rest = order[12:] + order[: -4 % world]
    assert shards == [rest[rank::world] for rank in range(world)]
    assert len({len(shard) for shard in shards}) == 1  # every rank the same number of samples, none empty


def test_one_process_keeps_the_random_samplers_order_and_its_draw_from_the_global_generator() -> None:
    plain = DataLoader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True)
    kept = training_loader(1)
    torch.manual_seed(3)
    expected = [samples_of(plain) for _ in range(2)], torch.rand(1)
    torch.manual_seed(3)
    assert ([samples_of(kept) for _ in range(2)], torch.rand(1)) == expected
    assert isinstance(kept.sampler, RandomSampler)


def test_a_one_process_position_continues_on_two_ranks_in_the_random_samplers_order() -> None:
    saved = training_loader(1, (0, 3, 8))  # 3 of 8 batches of 2 in one process: 6 samples
    torch.manual_seed(5)
    epoch = samples_of(saved)
    state = saved.state_dict()
    assert state["order"]["kind"] == "generator"
    shards = []
    for rank in range(2):
        resumed = training_loader(2, (0, 3, 8), rank=rank)
        resumed.load_state_dict(state)
        shards.append(samples_of(resumed))
    assert shards == [epoch[6:][rank::2] for rank in range(2)]  # 10 left: no padding on 2 ranks
    alone = training_loader(1, (0, 3, 8))
    alone.load_state_dict(state)
    assert samples_of(alone) == epoch[6:]
    assert len(samples_of(alone)) == 16  # the next pass is whole


def test_one_process_continues_a_sharded_position_in_the_checkpoints_order_for_the_rest_of_the_epoch() -> None:
    saved = training_loader(2, (0, 1, 4))
    next(iter(saved))
    alone = training_loader(1, (0, 1, 4))
    with pytest.warns(UserWarning, match="the rest of the epoch trains 2 samples per step"):
        alone.load_state_dict(saved.state_dict())
    assert samples_of(alone) == distributed_order(16, epoch=0)[4:]


def test_split_batches_that_the_new_world_size_cannot_divide_names_both_sizes_and_the_ranks_that_can() -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        training_loader(3, batch_size=4, split_batches=True)
    assert str(raised.value) == (
        "split_batches=True: DataLoader(batch_size=4) does not divide evenly across WORLD_SIZE=3 ranks, and"
        " /runs/epoch=0-step=3.ckpt continues an epoch whose steps each trained 4 samples. Fix: launch 1, 2, 4"
        " rank(s) to continue it with the same global batches; or use a batch_size that is a multiple of 3, or"
        " EnvDDPStrategy(split_batches=False) (the global batch then changes)"
    )


def test_an_end_of_epoch_position_resumes_in_any_layout() -> None:
    resumed = training_loader(4, length=40)
    for saved in (training_loader(2, (0, 4, 4)), training_loader(1, (0, 4, 4))):
        resumed.load_state_dict(saved.state_dict())
        assert resumed.sampler.epoch == 1


def test_a_mid_epoch_checkpoint_without_a_position_is_refused_for_a_sharded_loader() -> None:
    # A checkpoint of another strategy, or of Trainer(use_distributed_sampler=False): it holds none.
    unpositioned = ResumePoint("/runs/epoch=0-step=3.ckpt", mid_epoch=True, loader_states=0, auto_resumed=True)
    with pytest.raises(CheckpointError) as raised:
        check_resumed_positions({"a": training_loader(2)}, unpositioned, world_size=2)
    assert str(raised.value).startswith(
        "ckpt_path='/runs/epoch=0-step=3.ckpt': auto_resume picked it as the newest checkpoint in /runs, but it was"
        " saved in the middle of an epoch and holds no position of a training DataLoader"
    )
    assert "so this run of 2 ranks cannot tell which samples" in str(raised.value)
    assert (
        "Fix: relaunch as that run was launched to continue exactly; or move epoch=0-step=3.ckpt out of /runs"
        in str(raised.value)
    )


def test_without_a_mid_epoch_checkpoint_or_with_a_restored_position_a_fit_starts() -> None:
    end_of_epoch = ResumePoint("/runs/epoch=0-step=4.ckpt", mid_epoch=False, loader_states=0)
    check_resumed_positions(training_loader(2), end_of_epoch, world_size=2)
    check_resumed_positions(training_loader(2), None, world_size=2)
    restored = training_loader(2)
    restored.load_state_dict(training_loader(2).state_dict())
    check_resumed_positions(restored, MID_EPOCH, world_size=2)


def test_a_mid_epoch_position_lightning_did_not_hand_over_is_refused_naming_the_likely_cause() -> None:
    with pytest.raises(CheckpointError) as raised:
        check_resumed_positions(
            training_loader(2), MID_EPOCH, world_size=2
        )  # MID_EPOCH holds 1 position; none was loaded
    assert str(raised.value).startswith(
        "ckpt_path='/runs/epoch=0-step=3.ckpt': it was saved in the middle of an epoch and holds 1 DataLoader"
        " position(s), but Lightning handed none to this one (it does not when the training DataLoader was set up"
        " before the checkpoint was restored, as reading trainer.estimated_stepping_batches in configure_optimizers"
        " does), so this run of 2 ranks cannot tell which samples that epoch has already trained. Fix: compute the"
        " number of steps in configure_optimizers without trainer.estimated_stepping_batches"
    )


class ReadsEstimatedSteppingBatches(Small):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.trainer.estimated_stepping_batches == 4  # sets the training DataLoader up, before the restore
        return super().configure_optimizers()


@pytest.mark.parametrize(("model", "handed_over"), [(Small, True), (ReadsEstimatedSteppingBatches, False)])
def test_lightning_hands_a_saved_position_only_to_a_dataloader_set_up_after_the_restore(
    tmp_path: Path, model: type[Small], handed_over: bool
) -> None:
    # What the refusal above says of Lightning: if a release hands positions over in both cases, this fails.
    fit(tmp_path, max_steps=2)
    # One process continues a position it was handed, and starts the epoch over (warned) without one.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = fit(tmp_path, model=model())
    new_pass = [w for w in caught if "saved in the middle of an epoch, and in one process" in str(w.message)]
    assert len(new_pass) == (0 if handed_over else 1)
    position = position_of(trainer.train_dataloader)
    assert position is not None
    assert position.restored == handed_over


def test_one_process_resumes_mid_epoch_as_lightning_does_and_says_so() -> None:
    loader = training_loader(1)
    with pytest.warns(UserWarning, match="saved in the middle of an epoch, and in one process the training DataLoader"):
        loader.load_state_dict(training_loader(1).state_dict())
    with pytest.warns(UserWarning, match="the rest of this epoch comes from a new pass over it"):
        check_resumed_positions(training_loader(1), MID_EPOCH, world_size=1)


def test_auto_resume_names_the_mid_epoch_checkpoint_it_picked_and_why_it_cannot_be_continued(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=2)  # the newest checkpoint, epoch=0-step=2.ckpt, is 2 of 4 batches into epoch 0
    more_data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    model = Small()
    with pytest.raises(CheckpointError) as raised:
        fit(tmp_path, data=more_data, model=model)
    assert str(raised.value) == (
        f"ckpt_path='{tmp_path / 'epoch=0-step=2.ckpt'}': auto_resume picked it as the newest checkpoint in"
        f" {tmp_path}, but it was saved after 2 of the 4 batches of epoch 0 had trained, by a run that laid the"
        " training data out otherwise (dataset length 16 then, 40 now), so this run cannot tell which samples that"
        " epoch has already trained. Fix: relaunch with that run's layout (dataset length 16) to continue exactly;"
        f" or move epoch=0-step=2.ckpt out of {tmp_path} (the next start resumes from the newest checkpoint left"
        " there), or pass trainer.fit(ckpt_path=...) a checkpoint saved at the end of an epoch"
    )
    assert model.trained_batches == 0


def test_one_process_continues_a_mid_epoch_checkpoint_without_positions_as_lightning_does_and_says_so(
    tmp_path: Path,
) -> None:
    fit(tmp_path, max_steps=2)
    drop_loader_positions(tmp_path / "epoch=0-step=2.ckpt")
    with pytest.warns(UserWarning, match="epoch=0-step=2.ckpt was saved in the middle of an epoch, and in one process"):
        _, model = fit(tmp_path)
    assert model.trained_batches == 2  # Lightning's count: the epoch ends 2 batches into a new pass


def test_positions_for_dataloaders_this_run_does_not_position_stop_it_with_an_explanation(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=2)  # one process: the checkpoint holds its DataLoader's position
    with pytest.raises(RuntimeError) as raised:
        fit(tmp_path, use_distributed_sampler=False)  # the user shards: the strategy positions no DataLoader
    assert str(raised.value).startswith(
        f"ckpt_path='{tmp_path / 'epoch=0-step=2.ckpt'}': auto_resume picked it as the newest checkpoint in"
        f" {tmp_path}, but it holds the positions of training DataLoaders saved in the middle of an epoch, but this"
        " run has another number of training DataLoaders that take one"
    )
    assert "Lightning said: The CombinedLoader has 0 stateful loaders, but found 1 states" in str(raised.value)


def test_a_resumed_loader_skips_exactly_the_trained_batches() -> None:
    def rank0() -> DataLoader:
        return training_loader(2, (1, 3, 4))

    full = rank0()
    full.sampler.set_epoch(1)
    epoch1 = [batch[0].tolist() for batch in full]
    resumed = rank0()
    resumed.load_state_dict(rank0().state_dict())
    assert [batch[0].tolist() for batch in resumed] == epoch1[3:]
    assert len(resumed) == len(full)  # Lightning counts the epoch's batches from the full length


class Pairs(BatchSampler):
    """A batch sampler of the user's own: its DataLoader has no batch_size."""


def test_a_resumed_batch_sampler_skips_the_samples_of_the_trained_batches() -> None:
    def rank0() -> DataLoader:
        loader = DataLoader(
            TensorDataset(torch.arange(16)),
            batch_sampler=Pairs(RandomSampler(range(16)), batch_size=2, drop_last=False),
        )
        sharded = shard_dataloader(
            loader, RunningStage.TRAINING, Sharding(num_replicas=2, rank=0, seed=0, progress=lambda: (1, 3, 4))
        )
        assert isinstance(sharded, DataLoader) and sharded.batch_size is None
        return sharded

    full = rank0()
    full.batch_sampler.sampler.set_epoch(1)  # type: ignore[union-attr]
    epoch1 = [batch[0].tolist() for batch in full]
    resumed = rank0()
    resumed.load_state_dict(rank0().state_dict())
    assert [batch[0].tolist() for batch in resumed] == epoch1[3:]


def without_global_batch(loader: DataLoader) -> DataLoader:
    """``loader`` laid out as by a batch sampler without a ``batch_size``: its position records no samples."""
    position = position_of(loader)
    assert position is not None
    position.layout = dataclasses.replace(position.layout, global_batch=None)
    return loader


def test_a_batch_sampler_without_a_batch_size_cannot_be_resumed_mid_epoch() -> None:
    loader = without_global_batch(training_loader(2))
    state = loader.state_dict()
    assert "samples" not in state
    with pytest.raises(CheckpointError) as raised:
        loader.load_state_dict(state)
    assert str(raised.value).startswith(
        "ckpt_path='/runs/epoch=0-step=3.ckpt': it was saved after 3 batches of epoch 0, and this run's training"
        " DataLoader has a batch sampler (BatchSampler) without a batch_size, so the number of samples those batches"
        " took is unknown. Fix: give the batch sampler a fixed batch_size attribute to continue exactly"
    )


def test_a_position_without_its_samples_continues_only_on_its_number_of_ranks() -> None:
    saved = without_global_batch(training_loader(2))
    with pytest.raises(CheckpointError, match=r"\(world size 2 then, 3 now\)"):
        without_global_batch(training_loader(3)).load_state_dict(saved.state_dict())


def test_a_position_envddp_did_not_save_is_refused() -> None:
    # A DataLoader that saves its own position (torchdata's), left alone in one process, resumed on 2 ranks.
    with pytest.raises(CheckpointError) as raised:
        training_loader(2).load_state_dict({"steps_since_snapshot": 3, "sampler_state": {}})
    assert str(raised.value).startswith(
        "ckpt_path='/runs/epoch=0-step=3.ckpt': the training DataLoader position it holds is not one envddp saved (it"
        " has ['sampler_state', 'steps_since_snapshot']: a DataLoader that saves its own position, in one process)"
    )
    assert "Fix: relaunch as that run was launched to continue exactly" in str(raised.value)


def test_every_checkpoint_records_the_world_size_that_saved_it(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=2)
    saved = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=False)
    assert saved["envddp"] == {"world_size": 1}
    assert ResumePoint.read(saved, tmp_path / "epoch=0-step=2.ckpt", auto_resumed=False).world_size == 1


def test_a_dataloader_envddp_does_not_position_resumes_mid_epoch_only_at_the_world_size_that_saved_it() -> None:
    # An IterableDataset, a sampler of the script's own or use_distributed_sampler=False: no position to check.
    saved_by_two = ResumePoint("/runs/epoch=0-step=3.ckpt", mid_epoch=True, loader_states=0, world_size=2)
    unpositioned = DataLoader(TensorDataset(torch.arange(16)), batch_size=4)
    check_resumed_positions(unpositioned, saved_by_two, world_size=2)  # Lightning's behaviour, and its warning
    with pytest.raises(CheckpointError) as raised:
        check_resumed_positions({"images": unpositioned}, saved_by_two, world_size=1)
    assert str(raised.value).startswith(
        "ckpt_path='/runs/epoch=0-step=3.ckpt': it was saved in the middle of an epoch by 2 rank(s), and the training"
        " DataLoader['images'] of this run of 1 got no position envddp can check"
    )
    assert "Fix: relaunch with 2 rank(s) to continue exactly" in str(raised.value)


def test_a_shorter_cycling_loader_resumes_where_its_cycle_stands() -> None:
    # Lightning's default "max_size_cycle": a loader of 4 batches in an epoch of 10 is 6 % 4 = 2 batches in.
    sharded = training_loader(2, (1, 6, 10))
    sharded.sampler.set_epoch(1)
    cycle = [batch[0].tolist() for batch in sharded]
    sharded.load_state_dict(training_loader(2, (1, 6, 10)).state_dict())
    assert [batch[0].tolist() for batch in sharded] == cycle[2:]
    assert [batch[0].tolist() for batch in sharded] == cycle  # the next cycle is whole again


def test_a_given_ckpt_path_is_left_alone(tmp_path: Path) -> None:
    fit(tmp_path, max_epochs=2)
    older = tmp_path / "epoch=0-step=2.ckpt"
    trainer = L.Trainer(
        strategy=EnvDDPStrategy(auto_resume=True),
        accelerator="cpu",
        max_epochs=2,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Small()
    trainer.fit(model, DataLoader(DATA, batch_size=4), ckpt_path=older)
    assert trainer.strategy.resumed_from is None
    assert model.started_at_step == 2


def test_newest_checkpoint_breaks_timestamp_ties_by_step(tmp_path: Path) -> None:
    for name in ("epoch=0-step=8.ckpt", "epoch=1-step=12.ckpt", "last.ckpt"):
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, ns=(1, 5_000_000_000))
    (tmp_path / "dangling.ckpt").symlink_to(tmp_path / "gone.ckpt")
    assert newest_checkpoint([tmp_path]) == tmp_path / "epoch=1-step=12.ckpt"


def test_weights_only_checkpoints_are_not_resume_points(tmp_path: Path) -> None:
    trainer = L.Trainer(callbacks=[ModelCheckpoint(dirpath=tmp_path, save_weights_only=True)], logger=False)
    assert checkpoint_dirs(trainer) == []


def test_sigterm_during_training_only_raises_a_flag() -> None:
    PREEMPTION.start(graceful=True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs in the main thread between bytecodes
        assert PREEMPTION.requested
        assert PREEMPTION.agreed()  # one process: no peers to consult
    finally:
        PREEMPTION.stop()


class SignalledAfter(Small):
    """Sends its own process SIGTERM after the training step ``step``, as a scheduler preempting the job would."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step == self.step:
            # Guarded: without envddp's handler, SIGTERM would end pytest itself.
            assert callable(signal.getsignal(signal.SIGTERM)), "envddp did not take SIGTERM over during training"
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_during_training_saves_a_checkpoint_and_exits_128_plus_the_signal(tmp_path: Path) -> None:
    # The status a shell gives SIGTERM, 143, is what srun, mpirun and torchrun then report for the rank: preempted,
    # not finished (0), so that the job is requeued.
    with pytest.raises(SystemExit) as exited:
        fit(tmp_path, model=SignalledAfter(step=1))
    assert exited.value.code == 128 + signal.SIGTERM
    assert (tmp_path / "preempted-step=1.ckpt").is_file()


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as at Python's start (Lightning's own shutdown after one ignores it)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("python_sigint")
def test_the_first_ctrl_c_during_training_raises_a_flag_and_the_second_a_keyboard_interrupt() -> None:
    before = signal.getsignal(signal.SIGINT)
    PREEMPTION.start(graceful=True)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs in the main thread between bytecodes
        assert PREEMPTION.agreed() == signal.SIGINT  # one process: no peers to consult
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
    finally:
        PREEMPTION.stop()
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.usefixtures("python_sigint")
def test_without_auto_resume_ctrl_c_stays_lightnings() -> None:
    before = signal.getsignal(signal.SIGINT)
    PREEMPTION.start(graceful=False)
    try:
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        PREEMPTION.stop()


@pytest.mark.usefixtures("python_sigint")
def test_an_ignored_ctrl_c_stays_ignored_under_auto_resume() -> None:
    # A job started in the background (`nohup`, `&` in a script) ignores SIGINT: no Ctrl-C is meant to reach it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    PREEMPTION.start(graceful=True)
    try:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert PREEMPTION.agreed() == 0
    finally:
        PREEMPTION.stop()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_outside_the_training_loop_sigterm_ends_the_process(tmp_path: Path) -> None:
    script = tmp_path / "sigterm.py"
    script.write_text(
        "import os, signal, time\n"
        "from lightning_ddp_amp.launch.preemption import PREEMPTION\n"
        "PREEMPTION.start(graceful=True)\n"
        "PREEMPTION.stop()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(5)\n"
        "print('still alive')\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGTERM
    assert "still alive" not in result.stdout


def test_the_preemption_flag_lives_in_a_module_that_does_not_import_lightning() -> None:
    # Such modules are shared by the lightning and pytorch_lightning flavours, so the flag exists once per process.
    assert "launch.preemption" not in copied_modules()
    assert {"trainer.resume", "trainer.strategy"} <= copied_modules()
