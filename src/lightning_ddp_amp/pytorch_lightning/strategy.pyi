# Generated from ../strategy.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""Moved to :mod:`lightning_ddp_amp.pytorch_lightning.ddp.strategy`; this old path warns (:mod:`lightning_ddp_amp._moved`)."""

from typing import TYPE_CHECKING

from lightning_ddp_amp._moved import moved

if TYPE_CHECKING:
    from lightning_ddp_amp.pytorch_lightning.ddp.strategy import *  # noqa: F403
