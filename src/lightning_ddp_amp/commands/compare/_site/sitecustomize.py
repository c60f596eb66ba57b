"""Python runs this at start-up in every process of a ``lightning-ddp-amp compare`` run (agents and ranks alike).

It imports nothing heavy: it waits for the script to import ``lightning``, ``pytorch_lightning`` or
``lightning_fabric``, leaves a ``doors/imported-{namespace}`` marker in the run's folder (what the script got to, for
a run that ends without a record: :mod:`lightning_ddp_amp.commands.compare.doors`), then has
:mod:`lightning_ddp_amp.commands.compare.patching` patch that namespace's Trainer and Fabric, so the script runs
unchanged. An uncaught exception is written to the run's folder, so that the report can name it. Any ``sitecustomize`` this
folder shadows (a virtualenv's, a distribution's) runs afterwards, as it would have without compare.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from types import ModuleType, TracebackType

#: Names the plan file of the run; compare sets it, and nothing here is active without it. It and the ``errors``
#: folder are :mod:`lightning_ddp_amp.commands.compare.run_folder`'s names, written again: this file imports nothing of the package.
PLAN_VARIABLE = "LIGHTNING_DDP_AMP_COMPARE"
_HERE = os.path.dirname(os.path.abspath(__file__))
#: :mod:`lightning_ddp_amp.commands.compare.doors`' names, written again.
_NAMESPACES = ("lightning", "pytorch_lightning", "lightning_fabric")
_DOORS = "doors"


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Wraps the loader of each of :data:`_NAMESPACES` so that its Trainer and Fabric are patched once imported.

    The same shape as ``_standalone._AfterImport``, written again: this file runs before the package may be imported
    (importing it imports Lightning), so it can import nothing of the package's.
    """

    def __init__(self) -> None:
        self._finding = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _NAMESPACES or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _ThenPatch):
            spec.loader = _ThenPatch(spec.loader)
        return spec


class _ThenPatch(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> object:
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        global _patching
        plan_file = os.environ[PLAN_VARIABLE]
        if not _patching:
            _mark_imported(os.path.dirname(plan_file), module.__name__)
        if module.__name__ == "lightning_fabric" and "pytorch_lightning" in sys.modules:
            return  # pytorch_lightning is importing it, and patches its Fabric once imported itself
        outer, _patching = _patching, True
        try:
            from lightning_ddp_amp.commands.compare import patching

            patching.patch(module.__name__, plan_file)
        finally:
            _patching = outer


#: True while a patch runs: what it imports itself (the package imports ``lightning``; ``lightning_fabric``'s flavour,
#: ``pytorch_lightning``) is patched too, but is no import of the script's.
_patching = False


def _mark_imported(folder: str, namespace: str) -> None:
    """Leave ``doors/imported-{namespace}`` in the run's folder."""
    os.makedirs(os.path.join(folder, _DOORS), exist_ok=True)
    with open(os.path.join(folder, _DOORS, f"imported-{namespace}"), "a"):
        pass


def _record_uncaught(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
    """Write the error beside the run's plan, then hand it to the hook that was there before."""
    try:
        folder = os.path.join(os.path.dirname(os.environ[PLAN_VARIABLE]), "errors")
        os.makedirs(folder, exist_ok=True)
        rank = os.environ.get("RANK")
        name = f"rank{rank}.json" if rank is not None else f"process{os.getpid()}.json"
        with open(os.path.join(folder, name), "w") as file:
            json.dump({"rank": rank, "type": kind.__name__, "message": str(error)}, file)
    finally:
        _previous_hook(kind, error, trace)


def _run_shadowed_sitecustomize() -> None:
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_previous_hook = sys.excepthook
if os.environ.get(PLAN_VARIABLE):
    sys.meta_path.insert(0, _AfterLightning())
    sys.excepthook = _record_uncaught
_run_shadowed_sitecustomize()
