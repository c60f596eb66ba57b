"""The same training as train_recipe.py, written as a LightningModule and run with Trainer(strategy="envddp").

Each rank writes OUT/rank<RANK>.json with what it saw (topology, sample indices per epoch, eval indices,
metrics, which files it wrote); rank 0 also saves the final weights to OUT/weights.pt. Every process, a
self-launch's agent included, says as it exits whether its objects were frozen out of the last garbage collection.
"""

import argparse
import atexit
import gc
import importlib
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from common import LR, build_net, train_set, val_set
from torch.utils.data import DataLoader

# One write per line: the ranks and the agent share the output and exit at the same moment.
atexit.register(
    lambda: os.write(1, f"exit of {os.environ.get('RANK', 'agent')}: gc frozen {gc.get_freeze_count() > 0}\n".encode())
)

# `--namespace pytorch_lightning`: the same run with the standalone package and the plugins built for it.
NAMESPACE = sys.argv[sys.argv.index("--namespace") + 1] if "--namespace" in sys.argv else "lightning"
L = importlib.import_module("pytorch_lightning" if NAMESPACE == "pytorch_lightning" else "lightning.pytorch")
ddp_amp = importlib.import_module(
    "lightning_ddp_amp" + (".pytorch_lightning" if NAMESPACE == "pytorch_lightning" else "")
)
EnvDDPStrategy, read_topology = ddp_amp.EnvDDPStrategy, ddp_amp.read_topology
ModelCheckpoint, CSVLogger = L.callbacks.ModelCheckpoint, L.loggers.CSVLogger
TorchCheckpointIO, rank_zero_only = L.plugins.io.TorchCheckpointIO, L.utilities.rank_zero_only

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--batch-size", type=int, required=True, help="the DataLoader's batch_size")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--no-shuffle", action="store_true")
parser.add_argument("--split-batches", action="store_true")
parser.add_argument("--exact-eval", action="store_true")
parser.add_argument("--write", action="store_true", help="checkpoint and log through recording doubles")
parser.add_argument("--accelerator", default="cpu")
parser.add_argument(
    "--devices", type=int, default=None, help="Trainer(devices=...); without a launcher, >1 self-launches"
)
parser.add_argument("--timeout", type=float, default=1800.0, help="EnvDDPStrategy(timeout=...), seconds")
parser.add_argument("--namespace", choices=["lightning", "pytorch_lightning"], default="lightning")
args = parser.parse_args()
out = Path(args.out)
RANK = str(read_topology().rank)  # torchrun, srun or mpirun


def record_write(kind: str) -> None:
    with open(out / f"{kind}_written_by_rank{RANK}", "a") as f:
        f.write("x")


class RecordingCheckpointIO(TorchCheckpointIO):
    """Writes the checkpoint, then notes which process wrote it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        record_write("checkpoint")


class RecordingLogger(CSVLogger):
    """A CSVLogger that also notes which process wrote metrics (guarded by rank_zero_only like every logger)."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        record_write("log")


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build_net()
        self.train_indices: dict[int, list[int]] = defaultdict(list)
        self.eval_indices: list[int] = []
        self.batch_sizes: set[int] = set()
        self.ddp: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.train_indices[self.current_epoch] += index.tolist()
        self.batch_sizes.add(len(index))
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_end(self) -> None:
        wrapper = self.trainer.model
        self.ddp = {
            "device_ids": getattr(wrapper, "device_ids", None),
            "output_device": getattr(wrapper, "output_device", None),
        }

    def on_validation_epoch_start(self) -> None:
        self.eval_indices = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, y, index = batch
        self.eval_indices += index.tolist()
        self.log("val_mean_y", y.mean(), sync_dist=True, batch_size=len(y))

    def predict_step(self, batch: Any, batch_idx: int) -> list[int]:
        return batch[2].tolist()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


strategy = EnvDDPStrategy(split_batches=args.split_batches, exact_eval=args.exact_eval, timeout=args.timeout)
trainer = L.Trainer(
    strategy=strategy,
    accelerator=args.accelerator,
    devices=args.devices or "auto",
    max_epochs=args.epochs,
    num_sanity_val_steps=0,
    logger=RecordingLogger(out / "logs") if args.write else False,
    log_every_n_steps=1,
    callbacks=[ModelCheckpoint(dirpath=out / "checkpoints")] if args.write else [],
    plugins=[RecordingCheckpointIO()] if args.write else [],
    enable_checkpointing=args.write,
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = Module()
train_loader = DataLoader(train_set(), batch_size=args.batch_size, shuffle=not args.no_shuffle)
trainer.fit(model, train_loader)
metrics = trainer.validate(model, DataLoader(val_set(), batch_size=4), verbose=False)[0]
predictions = trainer.predict(model, DataLoader(val_set(), batch_size=4))

report = {
    "rank": trainer.global_rank,
    "local_rank": trainer.local_rank,
    "node_rank": trainer.node_rank,
    "world_size": trainer.world_size,
    "num_nodes": trainer.num_nodes,
    "num_devices": trainer.num_devices,
    "launcher": trainer.strategy.topology.launcher,
    "strategy_class": f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__name__}",
    "trainer_class": f"{type(trainer).__module__}.{type(trainer).__name__}",
    "device": str(trainer.strategy.root_device),
    "ddp": model.ddp,
    "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
    "train_batch_sizes": sorted(model.batch_sizes),
    "train_indices": model.train_indices,
    "eval_indices": model.eval_indices,
    "val_mean_y": metrics["val_mean_y"],
    "predict_indices": [i for batch in predictions for i in batch],
}
(out / f"rank{RANK}.json").write_text(json.dumps(report))
if trainer.is_global_zero:
    torch.save({k: v.cpu() for k, v in model.net.state_dict().items()}, out / "weights.pt")
