# Generated from ../../compare/__init__.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""``lightning-ddp-amp compare``: one training command under several precisions, and how far apart they land.

::

    lightning-ddp-amp compare apex-O1 amp-O1 bf16-mixed -- python train.py --lr 0.1
    lightning-ddp-amp compare apex-O1 amp-O1 -- torchrun --nproc-per-node=8 train.py
    lightning-ddp-amp compare 32-true 32-true -- python train.py --lr 0.1 -- python train.py --lr 0.11

Each precision is a candidate; the first is the baseline. A precision is any ``Trainer(precision=...)`` value
(``apex-O1``, ``amp-O1``, ``16-mixed``, ``bf16-mixed``, ``32-true``, ...) or, for compare only, ``native-O0`` …
``native-O3``: torch's own AMP at that apex level even where apex is installed (where ``amp-O*`` runs apex). The candidates run one after the other, each as the
user's own command, unchanged: the script need not import this package. What changes inside each run, and what it
records, is :mod:`lightning_ddp_amp.compare.recorder`'s. One command serves every candidate; with as many commands as
candidates (each after its own ``--``), candidate *i* runs command *i*.

Afterwards :mod:`lightning_ddp_amp.pytorch_lightning.compare.report` checks that the runs are comparable, and reports each candidate
against the baseline: on the terminal, in ``DIR/compare.json`` and, with matplotlib, in ``DIR/compare.png``.

Exit status: 0 when every candidate is close to the baseline; 1 when one is apart or failed; 2 when nothing could
be compared (a usage error, a baseline that failed, or runs that did not start alike).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TextIO

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.pytorch_lightning.compare import report as compare_report
from lightning_ddp_amp.compare.recorder import AMP_LEVEL, PLAN_VARIABLE, Plan
from lightning_ddp_amp.pytorch_lightning.compare.report import Candidate, Tolerance

#: ``--steps``: enough for a loss curve to settle into its trend on most models, short enough to run before a switch.
DEFAULT_STEPS = 200
#: Programs that start a training command, recognised when one is given without ``--``.
LAUNCHERS = ("python", "python3", "torchrun", "srun", "mpirun", "accelerate", "deepspeed", "lightning")
#: Each run's own output, kept in its folder (and shown as it comes): its standard output and error.
OUTPUT_FILES = ("stdout.log", "stderr.log")
#: Where ``sitecustomize`` waits for the script's Lightning import.
SITE = Path(__file__).parent / "_site"


#: ``compare --help``'s closing text: examples, the precisions, the exit statuses.
EPILOG = """Then `--` and the training command, as you run it (python, torchrun, python -m, a LightningCLI script);
several commands, each after its own `--`, one per precision.

examples:
  lightning-ddp-amp compare apex-O1 native-O1 -- torchrun --nproc-per-node=8 train.py
  lightning-ddp-amp compare 32-true native-O1 bf16-mixed --steps 100 -- python train.py --lr 0.1
  lightning-ddp-amp compare 32-true 32-true -- python train.py --lr 0.1 -- python train.py --lr 0.11

precisions:
  apex-O0 ... apex-O3      NVIDIA apex amp at that opt_level
  amp-O0 ... amp-O3        apex where it can run, else torch's AMP at that level
  native-O0 ... native-O3  torch's AMP at that level, even where apex is installed
  any Trainer precision    32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, 64-true, ...

exit status:
  0  every candidate is close to the baseline
  1  a candidate is apart, or failed
  2  nothing was compared: a usage error, a baseline that failed, or runs that did not start alike"""


def parser() -> argparse.ArgumentParser:
    ...


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-ddp-amp compare ...``; returns the exit status (see the module docstring)."""
    ...


def _check_precision(name: str, command_line: argparse.ArgumentParser) -> None:
    """Refuse, before any run starts, a precision no run could start with (exit 2, the nearest name suggested)."""
    ...


def _refuse_command_without_separator(options: list[str], command_line: argparse.ArgumentParser) -> None:
    """A training command given without ``--`` in front: say where it starts and how to write it."""
    ...


def _split_commands(argv: list[str]) -> tuple[list[str], list[list[str]]]:
    """The options before the first ``--``, and each command after a ``--``."""
    ...


def _candidates(precisions: list[str], commands: list[list[str]], out: Path) -> list[Candidate]:
    ...


def _saved_step(ckpt: str, command_line: argparse.ArgumentParser) -> int:
    """The global step a checkpoint was saved at (memory-mapped: only that entry is read)."""
    ...


def _run(candidate: Candidate, plan: Plan) -> int:
    """Run the candidate's command with the compare site first on PYTHONPATH; returns its exit status."""
    ...


def _tee(source: IO[bytes], terminal: TextIO, kept: IO[bytes]) -> None:
    """Copy a run's output to the terminal as it comes, and into its folder."""
    ...
