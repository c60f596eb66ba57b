"""A short job, started whole by startup.py: the same MLP trained for a few steps four ways.

    --variant envddp   Trainer(strategy="envddp"): under torchrun, or `python startup_job.py --devices 2` (self-launch)
    --variant ddp      Trainer(strategy="ddp"): Lightning's own launcher starts the other ranks from `python ...`
    --variant recipe   the plain PyTorch recipe (DDP, DistributedSampler), under torchrun

With STARTUP_TRACE=FILE every process appends `<wall time> <pid> <role> <event>` lines to FILE, so startup.py can
say where the time between the command's start and its end went.
"""

import time

STARTED = time.time()  # before the imports

import argparse  # noqa: E402
import atexit  # noqa: E402
import os  # noqa: E402


def trace(event: str, at: float | None = None) -> None:
    path = os.environ.get("STARTUP_TRACE")
    if path:
        role = f"rank{os.environ['RANK']}" if "RANK" in os.environ else "main"
        with open(path, "a") as file:
            file.write(f"{at or time.time():.6f} {os.getpid()} {role} {event}\n")


trace("start", STARTED)
atexit.register(trace, "exit")

parser = argparse.ArgumentParser()
parser.add_argument("--variant", required=True, choices=["envddp", "ddp", "recipe"])
parser.add_argument("--devices", type=int, default=None, help="for `python ...` without a launcher")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

torch.set_num_threads(1)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * args.steps * 2, 32, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


if args.variant == "recipe":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    trace("imported")
    dist.init_process_group("gloo")
    net = DDP(model())
    sampler = DistributedSampler(data(), shuffle=True)
    loader = DataLoader(data(), batch_size=64, sampler=sampler)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    trace("fit-start")
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    trace("fit-end")
    dist.destroy_process_group()
else:
    import lightning as L

    if args.variant == "envddp":
        import lightning_ddp_amp  # noqa: F401

    class Job(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_start(self) -> None:
            trace("fit-start")

        def on_train_end(self) -> None:
            trace("fit-end")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trace("imported")
    trainer = L.Trainer(
        strategy=args.variant,
        accelerator="cpu",
        devices=args.devices if args.devices else "auto",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trace("trainer")
    trainer.fit(Job(), DataLoader(data(), batch_size=64, shuffle=True))
