# Generated from ../../compare/report.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""The report of ``lightning-ddp-amp compare``: are the runs comparable, and how far is each from the baseline.

Definitions (``docs/compare.md`` explains how to read them):

* The loss of a step is the mean over ranks of what each rank gave to backward since its previous step.
* The *relative loss difference* of a step is ``|loss - baseline loss| / |baseline loss|``, over the steps both
  runs took. The *final loss* is the mean over the last tenth of those steps (at least one).
* The *weight distance* is ``‖w - w_baseline‖ / ‖w_baseline - w_start‖``: how far the candidate's final weights are
  from the baseline's, as a fraction of how far the baseline moved from the common start. It is 1 for a candidate
  that never moved (every step skipped), and about 0.1 for the same precision at a learning rate 10% off. Per
  submodule (the module that holds each parameter) the same ratio uses that submodule's own weights.
* A candidate is **close** when its final loss is within the loss tolerance of the baseline's and its weight
  distance within the weight tolerance; otherwise **apart**, with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_ddp_amp.pytorch_lightning import doctor
from lightning_ddp_amp.compare.recorder import FINAL_WEIGHTS, RECORD_FILE, START_WEIGHTS

#: The ``schema`` value of ``compare.json`` (documented in ``docs/compare.md`` and ``docs/compare.schema.json``).
SCHEMA = "lightning-ddp-amp/compare/1"
JSON_FILE = "compare.json"
PNG_FILE = "compare.png"
#: The panels of ``compare.png``, in order, with the series each plots.
PANELS = (
    ("Loss", "loss"),
    ("Relative loss difference to the baseline", "relative_loss_difference"),
    ("Loss scale (x: skipped step)", "loss_scale"),
    ("Step time (s)", "step_time_s"),
)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Beyond these a candidate is apart: the relative final-loss difference, and the relative weight distance.

    The defaults were measured on ``examples/two_models_one_optimizer.py`` (``docs/compare.md``): ``apex-O1`` against
    ``amp-O1`` differ by a fraction of these, the same precision at a learning rate 10% off by several times them.
    """

    loss: float = 0.02
    weights: float = 0.05

    @classmethod
    def parse(cls, text: str) -> Tolerance:
        """``"0.05"`` (both) or ``"0.02,0.05"`` (loss, weights); an argparse ``type``."""
        ...


@dataclasses.dataclass
class Candidate:
    """One precision's run: what ran, and how it ended."""

    name: str
    precision: str
    command: list[str]
    directory: Path
    returncode: int | None = None
    error: str | None = None

    _record: dict[str, Any] | None = dataclasses.field(default=None, init=False, repr=False)

    def record(self) -> dict[str, Any] | None:
        """The run's ``record.json``, read once the run has ended."""
        ...

    def failure(self) -> str | None:
        """Why the run failed, preferring the error a rank raised; None when it finished with a record.

        Error files count only for a run that failed: a helper process of a good run may have raised one.
        """
        ...


def build(candidates: list[Candidate], tolerance: Tolerance, *, steps: int, argv: list[str]) -> dict[str, Any]:
    """The report as ``compare.json`` holds it."""
    ...


def _entry(candidate: Candidate) -> dict[str, Any]:
    ...


def _incomparable(candidates: list[Candidate], records: list[dict[str, Any] | None]) -> str | None:
    """What makes the recorded runs unlike the baseline's, with the fix; None when they all started alike."""
    ...


def _summary(
    series: dict[str, Any],
    base: dict[str, Any],
    weights: dict[str, torch.Tensor],
    base_weights: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
    base_entry: dict[str, Any],
    entry_memory: int,
) -> dict[str, Any]:
    ...


def _verdict(summary: dict[str, Any], tolerance: Tolerance) -> tuple[str, str]:
    ...


def _first_apart(entry: dict[str, Any], tolerance: Tolerance) -> int | None:
    ...


def _submodule_distances(
    weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> list[dict[str, Any]]:
    ...


def _distance(
    names: list[str], weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> float | None:
    ...


def _relative(value: float | None, reference: float | None) -> float | None:
    ...


def _ratio(value: float, reference: float) -> float | None:
    ...


def _mean(values: list[float]) -> float:
    ...


def _order(value: float | None) -> float:
    ...


def _percent(value: float | None) -> str:
    ...


def _versions() -> dict[str, str | None]:
    ...


def _apex() -> dict[str, Any] | None:
    """The apex the runs import: where, its version (``"unknown"`` for a build without package metadata, as a
    source checkout on the path), and whether it is this repository's CPU test double; None without apex."""
    ...


def render(report: dict[str, Any]) -> str:
    """The terminal table: one column per candidate, the baseline first, then each verdict with its reason."""
    ...


def _steps(entry: dict[str, Any]) -> str:
    ...


def _skips(steps: list[int]) -> str:
    ...


def write(report: dict[str, Any], out: Path) -> int:
    """Write ``compare.json`` and, with matplotlib, ``compare.png``; returns the exit status of ``compare``."""
    ...


def _finite(value: Any) -> Any:
    """JSON has no inf or NaN: a value that is not finite is written as null."""
    ...


def plot(report: dict[str, Any], path: Path) -> Any:
    """Draw the four panels of :data:`PANELS` into ``path``; returns the figure, or None without matplotlib."""
    ...
