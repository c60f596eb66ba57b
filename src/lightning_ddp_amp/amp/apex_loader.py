"""Finding NVIDIA apex, and saying precisely why it cannot be used when it cannot.

``apex.amp`` exists only in NVIDIA apex releases up to 25.05 (it was removed in May 2025), built from source with
its CUDA extensions. The package called ``apex`` on PyPI is an unrelated web toolkit. The apex amp backend
(:mod:`lightning_ddp_amp.amp.apex_backend`), ``EnvDDPStrategy(ddp_impl="apex")`` and the env report import apex through here.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from lightning_ddp_amp.errors import ApexUnavailableError
from lightning_ddp_amp.versions import installed

NATIVE_ALTERNATIVES = 'use the native backend instead: precision="amp-O1" (same O-levels) or precision="16-mixed"'
APEX_INSTALL = (
    "build NVIDIA apex 25.05 or older from source with its CUDA extensions (pip install -v --no-build-isolation"
    ' --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext"'
    " git+https://github.com/NVIDIA/apex.git@25.05), or " + NATIVE_ALTERNATIVES
)


def missing_cuda() -> str | None:
    """Why this machine has no CUDA for apex amp (a CPU build of torch, or no GPU visible); None when it has."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no GPU"
    return None


def installation() -> dict[str, Any] | None:
    """The apex that ``import apex`` would find, without importing it; None when there is none.

    Returns:
        ``location`` (its folder), ``version`` (its package's; None without package metadata, as for a source
        checkout on the path), ``namespace`` (a folder without ``__init__.py``: not an installed package) and
        ``test_double`` (this repository's CPU stand-in for apex, tests/doubles).
    """
    spec = importlib.util.find_spec("apex")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    version = installed("apex")
    try:
        double = "IS_TEST_DOUBLE = True" in (root / "__init__.py").read_text(errors="replace")
    except OSError:
        double = False
    namespace = spec.origin in (None, "namespace")
    return {"location": str(root), "version": version, "namespace": namespace, "test_double": double}


def find_amp() -> ModuleType | None:
    """``apex.amp`` if it can be imported, else None. Never raises."""
    try:
        return load_apex_module("apex.amp", "backend", "apex")
    except ApexUnavailableError:
        return None


def load_apex_module(name: str, field: str, value: Any) -> ModuleType:
    """Import ``apex.amp`` or ``apex.parallel``, or explain why it cannot be imported.

    Args:
        name: ``"apex.amp"`` or ``"apex.parallel"``.
        field: The setting that asked for apex, for the message (``"backend"``, ``"precision"``, ``"ddp_impl"``).
        value: Its value.

    Raises:
        ApexUnavailableError: apex is not installed, lacks the module, or the module fails to import.
    """
    if importlib.util.find_spec("apex") is None:
        raise ApexUnavailableError(
            field,
            value,
            f"NVIDIA apex is not installed. {name} exists only in NVIDIA apex releases up to 25.05 (it was"
            " removed from apex in May 2025), built from source; it is not on PyPI",
            APEX_INSTALL,
        )
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name not in (name, "apex"):
            _broken(name, field, value, error)
        raise ApexUnavailableError(
            field,
            value,
            f"the installed apex ({_apex_version()}) has no {name}: NVIDIA removed it after release 25.05, and"
            " the 'apex' package on PyPI is an unrelated web toolkit",
            APEX_INSTALL,
        ) from None
    except Exception as error:  # apex imports its compiled extensions: any failure there lands here
        _broken(name, field, value, error)


def _broken(name: str, field: str, value: Any, error: Exception) -> NoReturn:
    raise ApexUnavailableError(
        field,
        value,
        f"{name} fails to import ({error}); apex's compiled extensions were probably built for another torch or CUDA",
        "rebuild apex from source against the installed torch, or " + NATIVE_ALTERNATIVES,
    ) from error


def _apex_version() -> str:
    version = installed("apex")
    return "apex, version unknown" if version is None else f"apex {version}"
