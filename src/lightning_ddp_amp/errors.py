"""The exceptions lightning_ddp_amp raises: one type per kind of mistake.

Every message names the setting that is wrong, the value it had, and what to do instead, in the form
``<field>=<value>: <what is wrong>. Fix: <what to do>``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class LightningDDPAmpError(Exception):
    """Base class of every error this package raises on purpose.

    Args:
        field: The variable, argument or config key that is wrong, e.g. ``"RANK"`` or ``"split_batches"``.
        value: The value it had.
        problem: What is wrong with it, as one sentence.
        fix: What the user should do instead.
    """

    def __init__(self, field: str, value: Any, problem: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}={value!r}: {problem}. Fix: {fix}")


class LauncherEnvironmentError(LightningDDPAmpError, ValueError):
    """A launcher variable (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_PORT, ...) is missing, malformed or out of range."""


class TopologyMismatchError(LightningDDPAmpError, ValueError):
    """A Trainer argument (``devices``, ``num_nodes``), or the process group the script started itself, contradicts
    the topology the launcher set up."""


class StrategyConfigurationError(LightningDDPAmpError, ValueError):
    """An argument of :class:`~lightning_ddp_amp.EnvDDPStrategy` is invalid, alone or with the data it meets."""


class ApexUnavailableError(LightningDDPAmpError, ImportError):
    """NVIDIA apex amp was asked for but cannot run here: not installed, without ``apex.amp``, or without CUDA."""


class PrecisionConfigurationError(LightningDDPAmpError, ValueError):
    """An argument of :class:`~lightning_ddp_amp.AmpPrecision`, or the way it meets the Trainer, is invalid."""


class PeerError(LightningDDPAmpError, RuntimeError):
    """Another rank of the job never arrived, or is gone."""


class CheckpointError(LightningDDPAmpError, RuntimeError):
    """A checkpoint cannot be resumed from: truncated, not a Lightning checkpoint, or written for another job."""


class CompareScriptError(LightningDDPAmpError, RuntimeError):
    """A script run by ``lightning-ddp-amp compare`` trains in a way compare cannot record, e.g. a Fabric loop that
    steps an optimizer without ``fabric.backward``."""


def whole_number(
    error: type[LightningDDPAmpError],
    field: str,
    value: object,
    problem: str,
    fix: str,
    *,
    minimum: int | None = None,
    below: int | None = None,
) -> int:
    """``value``, if it is an ``int`` (a bool is one to Python, never to a user) from ``minimum`` up to ``below``.

    Raises:
        LightningDDPAmpError: ``error(field, value, problem, fix)``, when it is not.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (minimum is not None and value < minimum)
        or (below is not None and value >= below)
    ):
        raise error(field, value, problem, fix)
    return value


def nearest(value: str, names: Iterable[str]) -> str | None:
    """The name in ``names`` that ``value`` was most likely meant to be, for a message's "did you mean ...?"; None
    when none is near.

    Case, ``0`` for ``O`` and ``_`` for ``-`` do not count (``"apex-01"``, ``"AMP-o1"``, ``"apex_O1"`` are as near
    as ``"apex-O1"`` itself; ``"env_ddp"`` is ``"env-ddp"``); the rest is :func:`difflib.get_close_matches`'s call.
    Of two names that differ only so, the first is named.
    """

    def key(name: str) -> str:
        return name.casefold().replace("0", "o").replace("_", "-")

    by_key: dict[str, str] = {}
    for name in names:
        by_key.setdefault(key(name), name)
    found = difflib.get_close_matches(key(value), by_key, n=1)
    return by_key[found[0]] if found else None
