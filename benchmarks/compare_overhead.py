"""What ``lightning-ddp-amp compare`` costs per step: the same fit with and without its recording callback.

    python benchmarks/compare_overhead.py                  # CPU (or the GPU, when there is one), ~1 minute
    python benchmarks/compare_overhead.py --steps 400 --rounds 5 --width 1024

The recording keeps its values on the device until ``fit`` ends, and reads back one per step (whether the gradient
norm is finite, for the overflow locator), so the difference should be the work itself: one gradient norm per step
(a norm per parameter tensor, then one of those), a clone of the loss, the random state taken before each batch,
that one read, and two timestamps. Weight snapshots are off here (the plan names no baseline folder). Rounds interleave the two variants; per-step time is the median interval between consecutive
batch ends after warm-up. Writes ``results/compare_overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

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


class MLP(L.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = [torch.nn.Linear(64, width), torch.nn.ReLU()]
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(recorded: bool, args: argparse.Namespace, folder: str) -> float:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.steps * 64, 64), torch.randn(args.steps * 64, 1))
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
    trainer.fit(MLP(args.width, args.depth), DataLoader(data, batch_size=64))
    return clock.per_step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"plain": [], "recorded": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for variant in ("plain", "recorded"):
                times[variant].append(fit(variant == "recorded", args, folder))
    plain, recorded = statistics.median(times["plain"]), statistics.median(times["recorded"])
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "lightning": L.__version__,
        "settings": vars(args),
        "per_step_s": times,
        "median_plain_s": plain,
        "median_recorded_s": recorded,
        "overhead_s": recorded - plain,
        "overhead_ratio": recorded / plain - 1,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compare_overhead.json").write_text(json.dumps(result, indent=2))
    table = (
        f"| device | model | plain step | recorded step | overhead |\n|---|---|---|---|---|\n"
        f"| {result['device']} | MLP {args.depth + 2} layers, width {args.width}, batch 64, {args.precision} |"
        f" {plain * 1e3:.3f} ms | {recorded * 1e3:.3f} ms | {(recorded - plain) * 1e6:+.0f} µs"
        f" ({100 * (recorded / plain - 1):+.1f}%) |\n"
    )
    (RESULTS / "compare_overhead.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
