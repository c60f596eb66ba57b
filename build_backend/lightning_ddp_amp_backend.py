"""The package's build backend (pyproject.toml): setuptools', after writing the ``pytorch_lightning`` flavour.

``pytorch_lightning_flavour.py`` says what the flavour is and why it is written at build time.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning_flavour import write_flavour
from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401  (the hooks this backend leaves to setuptools)
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)


def build_wheel(
    wheel_directory: str, config_settings: dict[str, Any] | None = None, metadata_directory: str | None = None
) -> str:
    write_flavour()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(
    wheel_directory: str, config_settings: dict[str, Any] | None = None, metadata_directory: str | None = None
) -> str:
    write_flavour()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    write_flavour()
    return _setuptools.build_sdist(sdist_directory, config_settings)
