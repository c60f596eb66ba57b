"""What ``lightning-ddp-amp compare`` costs per step, on both doors: the same training with and without its recording.

    python benchmarks/compare_overhead.py                  # CPU (or the GPU, when there is one), ~3 minutes
    python benchmarks/compare_overhead.py --door fabric --steps 1200 --rounds 3 --width 1024
    python benchmarks/compare_overhead.py --direct         # compare's own code per step, entry point by entry point

``trainer``: the same ``fit`` with and without the recording callback. ``fabric``: the same kept loop (a plain
``torch.nn.Module``, ``fabric.setup``, ``fabric.backward``, ``optimizer.step``) on a Fabric built plainly and on one
recorded as a compared run's is (:class:`~lightning_ddp_amp.commands.compare.fabric_recording.FabricRecording`,
which also watches each model call of the step for the overflow locator).

The recording keeps its values on the device until the run ends and reads back one per step (whether the loss is
finite, for the overflow locator), so the difference is the work itself: the series' bookkeeping, a gradient norm at
every ``--grad-norm-every``-th step (20, compare's default), the random state taken before each batch (the Trainer)
or each model call's arguments and output gradient kept (Fabric), and two timestamps. Weight snapshots are off here
(the plan names no baseline folder).

How it measures: the plain and the recorded training run in two threads that take turns every ``--block`` steps (one
runs while the other waits), so both see the same machine minute by minute; this 2-core VM's speed drifts by 10-20%
over a minute, which alternating whole runs could not separate from a 2% cost. A step's time is the interval between
consecutive step ends within a turn; the overhead of a round (one such pair of runs) is the median, over its turns
after warm-up, of the ratio of the recorded turn's median step to the mean of the plain turns just before and after
it. Each round is run twice, the plain training first and the recorded one first (two trainings in one process are not
alike: the order alone moved a Trainer's steps by 1-3% here), each pair is averaged, and the table gives the median of
the pairs. A first round per door is not counted: in it the plain training, the process's first, ran up to 20% slower
than in later rounds, which read as a recording 20% faster than no recording. A control does all of it with two plain trainings: the spread the method reads where there is nothing to
find. Writes ``results/compare_overhead.json`` and ``.md``. ``--direct`` times compare's own code instead
(:func:`direct`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.commands.compare.fabric_recording import FabricRecording
from lightning_ddp_amp.commands.compare.model_calls import ModelCalls
from lightning_ddp_amp.commands.compare.recorder import Recorder
from lightning_ddp_amp.commands.compare.recording import Changes, Recording
from lightning_ddp_amp.commands.compare.run_folder import DEFAULT_GRAD_NORM_EVERY, Plan

RESULTS = Path(__file__).parent / "results"
WARMUP = 50
VARIANTS = ("plain", "recorded")


class Turns:
    """Threads that take turns: each runs ``block`` steps, then hands over to the next one not finished."""

    def __init__(self, count: int, block: int) -> None:
        self.block = block
        self._go = [threading.Semaphore(0) for _ in range(count)]
        self._finished = [False] * count
        self.times: list[list[float]] = [[] for _ in range(count)]

    def clock(self, index: int) -> Callable[[], None]:
        """What variant ``index`` calls at each step's end: it times the step and, every ``block`` steps, waits for
        its next turn (the interval across a turn is not kept)."""
        last = [time.perf_counter()]
        done = [0]

        def step_ended() -> None:
            now = time.perf_counter()
            self.times[index].append(now - last[0])
            done[0] += 1
            if done[0] % self.block == 0 and self._hand_over(index):
                self._go[index].acquire()
            last[0] = time.perf_counter()

        return step_ended

    def run(self, trainings: Sequence[Callable[..., None]]) -> list[list[float]]:
        threads = [
            threading.Thread(target=self._own_turns, args=(index, training), daemon=True)
            for index, training in enumerate(trainings)
        ]
        for thread in threads:
            thread.start()
        self._go[0].release()
        for thread in threads:
            thread.join()
        return self.times

    def _own_turns(self, index: int, training: Callable[[Callable[[], None]], None]) -> None:
        self._go[index].acquire()
        try:
            with contextlib.suppress(SystemExit):  # a recorded kept loop ends as --steps ends a run
                training(self.clock(index))
        finally:
            self._finished[index] = True
            self._hand_over(index)

    def _hand_over(self, index: int) -> bool:
        """Let the next training not finished run; False when every other one has finished (this one goes on)."""
        count = len(self._go)
        for offset in range(1, count):
            other = (index + offset) % count
            if not self._finished[other]:
                self._go[other].release()
                return True
        return False


class StepClock(L.Callback):
    def __init__(self, step_ended: Callable[[], None]) -> None:
        self.step_ended = step_ended

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()  # the clock's own sync, in both variants alike
        self.step_ended()


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


def plan(args: argparse.Namespace, folder: str) -> Plan:
    return Plan("benchmark", args.precision, args.steps, folder, grad_norm_every=args.grad_norm_every)


def fit(recorded: bool, args: argparse.Namespace, folder: str, step_ended: Callable[[], None]) -> None:
    callbacks: list[Any] = [StepClock(step_ended)]
    if recorded:
        # As compare's patch builds it: the per-batch hooks it does not use are not called.
        unused = _lightning.silenced_callback_hooks(*Recording.UNUSED_HOOKS)
        recording = type("CompareRecording", (Recording, L.Callback), unused)
        # No checkpoints to point into the run's folder, and no validation run to read metrics from.
        callbacks.append(recording(plan(args, folder), Changes(), lambda trainer: None, lambda trainer: {}))
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
    trainer.fit(MLP(args.width, args.depth), data(args))


def kept_loop(recorded: bool, args: argparse.Namespace, folder: str, step_ended: Callable[[], None]) -> None:
    """A Fabric loop, its Fabric recorded as a compared run's or not."""
    fabric = L.Fabric(accelerator="auto", devices=1, precision=args.precision)
    if recorded:
        # The run ends at its last step, as --steps ends one: its record is written, SystemExit raised in the step.
        FabricRecording(fabric, plan(args, folder), Changes(door="Fabric"))
    net = mlp(args.width, args.depth)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    for x, y in fabric.setup_dataloaders(data(args)):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if fabric.device.type == "cuda":
            torch.cuda.synchronize()  # the clock's own sync, in both variants alike
        step_ended()


