"""Two rows of the README's migration table as a classic/migrated pair: gradient accumulation, and a warm-up
scheduler stepped every iteration (test_migrate.py).

--mode classic: the recipe by hand (DDP, a DistributedSampler, apex amp O1): with --accumulate N the loss is divided
by N, the first N - 1 micro-batches run under ``no_sync()`` and ``amp.scale_loss(..., delay_unscale=True)``, and
the optimizer steps every N; with --warmup W a LambdaLR warms the LR up over W optimizer steps, stepped after each
one that was not skipped on overflow.
--mode lightning: the migrated module under ``Trainer(strategy="envddp", precision="apex-O1",
accumulate_grad_batches=N)``, its loss not divided (--keep-division keeps the classic division: the trap) and its
scheduler at ``"interval": "step"`` (--interval epoch: Lightning's default, the other trap).

Rank 0 saves OUT/weights.pt (the net's state_dict) and OUT/lrs.json (the LR of every optimizer step).
"""

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from common import LR, SEED, build_net, train_set
from torch.utils.data import DataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", required=True, choices=["classic", "lightning"])
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--warmup", type=int, default=0, help="warm-up steps of a per-iteration LambdaLR")
parser.add_argument("--interval", default="step", choices=["step", "epoch"])
parser.add_argument("--keep-division", action="store_true")
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()
out = Path(args.out)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / args.warmup) if args.warmup else 1.0


def optimizer_for(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=LR, momentum=0.9)


def save(net: torch.nn.Module, lrs: list[float]) -> None:
    torch.save({name: tensor.detach().float().cpu() for name, tensor in net.state_dict().items()}, out / "weights.pt")
    (out / "lrs.json").write_text(json.dumps(lrs))


def classic() -> None:
    import torch.distributed as dist
    from apex import amp
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    from lightning_ddp_amp.launch.process_group import destroy_process_group

    dist.init_process_group("gloo")
    net = build_net()
    optimizer = optimizer_for(net.parameters())
    net, optimizer = amp.initialize(net, optimizer, opt_level="O1")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    model = DDP(net)
    dataset = train_set()
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    lrs = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y, _) in enumerate(loader):
            stepping = (i + 1) % args.accumulate == 0
            scale = amp.state_dict()["loss_scaler0"]["loss_scale"]  # backed off when scale_loss finds an overflow
            with contextlib.nullcontext() if stepping else model.no_sync():
                loss = torch.nn.functional.mse_loss(model(x).float(), y) / args.accumulate
                with amp.scale_loss(loss, optimizer, delay_unscale=not stepping) as scaled_loss:
                    scaled_loss.backward()
            if stepping:
                lrs.append(optimizer.param_groups[0]["lr"])
                optimizer.step()
                optimizer.zero_grad()
                # A step skipped on overflow (apex backs the loss scale off exactly then) leaves the schedule.
                if amp.state_dict()["loss_scaler0"]["loss_scale"] >= scale:
                    scheduler.step()
    if dist.get_rank() == 0:
        save(model.module, lrs)
    destroy_process_group()


def lightning() -> None:
    import lightning as L

    import lightning_ddp_amp  # noqa: F401 (registers "envddp" and "apex-O1")

    class Migrated(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_net()  # one model: AmpPrecision initializes the LightningModule itself
            self.lrs: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, _ = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
            return loss / args.accumulate if args.keep_division else loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.lrs.append(optimizer.param_groups[0]["lr"])

        def configure_optimizers(self) -> Any:
            optimizer = optimizer_for(self.parameters())
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": args.interval}}

    trainer = L.Trainer(
        strategy="envddp", precision="apex-O1", accelerator="cpu", accumulate_grad_batches=args.accumulate,
        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = Migrated()
    trainer.fit(module, DataLoader(train_set(), batch_size=4, shuffle=True))
    if trainer.is_global_zero:
        save(module.net, module.lrs)


torch.manual_seed(SEED)
os.makedirs(out, exist_ok=True)
classic() if args.mode == "classic" else lightning()
