# Generated from ../native_amp.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""Moved to :mod:`lightning_ddp_amp.pytorch_lightning.amp.native_amp`; this old path warns (:mod:`lightning_ddp_amp._moved`)."""

from typing import TYPE_CHECKING

from lightning_ddp_amp._moved import moved

if TYPE_CHECKING:
    from lightning_ddp_amp.pytorch_lightning.amp.native_amp import *  # noqa: F403