DOORS = {"trainer": fit, "fabric": kept_loop}


def one_round(
    door: str, args: argparse.Namespace, folder: str, *, recorded_first: bool, control: bool = False
) -> dict[str, float]:
    """The plain and the recorded training of ``door``, taking turns (the recorded one built and run first where
    ``recorded_first``): each one's median step time, and the median over the turns of the ratio of a recorded turn's
    median step to the mean of the plain turns just before and after it, which drift does not reach. With ``control``
    the "recorded" training is a plain one too: what the method reads where there is nothing to find."""
    order = (True, False) if recorded_first else (False, True)
    trainings = [
        lambda step_ended, recorded=recorded: DOORS[door](recorded and not control, args, folder, step_ended)
        for recorded in order
    ]
    times = dict(zip(order, Turns(len(trainings), args.block).run(trainings), strict=True))
    plain, recorded, block = times[False], times[True], args.block
    plain_turns = [statistics.median(plain[i : i + block]) for i in range(0, len(plain) - block + 1, block)]
    recorded_turns = [statistics.median(recorded[i : i + block]) for i in range(0, len(recorded) - block + 1, block)]
    before = 1 if recorded_first else 0  # the plain turn just before recorded turn i is i - 1 where it goes first
    turns = [
        recorded_turns[i] / ((plain_turns[i - before] + plain_turns[i - before + 1]) / 2)
        for i in range(WARMUP // block + 1, min(len(recorded_turns), len(plain_turns) + before - 1))
    ]
    return {
        "plain": statistics.median(plain[WARMUP:]),
        "recorded": statistics.median(recorded[WARMUP:]),
        "ratio": statistics.median(turns),
    }


#: ``--direct``: the recording's entry points on each door, none inside another (each is timed whole), as
#: (owner, method name) pairs: what one step runs of compare's own code, besides the few lines of the shadows that call
#: them.
ENTRY_POINTS = {
    "trainer": [
        (Recording, "on_train_batch_start"),
        (Recording, "on_before_optimizer_step"),
        (Recording, "on_train_batch_end"),
        (Recorder, "backward"),
    ],
    "fabric": [
        (FabricRecording, "_before_step"),
        (FabricRecording, "_after_step"),
        (ModelCalls, "before_call"),
        (ModelCalls, "after_call"),
        (Recorder, "backward"),
    ],
}


def direct(door: str, args: argparse.Namespace, folder: str) -> dict[str, float]:
    """Each entry point's time per step inside a recorded training (after warm-up), in seconds: a reading this VM's
    drift does not reach, as it times only compare's own code (not what that code costs the training's next steps, in
    caches, which the turns see)."""
    spent: dict[str, int] = {}
    steps = [0]
    originals = [(owner, name, getattr(owner, name)) for owner, name in ENTRY_POINTS[door]]

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*method_args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return method(*method_args, **kwargs)
            finally:
                if steps[0] >= WARMUP:
                    spent[name] = spent.get(name, 0) + time.perf_counter_ns() - start

        return run

    def step_ended() -> None:
        steps[0] += 1

    for owner, name, method in originals:
        setattr(owner, name, timed(f"{owner.__name__}.{name}", method))
    try:
        with contextlib.suppress(SystemExit):
            DOORS[door](True, args, folder, step_ended)
    finally:
        for owner, name, method in originals:
            setattr(owner, name, method)
    counted = max(1, steps[0] - WARMUP)
    return {name: total / counted / 1e9 for name, total in sorted(spent.items(), key=lambda item: -item[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--door", choices=[*DOORS, "both"], default="both")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="pairs of rounds: plain first, then recorded first")
    parser.add_argument("--block", type=int, default=20, help="steps per turn")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--grad-norm-every", type=int, default=DEFAULT_GRAD_NORM_EVERY)
    parser.add_argument("--direct", action="store_true", help="time compare's own code per step instead (see direct)")
    args = parser.parse_args()
    doors = list(DOORS) if args.door == "both" else [args.door]
    if args.direct:
        with tempfile.TemporaryDirectory() as folder:
            for door in doors:
                spent = direct(door, args, folder)
                print(f"{door}: {sum(spent.values()) * 1e6:.1f} µs per step of compare's own code")
                for name, seconds in spent.items():
                    print(f"  {name:40s} {seconds * 1e6:6.1f} µs")
        return
    rounds: dict[str, list[dict[str, float]]] = {door: [] for door in doors}
    controls: dict[str, list[dict[str, float]]] = {door: [] for door in doors}
    with tempfile.TemporaryDirectory() as folder:
        for door in doors:  # not counted: a process's first trainings ran up to 20% slower than the rest
            one_round(door, args, folder, recorded_first=False)
        for _ in range(args.rounds):
            for recorded_first in (False, True):
                for door in doors:
                    rounds[door].append(one_round(door, args, folder, recorded_first=recorded_first))
                    controls[door].append(one_round(door, args, folder, recorded_first=recorded_first, control=True))
    results = {door: {**_measured(rounds[door]), "control": _measured(controls[door])} for door in doors}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    document = {"device": device, "torch": torch.__version__, "lightning": L.__version__, "settings": vars(args)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compare_overhead.json").write_text(json.dumps({**document, "doors": results}, indent=2))
    model = f"MLP {args.depth + 2} layers, width {args.width}, batch 64, {args.precision}"
    header = (
        "| device | door | model | plain step | recorded step | overhead (rounds) | plain against plain (rounds) |\n"
    )
    table = header + "|---|---|---|---|---|---|---|\n"
    for door, r in results.items():
        table += f"| {device} | {door} | {model} | {r['median_plain_s'] * 1e3:.3f} ms"
        table += f" | {r['median_recorded_s'] * 1e3:.3f} ms | {_overhead(r)} | {_overhead(r['control'])} |\n"
    (RESULTS / "compare_overhead.md").write_text(table)
    print(table)


def _overhead(result: dict[str, Any]) -> str:
    rounds = ", ".join(f"{100 * ratio:+.1f}%" for ratio in result["round_ratios"])
    return f"{result['overhead_s'] * 1e6:+.0f} µs ({100 * result['overhead_ratio']:+.1f}%; {rounds})"


def _measured(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """The overhead: per pair of rounds (plain first, recorded first) the mean of their ratios, which cancels what the
    order of two trainings in one process costs the second; the median over the pairs."""
    ratios = [r["ratio"] - 1 for r in rounds]
    pairs = [(ratios[i] + ratios[i + 1]) / 2 for i in range(0, len(ratios) - 1, 2)]
    plain = statistics.median(r["plain"] for r in rounds)
    ratio = statistics.median(pairs)
    return {
        "rounds": rounds,
        "round_ratios": ratios,
        "pair_ratios": pairs,
        "median_plain_s": plain,
        "median_recorded_s": plain * (1 + ratio),
        "overhead_s": plain * ratio,
        "overhead_ratio": ratio,
    }


if __name__ == "__main__":
    main()
