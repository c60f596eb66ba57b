"""envddp, on the Trainer and in a Fabric loop, against the plain PyTorch recipe, Lightning's own "ddp" and
Accelerate, on 2 CPU ranks (gloo).

    python benchmarks/run.py                 # about 11 minutes on 2 cores
    python benchmarks/run.py --quick         # one short round, smallest size: a smoke test
    python benchmarks/run.py --only fabric-envddp fabric-ddp accelerate --sizes 1M --rounds 6 --against fabric-ddp

Each variant trains the same MLP on the same data under ``torchrun --nproc-per-node=2``. Within one run all
variants train in turn, several times, in the same processes, so every ratio compares steps measured seconds
apart on the same machine, never numbers from another run. Per-step time is the median time between consecutive
optimizer steps, warm-up excluded, as the training loop sees it (data loading included). Writes
results/latest.json, latest.md and latest.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent
RESULTS = HERE / "results"
BASE = "recipe"

#: (name, what it is)
VARIANTS = {
    "recipe": "plain PyTorch, DDP at its defaults (the classic script)",
    "recipe-bucket-view": "plain PyTorch, DDP(gradient_as_bucket_view=True)",
    "lightning-ddp": 'Lightning, Trainer(strategy="ddp")',
    "envddp": 'Lightning, Trainer(strategy="envddp")',
    "envddp-bf16": "envddp + AmpPrecision(dtype='bfloat16') on the CPU",
    "fabric-envddp": 'Lightning Fabric(strategy="envddp"), the recipe\'s loop',
    "fabric-ddp": 'Lightning Fabric(strategy="ddp"), the recipe\'s loop',
    "accelerate": "Hugging Face Accelerate",
}
#: The main table's settings: width of the 4-layer MLP (~1M parameters), batch per rank, measured and warm-up steps.
MAIN = (512, 64, 60, 10)
#: Model sizes of the sweep: (label, width of the 4-layer MLP, batch per rank, measured steps).
SWEEP = [("1M", 512, 64, 200), ("10M", 1600, 64, 40), ("50M", 3536, 32, 12)]
SWEEP_VARIANTS = ["recipe", "lightning-ddp", "envddp"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(variants: list[str], width: int, batch_size: int, steps: int, warmup: int, blocks: int) -> dict[str, Any]:
    """One torchrun of 2 ranks; the slower rank sets each number."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
            str(HERE / "worker.py"), "--variants", ",".join(variants), "--width", str(width),
            "--batch-size", str(batch_size), "--steps", str(steps), "--warmup", str(warmup),
            "--blocks", str(blocks), "--out", out,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode:
            raise RuntimeError(f"{variants} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    return {
        "median_step": {v: max(r["median_step"][v] for r in ranks) for v in variants},
        "start_to_first_step": max(r["start_to_first_step"] for r in ranks),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "params": ranks[0]["params"],
    }


def compare(
    variants: list[str], rounds: int, width: int, batch_size: int, steps: int, warmup: int, blocks: int
) -> dict[str, Any]:
    """Per-step times of all ``variants`` trained in turn in the same processes, ``rounds`` times."""
    runs = []
    for round_ in range(rounds):
        print(f"  round {round_ + 1}/{rounds}: {', '.join(variants)} (width {width})", flush=True)
        runs.append(launch(variants, width, batch_size, steps, warmup, blocks))
    summary: dict[str, Any] = {}
    for variant in variants:
        ratios = [run["median_step"][variant] / run["median_step"][BASE] for run in runs]
        summary[variant] = {
            "median_step_ms": 1000 * statistics.median(run["median_step"][variant] for run in runs),
            "runs_ms": [1000 * run["median_step"][variant] for run in runs],
            "ratio_to_recipe": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "params": runs[0]["params"],
        }
    return summary


