"""One start of an elastic run: trains, saves mid-epoch, or continues a checkpoint on however many ranks it has.

Every rank appends one JSON line per training batch to OUT/trained/<TAG>-rank<RANK>.jsonl, written in
``training_step`` (before the step's checkpoint can exist): the epoch, Lightning's batch_idx, the global step before
the batch, and the sample indices. At the start of training each rank writes OUT/start-<TAG>-rank<RANK>.json (what
Lightning restored); at the end OUT/end-<TAG>-rank<RANK>.json, and rank 0 saves the weights to
OUT/weights-<TAG>.pt. Checkpoints go to OUT/checkpoints every --every steps.
"""

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import LR, build_net, dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import BatchSampler, DataLoader, Sampler

from lightning_ddp_amp import AmpPrecision, EnvDDPStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--tag", default="a", help="names this start's records")
parser.add_argument("--samples", type=int, default=43, help="training samples")
parser.add_argument("--batch", type=int, default=4, help="DataLoader(batch_size=...): per rank, or global with --split")
parser.add_argument("--split", action="store_true", help="EnvDDPStrategy(split_batches=True)")
parser.add_argument("--order", choices=["shuffle", "sequential", "custom"], default="shuffle")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--max-steps", type=int, default=-1)
parser.add_argument("--every", type=int, default=0, help="checkpoint every N steps")
parser.add_argument("--ckpt", default=None, help="trainer.fit(ckpt_path=...)")
parser.add_argument("--auto-resume", action="store_true")
parser.add_argument("--kill-at-step", type=int, default=-1, help="the last rank SIGKILLs itself after this step")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--val-every", type=int, default=0, help="val_check_interval in batches (0: no validation)")
parser.add_argument("--onecycle", type=int, default=0, help="OneCycleLR(total_steps=...) (0: a StepLR)")
parser.add_argument("--precision", default="32-true", help="a Trainer precision value, or 'native-fp16'")
args = parser.parse_args()
out = Path(args.out)
RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
(out / "trained").mkdir(parents=True, exist_ok=True)


class EveryThirdFirst(Sampler[int]):
    """A sampler of the script's own: a fixed order that is not the dataset's (envddp shards it with a wrapper)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self) -> Any:
        return iter(sorted(range(self.length), key=lambda i: (i % 3, -i)))

    def __len__(self) -> int:
        return self.length


class PairedBatchSampler(BatchSampler):
    """A batch sampler of the script's own (a BatchSampler subclass with the usual arguments)."""


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build_net()

    def on_train_start(self) -> None:
        start = {
            "global_step": self.global_step,
            "epoch": self.current_epoch,
            "num_training_batches": self.trainer.num_training_batches,
            "loss_scale": _loss_scale(self.trainer),
        }
        (out / f"start-{args.tag}-rank{RANK}.json").write_text(json.dumps(start))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        line = {
            "epoch": self.current_epoch,
            "batch_idx": batch_idx,
            "step": self.global_step,
            "indices": index.tolist(),
        }
        with open(out / "trained" / f"{args.tag}-rank{RANK}.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            with open(out / f"validated-{args.tag}-rank{RANK}", "a") as file:
                file.write(f"{self.current_epoch} {self.trainer.fit_loop.epoch_loop.batch_idx}\n")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if RANK == WORLD_SIZE - 1 and self.global_step == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        if args.onecycle:
            scheduler: Any = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=args.onecycle)
        else:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _loss_scale(trainer: L.Trainer) -> float | None:
    plugin = trainer.precision_plugin
    return plugin.current_loss_scale() if isinstance(plugin, AmpPrecision) else None


data = dataset(args.samples, seed=1)
if args.order == "custom":
    sampler = EveryThirdFirst(args.samples)
    train = DataLoader(data, batch_sampler=PairedBatchSampler(sampler, batch_size=args.batch, drop_last=False))
else:
    train = DataLoader(data, batch_size=args.batch, shuffle=args.order == "shuffle")
val = DataLoader(dataset(8, seed=2), batch_size=4) if args.val_every else None
callbacks: list[Any] = []
if args.every:
    callbacks.append(ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=args.every, save_top_k=-1))
precision: Any = args.precision
plugins: list[Any] = []
if args.precision == "native-fp16":
    precision, plugins = None, [AmpPrecision(backend="native", max_loss_scale=2.0**10)]
trainer = L.Trainer(
    strategy=EnvDDPStrategy(split_batches=args.split, auto_resume=args.auto_resume, timeout=120),
    accelerator="cpu",
    devices="auto",
    precision=precision,
    plugins=plugins,
    max_epochs=args.epochs,
    max_steps=args.max_steps,
    logger=False,
    callbacks=callbacks,
    enable_checkpointing=bool(args.every),
    enable_progress_bar=False,
    enable_model_summary=False,
    accumulate_grad_batches=args.accumulate,
    val_check_interval=args.val_every or None,
    limit_val_batches=1 if args.val_every else 0,
    num_sanity_val_steps=0,
)
model = Module()
trainer.fit(model, train, val, ckpt_path=args.ckpt)
end = {
    "global_step": trainer.global_step,
    "epoch": trainer.current_epoch,
    "resumed_from": str(trainer.ckpt_path) if trainer.ckpt_path else None,
    "loss_scale": _loss_scale(trainer),
}
(out / f"end-{args.tag}-rank{RANK}.json").write_text(json.dumps(end))
if trainer.is_global_zero:
    torch.save(model.net.state_dict(), out / f"weights-{args.tag}.pt")
