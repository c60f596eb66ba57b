"""The installed version of a distribution, the one lookup behind ``env``, ``--version`` and ``compare.json``."""

from __future__ import annotations

import importlib.metadata


def installed(name: str) -> str | None:
    """The installed version of the distribution ``name``, or None when it is not installed.

    Args:
        name: Its name as ``env --json`` and ``compare.json`` key it (``"pytorch_lightning"``, ``"lightning_ddp_amp"``);
            importlib.metadata reads ``-`` and ``_`` alike, so it is also the name pip knows.
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
