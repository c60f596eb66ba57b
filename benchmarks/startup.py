"""Start-up and end of a short job as whole processes: how long a launch costs, from the command to its exit.

Four commands, each timed from its start to its exit, in interleaved rounds (5 by default; medians):

* `python startup_job.py --variant envddp --devices 2`: envddp starts the ranks itself (self-launch, torchrun's agent)
* `python startup_job.py --variant ddp --devices 2`: Lightning's own launcher
* `torchrun --nproc-per-node=2 startup_job.py --variant envddp`
* `torchrun --nproc-per-node=2 startup_job.py --variant recipe`: the plain PyTorch recipe

Each job traces (STARTUP_TRACE) when each process started, finished its imports, built the Trainer, started and
ended training, and ran its exit handlers, so the report also says where the difference goes: before the first
rank starts, the ranks' imports, training, and from the ranks' end to the command's exit.

    python benchmarks/startup.py [--rounds 5] [--out benchmarks/results/startup]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
JOB = str(HERE / "startup_job.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
COMMANDS = {
    "self-launch (envddp, devices=2)": [sys.executable, JOB, "--variant", "envddp", "--devices", "2"],
    "Lightning ddp (devices=2)": [sys.executable, JOB, "--variant", "ddp", "--devices", "2"],
    "torchrun + envddp": [*TORCHRUN, JOB, "--variant", "envddp"],
    "torchrun + recipe": [*TORCHRUN, JOB, "--variant", "recipe"],
}
# The differences the report states: (command, the one it is measured against).
PAIRS = [
    ("self-launch (envddp, devices=2)", "Lightning ddp (devices=2)"),
    ("torchrun + envddp", "torchrun + recipe"),
]
# Phases of a run, from the trace: (name, from event, to event). "first" and "last" pick among processes.
PHASES = [
    ("command start → first rank starts", "t0", "first rank start"),
    ("rank start → training starts", "first rank start", "last fit-start"),
    ("training", "last fit-start", "last fit-end"),
    ("training ends → ranks' exit handlers", "last fit-end", "last rank exit"),
    ("ranks' exit handlers → command exits", "last rank exit", "t1"),
]


def timeline(trace: Path, t0: float, t1: float) -> dict[str, float]:
    """The moments PHASES names, from a job's trace; the main process of Lightning's ddp counts as rank 0."""
    events: dict[str, list[float]] = {}
    launcher_pid = None
    rows = [line.split() for line in trace.read_text().splitlines()]
    for at, pid, role, event in rows:
        if role == "main" and launcher_pid is None:
            launcher_pid = pid
        # The launching process of a self-launch never trains; Lightning's ddp trains in it.
        is_rank = role.startswith("rank") or any(r[1] == pid and r[3] == "fit-start" for r in rows)
        if is_rank:
            events.setdefault(f"rank {event}", []).append(float(at))
        if event in ("fit-start", "fit-end"):
            events.setdefault(event, []).append(float(at))
    moments = {"t0": t0, "t1": t1}
    for key, values in events.items():
        moments[f"first {key}"], moments[f"last {key}"] = min(values), max(values)
    return moments


def run_once(command: list[str]) -> tuple[float, dict[str, float]]:
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.txt"
        env = {**os.environ, "STARTUP_TRACE": str(trace), "OMP_NUM_THREADS": "1"}
        t0 = time.time()
        result = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=600)
        t1 = time.time()
        if result.returncode != 0:
            raise SystemExit(f"{command} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
        moments = timeline(trace, t0, t1)
    phases = {name: moments[end] - moments[start] for name, start, end in PHASES if start in moments and end in moments}
    return t1 - t0, phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "startup"))
    parser.add_argument("--only", nargs="+", metavar="WORD", help="only the commands whose name has one of these")
    args = parser.parse_args()
    if args.only:
        for name in [n for n in COMMANDS if not any(word in n for word in args.only)]:
            del COMMANDS[name]
    totals: dict[str, list[float]] = {name: [] for name in COMMANDS}
    phases: dict[str, dict[str, list[float]]] = {name: {} for name in COMMANDS}
    run_once(next(iter(COMMANDS.values())))  # warm the file cache: the first import of torch is slower
    for round_ in range(args.rounds):
        for name, command in COMMANDS.items():
            total, parts = run_once(command)
            totals[name].append(total)
            for phase, seconds in parts.items():
                phases[name].setdefault(phase, []).append(seconds)
            print(f"round {round_ + 1}: {name}: {total:.2f} s", flush=True)
    median = {name: statistics.median(values) for name, values in totals.items()}
    lines = [
        f"Whole processes, {args.rounds} interleaved rounds, medians (range); 2 ranks on the CPU, gloo, 20 steps.",
        "",
        "| command | seconds (range) | " + " | ".join(name for name, _, _ in PHASES) + " |",
        "|---|---|" + "---|" * len(PHASES),
    ]
    for name, values in totals.items():
        cells = [f"{statistics.median(phases[name][p]):.2f}" if p in phases[name] else "-" for p, _, _ in PHASES]
        lines.append(
            f"| {name} | {median[name]:.2f} ({min(values):.2f}-{max(values):.2f}) | " + " | ".join(cells) + " |"
        )
    lines.append("")
    for a, b in PAIRS:
        if a in median and b in median:
            lines.append(f"{a} - {b}: {median[a] - median[b]:+.2f} s")
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"totals": totals, "phases": phases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
