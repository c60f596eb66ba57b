"""``lightning-ddp-amp compare``: one training command under several precisions, and how far apart they land.

::

    lightning-ddp-amp compare apex-O1 amp-O1 bf16-mixed -- python train.py --lr 0.1
    lightning-ddp-amp compare apex-O1 amp-O1 -- torchrun --nproc-per-node=8 train.py
    lightning-ddp-amp compare 32-true 32-true -- python train.py --lr 0.1 -- python train.py --lr 0.11

Each precision is a candidate; the first is the baseline. A precision is any ``Trainer(precision=...)`` value
(``apex-O1``, ``amp-O1``, ``16-mixed``, ``bf16-mixed``, ``32-true``, ...) or, for compare only, ``native-O0`` …
``native-O3``: torch's own AMP at that apex level even where apex is installed (where ``amp-O*`` runs apex). The candidates run one after the other, each as the
user's own command, unchanged: the script need not import this package. What changes inside each run, and what it
records, is :mod:`lightning_ddp_amp.commands.compare.patching`'s and :mod:`~lightning_ddp_amp.commands.compare.recording`'s, in the run's
folder (:mod:`~lightning_ddp_amp.commands.compare.run_folder`). One command serves every candidate; with as many commands as
candidates (each after its own ``--``), candidate *i* runs command *i*.

Afterwards :mod:`lightning_ddp_amp.commands.compare.report` checks that the runs are comparable, and reports each candidate
against the baseline: on the terminal (:mod:`~lightning_ddp_amp.commands.compare.terminal`), in ``DIR/compare.json`` and,
with matplotlib, in ``DIR/compare.png`` (:mod:`~lightning_ddp_amp.commands.compare.picture`).

Exit status: 0 when every candidate is close to the baseline; 1 when one is apart or failed; 2 when nothing could
be compared (a usage error, a baseline that failed, runs that did not start alike, or a ``--metric`` the baseline
never logged).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TextIO

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.commands.compare import report as compare_report
from lightning_ddp_amp.commands.compare import run_folder, terminal
from lightning_ddp_amp.commands.compare.candidate import Candidate
from lightning_ddp_amp.commands.compare.comparable import stop_after_baseline
from lightning_ddp_amp.commands.compare.run_folder import (
    DEFAULT_GRAD_NORM_EVERY,
    OUTPUT_FILES,
    PLAN_FILE,
    PLAN_VARIABLE,
    Plan,
)
from lightning_ddp_amp.commands.compare.schema import BASELINE, CANDIDATE, NOISE_FLOOR, Role
from lightning_ddp_amp.commands.compare.tolerance import Metric, Tolerance
from lightning_ddp_amp.errors import CheckpointError, PrecisionConfigurationError
from lightning_ddp_amp.precision_strings import check_precision

#: ``--steps``: enough for a loss curve to settle into its trend on most models, short enough to run before a switch.
DEFAULT_STEPS = 200
#: ``--snapshots``: the points along the run where weight distances are measured (the last is the end).
DEFAULT_SNAPSHOTS = 8
#: Programs that start a training command, recognised when one is given without ``--``.
LAUNCHERS = ("python", "python3", "torchrun", "srun", "mpirun", "accelerate", "deepspeed", "lightning")
#: Where ``sitecustomize`` waits for the script's Lightning import.
SITE = Path(__file__).parent / "_site"


#: ``compare --help``'s closing text: examples, the precisions, the exit statuses.
EPILOG = """Then `--` and the training command, as you run it (python, torchrun, python -m, a LightningCLI script);
several commands, each after its own `--`, one per precision.

examples:
  lightning-ddp-amp compare apex-O1 native-O1 -- torchrun --nproc-per-node=8 train.py
  lightning-ddp-amp compare 32-true native-O1 bf16-mixed --steps 100 -- python train.py --lr 0.1
  lightning-ddp-amp compare apex-O1 native-O1 --noise-floor --metric val_acc:0.005 -- python train.py
  lightning-ddp-amp compare 32-true 32-true -- python train.py --lr 0.1 -- python train.py --lr 0.11

