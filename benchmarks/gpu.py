"""GPU section: throughput of a small convolutional network in fp32, native AMP (fp16, bf16) and apex (O1, O2).

    python benchmarks/gpu.py        # on a GPU machine: one torchrun per configuration, on every visible GPU

Each configuration trains the same ResNet-style model on synthetic 3x64x64 images under
Trainer(strategy="envddp"); apex rows appear only where NVIDIA apex (with apex.amp) is installed, each in a fresh
process (apex allows one amp.initialize per process). Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

CONFIGS = ["32-true", "amp-O1:native", "bf16:native", "apex-O1", "apex-O2"]


def model() -> torch.nn.Module:
    def block(channels_in: int, channels_out: int) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(channels_out),
            torch.nn.ReLU(inplace=True),
        )

    return torch.nn.Sequential(
        block(3, 64), block(64, 64), torch.nn.MaxPool2d(2),
        block(64, 128), block(128, 128), torch.nn.MaxPool2d(2),
        block(128, 256), block(256, 256), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(256, 100),
    )  # fmt: skip


def train(config: str, steps: int, batch_size: int) -> dict[str, Any]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ddp_amp import AmpPrecision

    ends: list[float] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def configure_amp_models(self) -> list[torch.nn.Module]:
            return [self.net]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x).float(), y)

        def on_train_batch_end(self, *_: Any) -> None:
            torch.cuda.synchronize()
            ends.append(time.perf_counter())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    precision: Any = config
    plugins: list[Any] = []
    if config == "amp-O1:native":
        precision, plugins = None, [AmpPrecision(backend="native")]
    elif config == "bf16:native":
        precision, plugins = None, [AmpPrecision(backend="native", dtype="bfloat16")]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    images = torch.randn(batch_size * world * steps, 3, 64, 64)
    labels = torch.randint(0, 100, (len(images),))
    trainer = L.Trainer(
        strategy="envddp",
        accelerator="cuda",
        precision=precision,
        plugins=plugins,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(TensorDataset(images, labels), batch_size=batch_size, num_workers=2))
    times = sorted(b - a for a, b in itertools.pairwise(ends[10:]))
    step = times[len(times) // 2]
    return {"config": config, "step_ms": 1000 * step, "images_per_s": batch_size * world / step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="run one configuration (internal)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("No CUDA device: the GPU benchmark is skipped.")
        return
    if args.config:
        result = train(args.config, args.steps, args.batch_size)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result))
        return
    rows = []
    for config in CONFIGS:
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={torch.cuda.device_count()}",
            str(Path(__file__)), "--config", config, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        rows.append(json.loads(line[7:]) if line else {"config": config, "error": done.stderr.strip()[-300:]})
    print("| precision | step (ms) | images/s |\n|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['config']} | n/a | {row['error'].splitlines()[-1] if row['error'] else 'failed'} |")
        else:
            print(f"| {row['config']} | {row['step_ms']:.1f} | {row['images_per_s']:.0f} |")


if __name__ == "__main__":
    main()
