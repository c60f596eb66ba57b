"""What rank 0 says about the package's decisions: once per process, however many Trainers (or fits) make them."""

from __future__ import annotations

from lightning_utilities.core.rank_zero import WarningCache

#: Every decision said so far, in Lightning's own once-only cache. This module imports neither Lightning flavour, so
#: ``lightning``'s Trainers and ``pytorch_lightning``'s share it: a process says each decision once.
_SAID = WarningCache()


def log_once(message: str, warn: bool = False) -> None:
    """Lightning's ``rank_zero_info`` (or ``rank_zero_warn``) once per process: several Trainers hear a decision once.

    Both flavours' ``rank_zero_info`` is ``lightning_utilities``' own, logging to the logger Lightning gave it.
    """
    (_SAID.warn if warn else _SAID.info)(message)
