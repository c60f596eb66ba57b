"""GPU section: step time of a small convolutional network in fp32, native AMP (fp16, bf16) and apex (O1, O2, O3).

    python benchmarks/gpu.py                  # on a GPU machine: about a minute, one process per configuration
    python benchmarks/gpu.py --budget 120     # more time: the configurations the budget cuts off are listed

Each configuration trains the same ResNet-style model on synthetic 3x64x64 images under
Trainer(strategy="envddp") on every visible GPU (torchrun with more than one), in a fresh process: apex allows one
amp.initialize per process. The time of a step is the median interval between consecutive optimizer steps after
warm-up, data loading included; "x fp32" divides it by the fp32 step. Apex rows appear where NVIDIA apex (with
apex.amp) is importable; without its CUDA extensions apex runs its Python fallbacks (one host sync per gradient to
check for overflow), and the results say so. Results are rewritten after every configuration, so a run cut short
keeps the finished rows: results/gpu.json and gpu.md (--results elsewhere). Without CUDA it says so and exits 0.
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

RESULTS = Path(__file__).parent / "results"
CONFIGS = ["32-true", "fp16:native", "bf16:native", "apex-O1", "apex-O2", "apex-O3"]
#: Distinct images in the synthetic set; drawing each of the thousands a run reads would take seconds.
POOL = 512


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


class Images(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``length`` labelled images, drawn in turn from a pool of ``POOL`` random ones."""

    def __init__(self, length: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(POOL, 3, 64, 64, generator=generator)
        self.labels = torch.randint(0, 100, (POOL,), generator=generator)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index % POOL], self.labels[index % POOL]


def train(config: str, steps: int, warmup: int, batch_size: int) -> dict[str, Any]:
    import lightning as L
    from torch.utils.data import DataLoader

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
    if config.endswith(":native"):
        dtype = {"fp16": "float16", "bf16": "bfloat16"}[config.removesuffix(":native")]
        precision, plugins = None, [AmpPrecision(backend="native", dtype=dtype)]
    world = int(os.environ.get("WORLD_SIZE", "1"))
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
    images = Images(batch_size * world * steps)
    trainer.fit(Module(), DataLoader(images, batch_size=batch_size, num_workers=2))
    times = sorted(b - a for a, b in itertools.pairwise(ends[warmup:]))
    step = times[len(times) // 2]
    return {"config": config, "step_ms": 1000 * step, "images_per_s": batch_size * world / step}


def apex_state() -> tuple[bool, str]:
    """Whether apex.amp is importable, and how it runs: with its CUDA extensions or on its Python fallbacks."""
    try:
        import apex.amp  # noqa: F401
        from apex.multi_tensor_apply import multi_tensor_applier
    except ImportError as error:
        return False, f"not importable ({error})"
    return True, "CUDA extensions" if multi_tensor_applier.available else "Python fallbacks (no CUDA extensions)"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    fp32 = next((row["step_ms"] for row in rows if row["config"] == "32-true" and "step_ms" in row), None)
    lines = [
        f"{meta['gpus']} x {meta['gpu']}; torch {meta['torch']} (CUDA {meta['cuda']}), Lightning {meta['lightning']};"
        f" apex: {meta['apex']}. Batch {meta['batch_size']} per GPU, median of {meta['steps'] - meta['warmup'] - 1}"
        " step intervals after warm-up.",
        "",
        "| precision | step (ms) | x fp32 | images/s |",
        "|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['config']} | n/a | | {row['error']} |")
        else:
            ratio = f"{row['step_ms'] / fp32:.2f}" if fp32 else "n/a"
            lines.append(f"| {row['config']} | {row['step_ms']:.1f} | {ratio} | {row['images_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def run_config(config: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """One configuration in a fresh process (torchrun on more than one GPU); its RESULT line, or what went wrong."""
    gpus = torch.cuda.device_count()
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={gpus}"] if gpus > 1 else []
    command = [
        sys.executable, *launcher, str(Path(__file__)), "--config", config,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"config": config, "error": f"did not finish within {timeout:.0f}s"}
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line:
        return json.loads(line.removeprefix("RESULT "))  # type: ignore[no-any-return]
    last = (done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines()[-1]
    return {"config": config, "error": last[-300:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="run one configuration (internal)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--budget", type=float, default=60, help="seconds for all configurations together")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for gpu.json and gpu.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("No CUDA device: the GPU benchmark is skipped.")
        return
    if args.config:
        result = train(args.config, args.steps, args.warmup, args.batch_size)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result))
        return
    import lightning

    has_apex, apex = apex_state()
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        "apex": apex,
        **{key: getattr(args, key) for key in ("steps", "warmup", "batch_size", "budget")},
    }
    args.results.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    rows: list[dict[str, Any]] = []
    for config in CONFIGS:
        left = deadline - time.monotonic()
        if config.startswith("apex-") and not has_apex:
            rows.append({"config": config, "error": f"apex {apex}"})
        elif left < 5:
            rows.append({"config": config, "error": f"not run: the {args.budget:g}s budget was spent"})
        else:
            rows.append(run_config(config, args, timeout=left))
        # Written after every configuration: a run stopped from outside keeps what it measured.
        (args.results / "gpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        table = markdown(rows, meta)
        (args.results / "gpu.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
