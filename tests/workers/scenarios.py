"""Lightning features under EnvDDPStrategy on real ranks, one Trainer after another in the same processes.

Each rank writes OUT/rank<RANK>.json: per scenario, what it measured.
"""

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import build_net, dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ddp_amp import EnvDDPStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
out = Path(args.out)
results: dict[str, Any] = {}

TRAIN = dataset(40, seed=3)
EVAL = dataset(37, seed=4)


class Module(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(build_net(), torch.nn.BatchNorm1d(1))
        self.automatic_optimization = not manual
        self.batch_sizes: set[int] = set()
        self.samples: dict[int, list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.batch_sizes.add(len(index))
        self.samples.setdefault(self.current_epoch, []).extend(index.tolist())
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def on_train_end(self) -> None:
        wrapper = self.trainer.model
        logging_data = wrapper._get_ddp_logging_data() if hasattr(wrapper, "_get_ddp_logging_data") else {}
        self.wrapper = {"type": type(wrapper).__name__, "comm_hook": logging_data.get("comm_hook")}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_mean_y", batch[1].mean(), sync_dist=True, batch_size=len(batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_mean_y", batch[1].mean(), sync_dist=True, batch_size=len(batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer(**kwargs: Any) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    options.update(kwargs)
    return L.Trainer(**options)


def spread_across_ranks(module: torch.nn.Module) -> float:
    """Largest difference between any two ranks' weights (0.0 when DDP kept them in sync)."""
    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def loader(data: Any, **kwargs: Any) -> DataLoader:
    return DataLoader(data, batch_size=4, **kwargs)


# One strategy instance through fit (with sanity check and validation), test, and a second fit. It starts the process
# group every later Trainer here trains on; its timeout turns a collective one rank never joins into an error in a
# minute, not torch's default 30.
strategy = EnvDDPStrategy(exact_eval=True, timeout=60)
t = trainer(strategy=strategy, max_epochs=1, num_sanity_val_steps=2)
model = Module()
t.fit(model, loader(TRAIN, shuffle=True), loader(EVAL))
validated = t.callback_metrics["val_mean_y"].item()
tested = t.test(model, loader(EVAL), verbose=False)[0]["test_mean_y"]
t.fit_loop.max_epochs = 2
t.fit(model, loader(TRAIN, shuffle=True))
results["reuse"] = {
    "val_mean_y": validated,
    "test_mean_y": tested,
    "epochs": sorted(model.samples),
    "spread": spread_across_ranks(model),
}

# Manual optimization.
model = Module(manual=True)
trainer(strategy="envddp", max_epochs=1).fit(model, loader(TRAIN, shuffle=True))
results["manual"] = {"spread": spread_across_ranks(model), "samples": len(model.samples[0])}

# fp16 gradient compression on gloo.
model = Module()
t = trainer(strategy=EnvDDPStrategy(ddp_comm_hook="fp16"), max_epochs=1)
t.fit(model, loader(TRAIN))
results["fp16_hook"] = {"spread": spread_across_ranks(model), **model.wrapper}

# The user shards the data himself; split_batches still divides the global batch.
model = Module()
trainer(strategy=EnvDDPStrategy(split_batches=True), max_epochs=1, use_distributed_sampler=False).fit(
    model, DataLoader(TRAIN, batch_size=8)
)
results["no_sampler"] = {"batch_sizes": sorted(model.batch_sizes), "samples": len(model.samples[0])}

# Checkpoint, then resume in a new Trainer.
ckpt_dir = out / "checkpoints"
t = trainer(strategy="envddp", max_epochs=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=ckpt_dir)])
t.fit(Module(), loader(TRAIN, shuffle=True))
checkpoint = t.strategy.broadcast(t.checkpoint_callback.best_model_path)
model = Module()
trainer(strategy="envddp", max_epochs=2).fit(model, loader(TRAIN, shuffle=True), ckpt_path=checkpoint)
results["resume"] = {"epochs": sorted(model.samples), "spread": spread_across_ranks(model)}


# A later Trainer with auto_resume, on the group an earlier Trainer started: SIGTERM to rank 1 still makes every rank
# save and stop together.
class SignalledModule(Module):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 1 and dist.get_rank() == 1 and not self.signalled:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)

    signalled = False


preempt_dir = out / "preempted"
t = trainer(
    strategy=EnvDDPStrategy(auto_resume=True, timeout=30),
    max_epochs=3,
    enable_checkpointing=True,
    callbacks=[ModelCheckpoint(dirpath=preempt_dir, every_n_train_steps=100)],
)
try:
    t.fit(SignalledModule(), loader(TRAIN, shuffle=True))
    stopped_with = None
except SystemExit as stop:  # Lightning's SIGTERMException
    stopped_with = stop.code
dist.barrier()
results["later_trainer_preempted"] = {"exit": stopped_with, "saved": sorted(p.name for p in preempt_dir.glob("*.ckpt"))}

(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
