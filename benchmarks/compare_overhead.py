"""What ``lightning-ddp-amp compare`` costs per step, on both doors: the same training with and without its recording.

    python benchmarks/compare_overhead.py                  # CPU (or the GPU, when there is one), ~2 minutes
    python benchmarks/compare_overhead.py --door fabric --steps 400 --rounds 5 --width 1024

``trainer``: the same ``fit`` with and without the recording callback. ``fabric``: the same kept loop (a plain
``torch.nn.Module``, ``fabric.setup``, ``fabric.backward``, ``optimizer.step``) on a Fabric built plainly and on one
recorded as a compared run's is (:class:`~lightning_ddp_amp.commands.compare.fabric_recording.FabricRecording`,
which also keeps each model call of the step for the overflow locator).

The recording keeps its values on the device until the run ends, and reads back one per step (whether the gradient
norm is finite, for the overflow locator), so the difference should be the work itself: one gradient norm per step
(a norm per parameter tensor, then one of those), a clone of the loss, the random state taken before each batch (the
Trainer) or each model call's arguments and output gradient (Fabric), that one read, and two timestamps. Weight
snapshots are off here (the plan names no baseline folder). Rounds interleave the variants; per-step time is the
median interval between consecutive step ends after warm-up. Writes ``results/compare_overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp.commands.compare.fabric_recording import FabricRecording
from lightning_ddp_amp.commands.compare.recording import Changes, Recording
from lightning_ddp_amp.commands.compare.run_folder import Plan

RESULTS = Path(__file__).parent / "results"
WARMUP = 20


class StepClock(L.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()  # the clock's own sync, in both variants alike
        self.ends.append(time.perf_counter())

    def per_step(self) -> float:
        return statistics.median(b - a for a, b in zip(self.ends[WARMUP:], self.ends[WARMUP + 1 :], strict=False))


def mlp(width: int, depth: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def data(args: argparse.Namespace) -> DataLoader[Any]:
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(args.steps * 64, 64), torch.randn(args.steps * 64, 1)), batch_size=64)


class MLP(L.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = mlp(width, depth)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(recorded: bool, args: argparse.Namespace, folder: str) -> float:
    loader = data(args)
    clock = StepClock()
    callbacks: list[Any] = [clock]
    if recorded:
        plan = Plan("benchmark", args.precision, args.steps, folder)
        recording = type("CompareRecording", (Recording, L.Callback), {})
        # No checkpoints to point into the run's folder, and no validation run to read metrics from.
        callbacks.append(recording(plan, Changes(), lambda trainer: None, lambda trainer: {}))
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        precision=args.precision,
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
    )
    trainer.fit(MLP(args.width, args.depth), loader)
    return clock.per_step()


def kept_loop(recorded: bool, args: argparse.Namespace, folder: str) -> float:
    """A Fabric loop's median step time, its Fabric recorded as a compared run's or not."""
    loader = data(args)
    fabric = L.Fabric(accelerator="auto", devices=1, precision=args.precision)
    if recorded:
        # The run ends at its last step, as --steps ends one: its record is written, SystemExit raised in the step.
        FabricRecording(fabric, Plan("benchmark", args.precision, args.steps, folder), Changes(door="Fabric"))
    net = mlp(args.width, args.depth)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    ends: list[float] = []
    with contextlib.suppress(SystemExit):
        for x, y in fabric.setup_dataloaders(loader):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if fabric.device.type == "cuda":
                torch.cuda.synchronize()  # the clock's own sync, in both variants alike
            ends.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1 :], strict=False))


DOORS = {"trainer": fit, "fabric": kept_loop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--door", choices=[*DOORS, "both"], default="both")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()
    doors = list(DOORS) if args.door == "both" else [args.door]
    times: dict[str, dict[str, list[float]]] = {door: {"plain": [], "recorded": []} for door in doors}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for door in doors:
                for variant in ("plain", "recorded"):
                    times[door][variant].append(DOORS[door](variant == "recorded", args, folder))
    results = {door: _measured(times[door]) for door in doors}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    document = {"device": device, "torch": torch.__version__, "lightning": L.__version__, "settings": vars(args)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compare_overhead.json").write_text(json.dumps({**document, "doors": results}, indent=2))
    model = f"MLP {args.depth + 2} layers, width {args.width}, batch 64, {args.precision}"
    table = "| device | door | model | plain step | recorded step | overhead |\n|---|---|---|---|---|---|\n" + "".join(
        f"| {device} | {door} | {model} | {r['median_plain_s'] * 1e3:.3f} ms | {r['median_recorded_s'] * 1e3:.3f} ms"
        f" | {r['overhead_s'] * 1e6:+.0f} µs ({100 * r['overhead_ratio']:+.1f}%) |\n"
        for door, r in results.items()
    )
    (RESULTS / "compare_overhead.md").write_text(table)
    print(table)


def _measured(times: dict[str, list[float]]) -> dict[str, Any]:
    plain, recorded = statistics.median(times["plain"]), statistics.median(times["recorded"])
    return {
        "per_step_s": times,
        "median_plain_s": plain,
        "median_recorded_s": recorded,
        "overhead_s": recorded - plain,
        "overhead_ratio": recorded / plain - 1,
    }


if __name__ == "__main__":
    main()