def ratio(summary: dict[str, Any], variant: str, reference: str) -> tuple[float, float, float]:
    """``variant``'s per-step time over ``reference``'s, run by run (both measured in the same processes): the
    median over the runs, the lowest and the highest."""
    ratios = [a / b for a, b in zip(summary[variant]["runs_ms"], summary[reference]["runs_ms"], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def focused(variants: list[str], sizes: list[str], rounds: int, blocks: int, against: str | None) -> None:
    """``--only``: the recipe and ``variants`` in interleaved rounds at each of ``sizes``, printed as Markdown."""
    variants = installed(list(dict.fromkeys([BASE, *variants, *([against] if against else [])])))
    references = [BASE] + ([against] if against in variants and against != BASE else [])
    for label in sizes:
        if label == SWEEP[0][0]:
            width, batch_size, steps, warmup = MAIN
        else:
            _, width, batch_size, sweep_steps = next(size for size in SWEEP if size[0] == label)
            steps, warmup = max(4, sweep_steps // 4), 2
        summary = compare(variants, rounds, width, batch_size, steps, warmup, blocks)
        params = summary[BASE]["params"]
        print(
            f"\n{label}: MLP 4x{width} ({params:,} params), batch {batch_size} per rank; runs: {rounds}, in each every"
            f" variant trains in turn {blocks} times ({warmup} + {steps} steps) in the same processes; median ratio"
            " over the runs (range)\n"
        )
        print("| variant | per-step (ms) | " + " | ".join(f"x {ref} (range)" for ref in references) + " |")
        print("|---|---|" + "---|" * len(references))
        for name, row in summary.items():
            cells = ["{:.3f} ({:.3f}-{:.3f})".format(*ratio(summary, name, ref)) for ref in references]
            print(f"| {name}: {VARIANTS[name]} | {row['median_step_ms']:.2f} | " + " | ".join(cells) + " |")


def installed(variants: list[str]) -> list[str]:
    """``variants`` less Accelerate when it is not installed (``pip install -e ".[bench]"``)."""
    if "accelerate" in variants and not importlib.util.find_spec("accelerate"):
        print('accelerate is not installed (pip install -e ".[bench]"): left out', flush=True)
        return [v for v in variants if v != "accelerate"]
    return variants


def alone(variant: str, width: int, batch_size: int) -> dict[str, Any]:
    """One variant in fresh processes: its start-up time and peak memory."""
    print(f"  alone: {variant}", flush=True)
    run = launch([variant], width, batch_size, steps=30, warmup=5, blocks=1)
    return {"start_to_first_step_s": run["start_to_first_step"], "peak_rss_mb": run["peak_rss_mb"]}


def markdown(main: dict[str, Any], sweep: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"2 ranks x 1 CPU thread, gloo; {meta['machine']}; torch {meta['torch']}, Lightning {meta['lightning']}."
        f" Per-step: {meta['rounds']} runs, in each every variant trains in turn {meta['blocks']} times in the"
        " same processes; median ratio to the recipe (range over runs). Start-up and memory: each variant alone."
        " MLP 4x512 (~1M params), batch 64 per rank.",
        "",
        "| variant | per-step (ms) | x recipe (range) | start → first step (s) | peak RSS per rank (MB) |",
        "|---|---|---|---|---|",
    ]
    for name, row in main.items():
        low, high = row["ratio_range"]
        lines.append(
            f"| {name}: {VARIANTS[name]} | {row['median_step_ms']:.2f} | {row['ratio_to_recipe']:.3f}"
            f" ({low:.3f}-{high:.3f}) | {row['start_to_first_step_s']:.1f} | {row['peak_rss_mb']:.0f} |"
        )
    lines += ["", "Scaling: per-step time and ratio to the recipe by model size.", ""]
    lines += ["| params | " + " | ".join(SWEEP_VARIANTS) + " |", "|---" * (len(SWEEP_VARIANTS) + 1) + "|"]
    for label, rows in sweep.items():
        cells = [f"{rows[v]['median_step_ms']:.1f} ms ({rows[v]['ratio_to_recipe']:.3f}x)" for v in SWEEP_VARIANTS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(main: dict[str, Any], sweep: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(main)
    left.barh(names, [main[n]["ratio_to_recipe"] for n in names], color="tab:blue")
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_xlabel("per-step time ÷ plain PyTorch recipe (lower is faster)")
    left.invert_yaxis()
    labels = list(sweep)
    for variant in SWEEP_VARIANTS:
        right.plot(labels, [sweep[s][variant]["ratio_to_recipe"] for s in labels], marker="o", label=variant)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xlabel("model parameters")
    right.set_ylabel("per-step time ÷ recipe")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=8, help="turns each variant takes within a round")
    parser.add_argument("--quick", action="store_true", help="one round of two blocks, smallest size only")
    parser.add_argument(
        "--only", nargs="+", choices=list(VARIANTS), help="compare only these variants with the recipe (printed only)"
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        choices=[size[0] for size in SWEEP],
        default=[SWEEP[0][0]],
        help="with --only: the model sizes, in parameters (default: 1M, the main table's settings)",
    )
    parser.add_argument(
        "--against", choices=list(VARIANTS), help="with --only: also each variant's ratio to this one, run by run"
    )
    args = parser.parse_args()
    rounds, blocks = (1, 2) if args.quick else (args.rounds, args.blocks)
    started = time.monotonic()
    if args.only:
        focused(args.only, args.sizes, rounds, blocks, args.against)
        print(f"\ntook {time.monotonic() - started:.0f} s")
        return
    variants = installed(list(VARIANTS))
    print("per-step comparison")
    width, batch_size, steps, warmup = MAIN
    main_table = compare(variants, rounds, width, batch_size, steps, warmup, blocks=blocks)
    print("start-up and memory")
    for variant in variants:
        main_table[variant].update(alone(variant, width=width, batch_size=batch_size))
    sweep: dict[str, dict[str, Any]] = {}
    for label, width, batch_size, steps in SWEEP[:1] if args.quick else SWEEP:
        print(f"sweep {label}")
        sweep[label] = compare(SWEEP_VARIANTS, rounds, width, batch_size, max(4, steps // 4), 2, 4)
    import lightning

    meta = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "rounds": rounds,
        "blocks": blocks,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps({"meta": meta, "main": main_table, "sweep": sweep}, indent=2))
    table = markdown(main_table, sweep, meta)
    (RESULTS / "latest.md").write_text(table)
    plot(main_table, sweep, RESULTS / "latest.png")
    print(table)
    print(f"took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
