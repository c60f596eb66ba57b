# Generated from ../compare_report.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""Moved to :mod:`lightning_ddp_amp.pytorch_lightning.compare.report`; this old path warns (:mod:`lightning_ddp_amp._moved`)."""

from typing import TYPE_CHECKING

from lightning_ddp_amp._moved import moved

if TYPE_CHECKING:
    from lightning_ddp_amp.pytorch_lightning.compare.report import *  # noqa: F403
