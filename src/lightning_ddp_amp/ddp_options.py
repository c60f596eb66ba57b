"""Moved to :mod:`lightning_ddp_amp.ddp.ddp_options`; this old path warns (:mod:`lightning_ddp_amp._moved`)."""

from typing import TYPE_CHECKING

from lightning_ddp_amp._moved import moved

if TYPE_CHECKING:
    from lightning_ddp_amp.ddp.ddp_options import *  # noqa: F403

moved(__name__, "lightning_ddp_amp.ddp.ddp_options")