precisions:
  apex-O0 ... apex-O3      NVIDIA apex amp at that opt_level
  amp-O0 ... amp-O3        apex where it can run, else torch's AMP at that level
  native-O0 ... native-O3  torch's AMP at that level, even where apex is installed
  any Trainer precision    32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, 64-true, ...

exit status:
  0  every candidate is close to the baseline
  1  a candidate is apart, or failed
  2  nothing was compared: a usage error, a baseline that failed, runs that did not start alike,
     or a --metric the baseline never logged"""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-ddp-amp compare",
        description=__doc__.split("\n")[0].strip("`: ").split(": ", 1)[-1],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "precisions",
        nargs="+",
        metavar="PRECISION",
        help="apex-O*, amp-O*, native-O* or a Trainer(precision=...) value; the first is the baseline",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"optimizer steps per run at most (default {DEFAULT_STEPS}); a run stops sooner where the script's own"
        " max_steps or max_epochs ends it first",
    )
    parser.add_argument(
        "--out", type=Path, help="the folder for every run and the report (default: compare-DATE-TIME here)"
    )
    parser.add_argument("--ckpt", type=Path, help="every candidate's fit starts from this checkpoint")
    parser.add_argument(
        "--trust-ckpt",
        action="store_true",
        help="read a --ckpt that names more than tensors, plain values and argparse.Namespace, which runs whatever"
        " code its pickle says: only for a file whose source you trust",
    )
    parser.add_argument(
        "--tolerance",
        type=Tolerance.parse,
        default=Tolerance(),
        metavar="LOSS[,WEIGHTS]",
        help=f"beyond which a candidate is apart: the relative final-loss difference and the weight distance relative to"
        f" the baseline's travel (default {Tolerance().loss},{Tolerance().weights}; one number sets both)",
    )
    parser.add_argument(
        "--metric",
        type=Metric.parse,
        action="append",
        default=[],
        metavar="NAME[:TOL]",
        help="a metric the script logs in validation or test that the verdict also requires close: TOL is the largest"
        f" difference (0.005) or, ending in %%, relative to the baseline's value (default {Metric('x').tolerance_text()}%)",
    )
    parser.add_argument(
        "--noise-floor",
        action="store_true",
        help="also run the baseline again with every initial weight one ulp up, and report each distance beside"
        " that run's: the distance that means nothing here",
    )
    parser.add_argument(
        "--snapshots",
        type=int,
        default=DEFAULT_SNAPSHOTS,
        metavar="N",
        help=f"measure the weight distance at N points along the run (default {DEFAULT_SNAPSHOTS}; the baseline keeps"
        " its weights at each, on rank 0's disk; 1: at the end only)",
    )
    parser.add_argument(
        "--grad-norm-every",
        type=int,
        default=DEFAULT_GRAD_NORM_EVERY,
        metavar="N",
        help=f"measure the gradient norm at every N-th step (default {DEFAULT_GRAD_NORM_EVERY}; 1: every step, at the"
        " cost of one more read of every gradient per step)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-ddp-amp compare ...``; returns the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    options, commands = _split_commands(argv)
    command_line = parser()
    if not commands:
        _refuse_command_without_separator(options, command_line)
    args = command_line.parse_args(options)
    for precision in args.precisions:
        _check_precision(precision, command_line)
    if len(args.precisions) < 2:
        command_line.error(
            f"PRECISION={args.precisions}: compare needs a baseline and at least one candidate. Fix: name two or more precisions, e.g. `compare apex-O1 amp-O1 -- ...`"
        )
    if not commands or not all(commands):
        command_line.error(
            "command=None: no training command after `--`. Fix: `lightning-ddp-amp compare apex-O1 amp-O1 -- python train.py`"
        )
    if len(commands) not in (1, len(args.precisions)):
        command_line.error(
            f"commands={len(commands)}: there are {len(args.precisions)} precisions. Fix: give one command for all, or one per precision, each after its own `--`"
        )
    if args.steps < 1:
        command_line.error(f"--steps={args.steps}: a run needs at least one step. Fix: pass --steps 1 or more")
    if args.snapshots < 1:
        command_line.error(f"--snapshots={args.snapshots}: the end is always one. Fix: pass --snapshots 1 or more")
    if args.grad_norm_every < 1:
        command_line.error(
            f"--grad-norm-every={args.grad_norm_every}: it counts steps. Fix: pass 1 (every step) or more"
        )
    names = [metric.name for metric in args.metric]
    if len(set(names)) < len(names):
        command_line.error(f"--metric={names}: a metric is named twice. Fix: name each metric once, with one tolerance")
    if args.ckpt is not None and not args.ckpt.is_file():
        command_line.error(f"--ckpt={str(args.ckpt)!r}: no such file. Fix: pass the path of a checkpoint file")
    out: Path = args.out or Path(f"compare-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    if out.exists() and not out.is_dir():
        command_line.error(f"--out={str(out)!r}: it is a file, not a folder. Fix: name a new or empty folder")
    if out.exists() and any(out.iterdir()):
        command_line.error(
            f"--out={str(out)!r}: the folder is not empty, and its runs' checkpoints could be resumed. Fix: name a new folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    ckpt = None if args.ckpt is None else str(args.ckpt.resolve())
    first_step = 0 if ckpt is None else _saved_step(ckpt, command_line, trusted=args.trust_ckpt)
    candidates = _candidates(args.precisions, commands, out.resolve(), noise_floor=args.noise_floor)
    snapshots = tuple(first_step + round(args.steps * i / args.snapshots) for i in range(1, args.snapshots))
    for index, candidate in enumerate(candidates):
        print(f"compare [{index + 1}/{len(candidates)}] {candidate.name}: {shlex.join(candidate.command)}", flush=True)
        plan = Plan(
            candidate.name, candidate.precision, args.steps, str(candidate.directory), ckpt, index == 0, first_step,
            snapshots, str(candidates[0].directory), perturb=candidate.role == NOISE_FLOOR,
            grad_norm_every=args.grad_norm_every,
        )  # fmt: skip
        candidate.returncode = _run(candidate, plan)
        stop = stop_after_baseline(candidate, args.metric) if index == 0 else None
        if stop is not None:
            print(f"compare: {stop}: no other run is started", flush=True)
            candidates = candidates[:1]
            break
    report = compare_report.build(candidates, args.tolerance, steps=args.steps, argv=argv, metrics=args.metric)
    print(terminal.render(report))
    return compare_report.write(report, out)


def _check_precision(name: str, command_line: argparse.ArgumentParser) -> None:
    """Refuse, before any run starts, a precision no run could start with (exit 2, the nearest name suggested, as the
    Trainer does)."""
    try:
        check_precision(
            name, _lightning.precision_values(), field="PRECISION", unknown="not a precision compare can run"
        )
    except PrecisionConfigurationError as error:
        command_line.error(str(error))


def _refuse_command_without_separator(options: list[str], command_line: argparse.ArgumentParser) -> None:
    """A training command given without ``--`` in front: say where it starts and how to write it."""
    valued = {"--out", "--ckpt", "--steps", "--tolerance", "--metric", "--snapshots", "--grad-norm-every"}
    for index, word in enumerate(options):
        if index and options[index - 1] in valued:
            continue  # an option's value, such as a path
        if word.endswith(".py") or "/" in word or word.split("/")[-1] in LAUNCHERS or word.startswith("python"):
            before, after = shlex.join(options[:index]), shlex.join(options[index:])
            command_line.error(
                f"command={after!r}: the training command must come after `--`, or compare reads it as its own"
                f" arguments. Fix: lightning-ddp-amp compare {before} -- {after}"
            )


def _split_commands(argv: list[str]) -> tuple[list[str], list[list[str]]]:
    """The options before the first ``--``, and each command after a ``--``."""
    if "--" not in argv:
        return argv, []
    first = argv.index("--")
    commands: list[list[str]] = [[]]
    for word in argv[first + 1 :]:
        if word == "--":
            commands.append([])
        else:
            commands[-1].append(word)
    return argv[:first], commands


def _candidates(
    precisions: list[str], commands: list[list[str]], out: Path, *, noise_floor: bool = False
) -> list[Candidate]:
    """One candidate per precision, the baseline first; with ``noise_floor``, the baseline's second run after it."""
    runs = [
        (precision, commands[index] if len(commands) > 1 else commands[0]) for index, precision in enumerate(precisions)
    ]
    roles: list[Role] = [BASELINE, *[CANDIDATE] * (len(runs) - 1)]
    if noise_floor:
        runs.insert(1, runs[0])
        roles.insert(1, NOISE_FLOOR)
    candidates: list[Candidate] = []
    for index, ((precision, command), role) in enumerate(zip(runs, roles, strict=True)):
        repeat = [c.precision for c in candidates if c.role != NOISE_FLOOR].count(precision)
        name = f"{precision}~noise" if role == NOISE_FLOOR else precision if not repeat else f"{precision}#{repeat + 1}"
        folder = out / f"{index + 1}-{re.sub(r'[^A-Za-z0-9._~-]+', '_', name)}"
        candidates.append(Candidate(name=name, precision=precision, command=command, directory=folder, role=role))
    return candidates


