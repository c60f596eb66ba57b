"""Training that a test can break: a rank kills itself at a chosen step, only in the first attempt.

Each rank writes OUT/rank<RANK>.json at the end (attempt, resume checkpoint, global step); rank 0 saves the
final weights to OUT/weights.pt. Checkpoints go to OUT/checkpoints every --every steps. With --script-group the
script starts its own process group before the Trainer, as a classic script did, ends it at exit itself, and
records in OUT/group-at-exit<RANK> whether the group was still there for it to end.
"""

import argparse
import atexit
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import LR, build_net, dataset, train_set
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ddp_amp import AmpPrecision, EnvDDPStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--every", type=int, default=0, help="checkpoint every N steps (0: no checkpoints)")
parser.add_argument("--auto-resume", action="store_true")
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--kill-at-step", type=int, default=-1, help="the rank kills itself after this global step")
parser.add_argument("--signal", default="SIGKILL")
parser.add_argument("--hang-at-step", type=int, default=-1, help="rank 0 stops stepping here until signalled")
parser.add_argument("--precision", default="32-true", help="a Trainer precision value, or 'native-fp16'")
parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after each step")
parser.add_argument("--save-last", action="store_true", help="also keep OUT/checkpoints/last.ckpt")
parser.add_argument("--stall-save-at-step", type=int, default=-1, help="the checkpoint save at this step stalls")
parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
parser.add_argument("--validate", action="store_true", help="validate twice per epoch, each batch taking --step-delay")
parser.add_argument("--two-loaders", action="store_true", help="train on two DataLoaders of different lengths")
parser.add_argument("--start-delay", type=float, default=0.0, help="rank 1 waits this long before it starts")
parser.add_argument("--timeout", type=float, default=1800.0)
parser.add_argument(
    "--devices", type=int, default=None, help="Trainer(devices=...); without a launcher, >1 self-launches"
)
parser.add_argument("--max-restarts", type=int, default=0, help="EnvDDPStrategy(max_restarts=...)")
parser.add_argument("--script-group", action="store_true", help="dist.init_process_group before the Trainer")
args = parser.parse_args()
out = Path(args.out)
# The rank as torchrun, srun or mpirun exports it (tests start srun's and mpirun's tasks with their variables).
RANK = int(next((os.environ[v] for v in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK") if v in os.environ), "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
(out / "pids").mkdir(parents=True, exist_ok=True)
(out / "progress").mkdir(exist_ok=True)
(out / "pids" / f"rank{RANK}").write_text(str(os.getpid()))
if RANK == 1:
    time.sleep(args.start_delay)


def end_script_group() -> None:
    """The script's own teardown, as the classic recipe ends: the group it started is its to end."""
    (out / f"group-at-exit{RANK}").write_text(str(dist.is_initialized()))
    if dist.is_initialized():
        dist.destroy_process_group()


if args.script_group:
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))  # the classic script's line, kept
    atexit.register(end_script_group)


class StallingPickle:
    """Pickling it announces itself in OUT/saving, then stalls: the test kills the writer mid-save."""

    def __reduce__(self) -> Any:
        (out / "saving").write_text("")
        time.sleep(600)
        return (StallingPickle, ())


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build_net()
        self.started_at_step: int | None = None

    def on_train_start(self) -> None:
        self.started_at_step = self.global_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        parts = batch.values() if isinstance(batch, dict) else [batch]
        return sum(torch.nn.functional.mse_loss(self.net(x).float(), y) for x, y, _ in parts)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (out / "progress" / f"validating{RANK}").write_text("")
        time.sleep(args.step_delay)
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        (out / "progress" / f"rank{RANK}").write_text(str(self.global_step))
        if ATTEMPT == 0 and args.kill_rank == RANK and self.global_step == args.kill_at_step:
            os.kill(os.getpid(), getattr(signal, args.signal))
        time.sleep(args.step_delay)
        if ATTEMPT == 0 and RANK == 0 and self.global_step == args.hang_at_step:
            (out / "hanging").write_text("")
            time.sleep(600)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.global_step == args.stall_save_at_step:
            checkpoint["stall"] = StallingPickle()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


callbacks: list[Any] = []
if args.every:
    callbacks.append(
        ModelCheckpoint(
            dirpath=out / "checkpoints", every_n_train_steps=args.every, save_top_k=-1, save_last=args.save_last
        )
    )
precision: Any = args.precision
plugins: list[Any] = []
if args.precision == "native-fp16":
    precision, plugins = None, [AmpPrecision(backend="native", max_loss_scale=2.0**10)]
trainer = L.Trainer(
    strategy=EnvDDPStrategy(auto_resume=args.auto_resume, timeout=args.timeout, max_restarts=args.max_restarts),
    accelerator="cpu",
    devices=args.devices or "auto",
    precision=precision,
    plugins=plugins,
    max_epochs=args.epochs,
    logger=False,
    callbacks=callbacks,
    enable_checkpointing=bool(args.every),
    enable_progress_bar=False,
    enable_model_summary=False,
    accumulate_grad_batches=args.accumulate,
    val_check_interval=0.5 if args.validate else None,
    num_sanity_val_steps=0,
)
model = Module()
train: Any = DataLoader(train_set(), batch_size=4, shuffle=True)
if args.two_loaders:
    train = {"long": train, "short": DataLoader(dataset(24, seed=5), batch_size=4, shuffle=True)}
val = DataLoader(dataset(16, seed=6), batch_size=4) if args.validate else None
trainer.fit(model, train, val)
report = {
    "attempt": ATTEMPT,
    "started_at_step": model.started_at_step,
    "global_step": trainer.global_step,
    "resumed_from": trainer.ckpt_path,
    "precision_state": trainer.precision_plugin.state_dict(),
}
(out / f"rank{RANK}.json").write_text(json.dumps(report, default=str))
if trainer.is_global_zero:
    torch.save(model.net.state_dict(), out / "weights.pt")
