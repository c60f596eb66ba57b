"""How close is close: ``--tolerance`` and ``--metric``, the limits a candidate's verdict holds it to."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re


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
        parts = text.split(",")
        try:
            values = [float(part) for part in parts]
        except ValueError:
            values = []
        if len(values) not in (1, 2) or not all(math.isfinite(v) and v > 0 for v in values):
            raise argparse.ArgumentTypeError(
                f"--tolerance={text!r}: expected one or two positive numbers. Fix: e.g. --tolerance 0.05 (both) or"
                " --tolerance 0.02,0.05 (final loss, weights)"
            )
        return cls(values[0], values[-1])


@dataclasses.dataclass(frozen=True)
class Metric:
    """``--metric NAME[:TOL]``: a metric the script logs in validation or test, which must be close for a candidate to
    be close. ``TOL`` is the largest difference from the baseline's value (``0.005``) or, ending in ``%``, relative to
    it (``1%``); without it, the loss tolerance's default, relative."""

    name: str
    absolute: float | None = None
    relative: float = Tolerance().loss

    @classmethod
    def parse(cls, text: str) -> Metric:
        """An argparse ``type``."""
        name, separator, tolerance = text.partition(":")
        fix = "Fix: e.g. --metric val_acc (within 2% of the baseline's), val_acc:0.005 or val_acc:1%"
        if not re.fullmatch(r"[^\s:]+", name):
            raise argparse.ArgumentTypeError(f"--metric={text!r}: no metric name before the ':'. {fix}")
        if not separator:
            return cls(name)
        try:
            value = float(tolerance[:-1]) / 100 if tolerance.endswith("%") else float(tolerance)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(
                f"--metric={text!r}: the tolerance {tolerance!r} is not a number of 0 or more. {fix}"
            )
        return cls(name, None, value) if tolerance.endswith("%") else cls(name, value)

    def tolerance_text(self) -> str:
        return f"{self.absolute:g}" if self.absolute is not None else f"{100 * self.relative:g}%"

    def within(self, value: float, baseline: float) -> bool:
        limit = self.absolute if self.absolute is not None else self.relative * abs(baseline)
        return math.isfinite(value) and abs(value - baseline) <= limit