def _saved_step(ckpt: str, command_line: argparse.ArgumentParser, *, trusted: bool) -> int:
    """The global step a checkpoint was saved at (memory-mapped: only that entry is read), running none of the file's
    code unless ``trusted`` (:mod:`lightning_ddp_amp.safe_load`)."""
    from lightning_ddp_amp.safe_load import load_checkpoint

    try:
        checkpoint = load_checkpoint(ckpt, field="--ckpt", opt_in="pass --trust-ckpt", trusted=trusted, mmap=True)
    except CheckpointError as refused:
        command_line.error(str(refused))
    except Exception as error:
        command_line.error(
            f"--ckpt={ckpt!r}: torch.load cannot read it ({type(error).__name__}: {error}). Fix: pass a checkpoint a Trainer saved"
        )
    return int(checkpoint.get("global_step", 0))


def _run(candidate: Candidate, plan: Plan) -> int:
    """Run the candidate's command with the compare site first on PYTHONPATH; returns its exit status."""
    candidate.directory.mkdir(parents=True)
    plan_file = candidate.directory / PLAN_FILE
    plan.write(plan_file)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    env[PLAN_VARIABLE] = str(plan_file)
    env.setdefault("PYTHONUNBUFFERED", "1")  # piped, Python would hold the run's lines back in blocks
    with (
        (candidate.directory / OUTPUT_FILES[0]).open("wb") as out,
        (candidate.directory / OUTPUT_FILES[1]).open("wb") as err,
    ):
        try:
            process = subprocess.Popen(candidate.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as error:
            candidate.error = f"{type(error).__name__}: {error}"
            return 127
        assert process.stdout is not None and process.stderr is not None
        copies = [
            threading.Thread(target=_tee, args=(process.stdout, sys.stdout, out), daemon=True),
            threading.Thread(target=_tee, args=(process.stderr, sys.stderr, err), daemon=True),
        ]
        for copy in copies:
            copy.start()
        try:
            returncode = process.wait()
        except BaseException:  # Ctrl-C: as subprocess.run, the run does not outlive compare
            process.kill()
            process.wait()
            raise
        finally:
            for copy in copies:
                copy.join()
    run_folder.merge_rank_records(candidate.directory)  # a Fabric run's ranks each wrote their own record
    return returncode


def _tee(source: IO[bytes], terminal: TextIO, kept: IO[bytes]) -> None:
    """Copy a run's output to the terminal as it comes, and into its folder."""
    for chunk in iter(lambda: source.read1(65536), b""):  # type: ignore[attr-defined]
        kept.write(chunk)
        kept.flush()
        buffer = getattr(terminal, "buffer", None)
        if buffer is not None:
            buffer.write(chunk)
            buffer.flush()
        else:
            terminal.write(chunk.decode(errors="replace"))
            terminal.flush()
