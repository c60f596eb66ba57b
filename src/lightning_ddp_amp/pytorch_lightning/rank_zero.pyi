# Generated from ../rank_zero.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""What rank 0 says about the package's decisions: once per process, however many Trainers (or fits) make them."""

from __future__ import annotations

from lightning_fabric.utilities import rank_zero_info, rank_zero_warn

_LOGGED: set[str] = set()


def log_once(message: str, warn: bool = False) -> None:
    """``rank_zero_info`` (or ``rank_zero_warn``) once per process: several Trainers hear the decision once."""
    ...
