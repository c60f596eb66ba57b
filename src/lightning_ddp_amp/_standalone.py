"""``import lightning_ddp_amp`` also serves the standalone ``pytorch_lightning``, once that is imported.

``lightning_ddp_amp.pytorch_lightning`` is the package for ``pytorch_lightning`` / ``lightning_fabric``: the same
modules with Lightning's imports renamed, written when the package is built (``build_backend/``). Importing it
registers ``"envddp"`` and the precision strings with the standalone Trainer and Fabric. :func:`install` arranges
that at once when ``pytorch_lightning`` is already imported, otherwise right after it is (a one-shot import hook that
only wraps ``pytorch_lightning``'s own loader), so users of ``lightning`` alone never pay for importing it (about
0.15 s and some memory). A failure there is a warning: it never breaks ``import pytorch_lightning``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

#: The package for the standalone ``pytorch_lightning``.
FLAVOUR = "lightning_ddp_amp.pytorch_lightning"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers the ``pytorch_lightning`` flavour right after ``pytorch_lightning`` itself is imported.

    It only wraps the loader of the spec the other finders return; it stays in place until that loader has
    actually run, so a mere ``importlib.util.find_spec("pytorch_lightning")`` (an availability check) changes
    nothing.
    """

    def __init__(self) -> None:
        self._finding = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "pytorch_lightning" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _ThenRegister):
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """Runs the real loader, puts it back on the module, then imports the ``pytorch_lightning`` flavour."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> object:
        return getattr(self.loader, name)  # get_data, get_resource_reader, ... for whoever holds the spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        sys.meta_path[:] = [finder for finder in sys.meta_path if not _is(finder, _AfterImport)]
        _register()


def _register() -> None:
    """Import the ``pytorch_lightning`` flavour; a failure is a warning, never a broken ``import pytorch_lightning``."""
    try:
        importlib.import_module(FLAVOUR)
    except Exception as error:
        warnings.warn(
            f"lightning_ddp_amp could not set itself up for pytorch_lightning"
            f" {getattr(sys.modules.get('pytorch_lightning'), '__version__', '?')} ({type(error).__name__}: {error});"
            ' pytorch_lightning.Trainer will not know strategy="envddp" or the "apex-O*" / "amp-O*" precision values.'
            " Install a pytorch-lightning release between 2.5 and 2.6 and lightning-ddp-amp as a package (pip install,"
            " which writes lightning_ddp_amp/pytorch_lightning/), or use `import lightning`.",
            stacklevel=2,
        )


def _is(finder: object, kind: type) -> bool:
    # By name, not isinstance: a reloaded _standalone must recognise the finders the previous one installed.
    return type(finder).__qualname__ == kind.__qualname__ and type(finder).__module__ == kind.__module__


def install() -> None:
    """Register ``lightning_ddp_amp.pytorch_lightning`` with ``pytorch_lightning``: now, or once it is imported."""
    if "pytorch_lightning" in sys.modules:
        _register()
    elif not any(_is(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
