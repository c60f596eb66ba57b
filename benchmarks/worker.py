"""Benchmark worker, one rank. Started by run.py under torchrun.

Two modes:
* ``--variants a,b,c --blocks K``: every variant trains in turn, in K blocks of ``--steps`` steps each, all in these
  same processes (the order rotates each block). Per-step times of different variants then come from the same
  processes, minutes apart at most: the comparison run.py reports.
* ``--variants a --blocks 1 --steps N``: one variant alone, for its start-up time and peak memory.
"""

import time

STARTED = time.perf_counter()  # before the imports: "start to first step" includes them

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--variants", required=True, help="comma-separated")
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--batch-size", type=int, default=64, help="per rank")
parser.add_argument("--warmup", type=int, default=10, help="steps at the start of each block, not measured")
parser.add_argument("--steps", type=int, default=60, help="measured steps per block")
parser.add_argument("--blocks", type=int, default=1)
parser.add_argument("--out", required=True)
args = parser.parse_args()
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# One core per rank (when there are enough): the OS scheduler moving ranks around is the largest noise here.
cores = sorted(os.sched_getaffinity(0))
if len(cores) >= int(os.environ["LOCAL_WORLD_SIZE"]):
    os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"])]})


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    w = args.width
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(w, w), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(w, 1))


def dataset() -> TensorDataset:
    total = args.batch_size * WORLD * (args.warmup + args.steps + 1)
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(total, args.width, generator=generator), torch.randn(total, 1, generator=generator)
    )


def recipe(step_ends: list[float], gradient_as_bucket_view: bool) -> None:
    """The classic hand-written loop, DDP at its defaults unless told otherwise."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(build_model(), gradient_as_bucket_view=gradient_as_bucket_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True)
    sampler.set_epoch(0)
    loop(
        DataLoader(data, batch_size=args.batch_size, sampler=sampler),
        model,
        optimizer,
        torch.Tensor.backward,
        step_ends,
    )


def loop(
    loader: Iterable[Any],
    model: Callable[[torch.Tensor], torch.Tensor],
    optimizer: Any,
    backward: Callable[[torch.Tensor], None],
    step_ends: list[float],
) -> None:
    """The hand-written training loop: the recipe, Fabric and Accelerate variants all run these same lines."""
    for x, y in loader:
        optimizer.zero_grad()
        backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        step_ends.append(time.perf_counter())


def lightning(step_ends: list[float], strategy: Any, **trainer_kwargs: Any) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def on_train_batch_end(self, *_: Any) -> None:
            step_ends.append(time.perf_counter())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(Module(), DataLoader(dataset(), batch_size=args.batch_size, shuffle=True))


def accelerate(step_ends: list[float]) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(dataset(), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loop(loader, model, optimizer, accelerator.backward, step_ends)


def fabric_loop(step_ends: list[float], strategy: str, **fabric_kwargs: Any) -> None:
    """The recipe's loop under Lightning Fabric: fabric.setup, fabric.setup_dataloaders, fabric.backward."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", strategy=strategy, precision="32-true", **fabric_kwargs)
    fabric.launch()  # under torchrun neither strategy starts processes; a group another variant made is kept
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    # shuffle=True: Fabric puts in DistributedSampler(shuffle=True, seed=0), the recipe's sampler, at epoch 0.
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=args.batch_size, shuffle=True))
    loop(loader, model, optimizer, fabric.backward, step_ends)


def variant(name: str) -> Callable[[list[float]], None]:
    if "envddp" in name:
        import lightning_ddp_amp  # noqa: F401  (registers "envddp" with the Trainer and Fabric)
    if name == "recipe":
        return lambda ends: recipe(ends, gradient_as_bucket_view=False)
    if name == "recipe-bucket-view":
        return lambda ends: recipe(ends, gradient_as_bucket_view=True)
    if name == "lightning-ddp":
        return lambda ends: lightning(ends, "ddp", devices=WORLD)
    if name == "envddp":
        return lambda ends: lightning(ends, "envddp")
    if name == "envddp-bf16":
        from lightning_ddp_amp import AmpPrecision

        return lambda ends: lightning(ends, "envddp", plugins=[AmpPrecision(dtype="bfloat16")])
    if name == "fabric-envddp":
        return lambda ends: fabric_loop(ends, "envddp")
    if name == "fabric-ddp":
        # Fabric's own ddp under torchrun: it reads the ranks from TorchElastic's variables and starts nothing; devices
        # is the ranks per node, as a Fabric script under torchrun passes it (Fabric's CPU default is 1 device), and as
        # for the Trainer's "ddp" above.
        return lambda ends: fabric_loop(ends, "ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]))
    if name == "accelerate":
        return accelerate
    raise SystemExit(f"unknown variant {name!r}")


names = args.variants.split(",")
runs = {name: variant(name) for name in names}
step_times: dict[str, list[float]] = {name: [] for name in names}
first_step: float | None = None
for block in range(args.blocks):
    order = names[block % len(names) :] + names[: block % len(names)]
    for name in order:
        ends: list[float] = []
        runs[name](ends)
        first_step = first_step if first_step is not None else ends[0] - STARTED
        step_times[name] += [b - a for a, b in itertools.pairwise(ends)][args.warmup :]
result = {
    "rank": RANK,
    "params": sum(p.numel() for p in build_model().parameters()),
    "median_step": {name: sorted(times)[len(times) // 2] for name, times in step_times.items()},
    "start_to_first_step": first_step,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}
Path(args.out, f"rank{RANK}.json").write_text(json.dumps(result))
if dist.is_initialized():
    dist.destroy_process_group()
