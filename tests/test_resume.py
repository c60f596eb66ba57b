"""auto_resume in one process: where it looks, what it refuses, and how a preemption request is noticed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp import CheckpointError, EnvDDPStrategy, StrategyConfigurationError
from lightning_ddp_amp._namespaces import namespaced_modules
from lightning_ddp_amp.data import shard_dataloader
from lightning_ddp_amp.preemption import PREEMPTION
from lightning_ddp_amp.resume import checkpoint_dirs, newest_checkpoint

DATA = TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), torch.randn(16, 1))


class Small(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.started_at_step = -1

    def on_train_start(self) -> None:
        self.started_at_step = self.global_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(directory: Path | None, max_epochs: int = 1, **kwargs: Any) -> tuple[L.Trainer, Small]:
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
    model = Small()
    trainer.fit(model, DataLoader(DATA, batch_size=4))
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


def test_a_mid_epoch_checkpoint_from_another_world_size_is_refused() -> None:
    loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True)
    sharded = shard_dataloader(
        loader, stage=RunningStage.TRAINING, num_replicas=2, rank=0, seed=0, progress=lambda: (3, 4)
    )
    state = sharded.state_dict()
    assert state == {"epoch": 0, "batches": 3, "epoch_batches": 4, "num_replicas": 2, "seed": 0, "batch_size": 2}
    other = shard_dataloader(
        loader, stage=RunningStage.TRAINING, num_replicas=4, rank=0, seed=0, progress=lambda: (0, 2)
    )
    with pytest.raises(
        CheckpointError, match=r"^checkpoint=\{'num_replicas': 2, 'seed': 0, 'batch_size': 2\}: it was saved"
    ):
        other.load_state_dict(state)


def test_an_end_of_epoch_checkpoint_resumes_with_any_world_size() -> None:
    loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True)
    other = shard_dataloader(
        loader, stage=RunningStage.TRAINING, num_replicas=4, rank=0, seed=0, progress=lambda: (0, 2)
    )
    other.load_state_dict({"epoch": 0, "batches": 4, "epoch_batches": 4, "num_replicas": 2, "seed": 0, "batch_size": 2})
    assert other.sampler.epoch == 1


def test_a_resumed_loader_skips_exactly_the_trained_batches() -> None:
    loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True)

    def rank0() -> DataLoader:
        return shard_dataloader(
            loader, stage=RunningStage.TRAINING, num_replicas=2, rank=0, seed=0, progress=lambda: (3, 4)
        )

    full = rank0()
    full.sampler.set_epoch(1)
    epoch1 = [batch[0].tolist() for batch in full]
    resumed = rank0()
    resumed.load_state_dict(
        {"epoch": 1, "batches": 3, "epoch_batches": 4, "num_replicas": 2, "seed": 0, "batch_size": 2}
    )
    assert [batch[0].tolist() for batch in resumed] == epoch1[3:]
    assert len(resumed) == len(full)  # Lightning counts the epoch's batches from the full length


def test_a_shorter_cycling_loader_resumes_where_its_cycle_stands() -> None:
    # Lightning's default "max_size_cycle": a loader of 4 batches in an epoch of 10 is 6 % 4 = 2 batches in.
    loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True)
    sharded = shard_dataloader(
        loader, stage=RunningStage.TRAINING, num_replicas=2, rank=0, seed=0, progress=lambda: (0, 10)
    )
    sharded.sampler.set_epoch(1)
    cycle = [batch[0].tolist() for batch in sharded]
    sharded.load_state_dict(
        {"epoch": 1, "batches": 6, "epoch_batches": 10, "num_replicas": 2, "seed": 0, "batch_size": 2}
    )
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


def test_outside_the_training_loop_sigterm_ends_the_process(tmp_path: Path) -> None:
    script = tmp_path / "sigterm.py"
    script.write_text(
        "import os, signal, time\n"
        "from lightning_ddp_amp.preemption import PREEMPTION\n"
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
    assert "preemption" not in namespaced_modules()
    assert {"resume", "strategy"} <= namespaced_modules()
