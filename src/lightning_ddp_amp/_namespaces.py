"""One source, two namespaces: this package for ``lightning``, and the same files for ``pytorch_lightning``.

Lightning is published twice: as ``lightning.pytorch`` / ``lightning.fabric`` inside the ``lightning`` package, and
as the standalone ``pytorch_lightning`` / ``lightning_fabric``, with separate class hierarchies and separate
strategy registries. A strategy must derive from the ``DDPStrategy`` of the Trainer it is given to.

``lightning_ddp_amp.pytorch_lightning`` is therefore built at import time from this package's own source files,
with the rewrite Lightning applies to produce its standalone packages: ``lightning.pytorch`` becomes
``pytorch_lightning`` and ``lightning.fabric`` becomes ``lightning_fabric``. Only the modules that import Lightning
(directly or through another such module) get a second copy; the others (errors, the launcher environment,
devices, the apex loader, the process group, self-launch, the SIGTERM watcher) are shared, so one
``except LauncherEnvironmentError`` catches both, and process-wide state (``preemption.PREEMPTION``: a signal has one
handler) exists once. Every rewrite keeps the line count, so tracebacks point at the real source lines.

``import lightning_ddp_amp`` registers the ``pytorch_lightning`` flavour too: at once when ``pytorch_lightning`` is
already imported, otherwise right after it is (a one-shot import hook), so users of ``lightning`` alone never pay
for importing it (about 0.15 s and some memory). A failure there is a warning: it never breaks
``import pytorch_lightning``.

The flavour mirrors the subpackages: ``lightning_ddp_amp.trainer.strategy`` is copied as
``lightning_ddp_amp.pytorch_lightning.trainer.strategy``; a subpackage of the flavour holds only the copied modules.

Type checkers and IDEs do not run import hooks, so the flavour also exists as type stubs, ``pytorch_lightning/**.pyi``
beside these files: each is :func:`stub` of a copied module, that is, the same rewrite with the function bodies left
out, so every signature and base class is the real one, in ``pytorch_lightning``'s class hierarchy. They are
generated, never edited: :func:`write_stubs` regenerates them, and ``tests/test_namespaces.py`` fails when they differ
from what it would write.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE = "lightning_ddp_amp"
#: Where the ``pytorch_lightning`` flavour lives.
NAMESPACE = f"{PACKAGE}.pytorch_lightning"
_ROOT = Path(__file__).parent
#: The flavour's type stubs: read by type checkers only, the import hook below serves the modules.
STUBS = _ROOT / "pytorch_lightning"
# Modules never copied: the entry points and this module. Names are relative to the package: "trainer.strategy".
_NEVER = {"__init__", "__main__", "commands.main", "_namespaces"}
# The public classes of the copied modules, as named in messages and docs (`lightning_ddp_amp.AmpPrecision`).
_PUBLIC_CLASSES = ("EnvDDPStrategy", "AmpPrecision", "LauncherEnvironment")


def _modules() -> dict[str, Path]:
    """This package's modules (not its subpackages' ``__init__``), by name relative to the package: "trainer.strategy"."""
    found = {}
    for path in sorted(_ROOT.rglob("*.py")):
        parts = path.relative_to(_ROOT).with_suffix("").parts
        if parts[0] != STUBS.name and (len(parts) == 1 or parts[-1] != "__init__"):
            found[".".join(parts)] = path
    return found


def source_file(module: str) -> Path:
    """The source file of ``module``, a copied module or a subpackage of the flavour ("ddp"), relative name."""
    path = _ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


@functools.cache
def namespaced_modules() -> frozenset[str]:
    """The modules of this package that import Lightning, directly or through one another ("trainer.strategy")."""
    imports = {name: _imports(path) for name, path in _modules().items() if name not in _NEVER}
    found = {name for name, imported in imports.items() if any(m.split(".")[0] == "lightning" for m in imported)}
    while True:
        more = {
            name
            for name, imported in imports.items()
            if name not in found and any(m.removeprefix(PACKAGE + ".") in found for m in imported)
        }
        if not more:
            return frozenset(found)
        found |= more


@functools.cache
def namespaced_packages() -> frozenset[str]:
    """The subpackages of the flavour: those that hold a copied module ("ddp", "amp", ...)."""
    return frozenset(
        module.rsplit(".", depth)[0] for module in namespaced_modules() for depth in range(1, module.count(".") + 1)
    )


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (``from package import module`` counts as the module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def rewrite(source: str) -> str:
    """``source`` as it reads in the ``pytorch_lightning`` flavour. Line numbers are kept."""
    source = re.sub(r"\blightning\.pytorch\b", "pytorch_lightning", source)
    source = re.sub(r"\blightning\.fabric\b", "lightning_fabric", source)
    source = re.sub(r"^(\s*)import lightning$", r"\1import pytorch_lightning as lightning", source, flags=re.M)
    copied = "|".join(re.escape(name) for name in sorted(namespaced_modules(), key=len, reverse=True))
    source = re.sub(rf"\b{PACKAGE}\.({copied}|{'|'.join(_PUBLIC_CLASSES)})\b", rf"{NAMESPACE}.\1", source)
    packages = "|".join(re.escape(name) for name in sorted(namespaced_packages(), key=len, reverse=True))
    source = re.sub(
        rf"^([ \t]*)from {PACKAGE}((?:\.(?:{packages}))?) import ([\w ,]+?)([ \t]*(?:#.*)?)$",
        _from_package,
        source,
        flags=re.M,
    )
    return re.sub(rf"^(\s*)import {PACKAGE}(?=\s|$)", rf"\1import {NAMESPACE}", source, flags=re.M)


def _from_package(match: re.Match[str]) -> str:
    """``from lightning_ddp_amp[.subpackage] import ...``: the copied names from the flavour, the shared ones from here."""
    indent, package, names, comment = match.groups()
    listed = [name.strip() for name in names.split(",")]
    prefix = package.removeprefix(".") + "." if package else ""
    flavoured = namespaced_modules() | namespaced_packages() | (set() if package else set(_PUBLIC_CLASSES))
    copied = [name for name in listed if prefix + name.split()[0] in flavoured]
    shared = [name for name in listed if name not in copied]
    statements = [f"from {NAMESPACE}{package} import {', '.join(copied)}"] if copied else []
    statements += [f"from {PACKAGE}{package} import {', '.join(shared)}"] if shared else []
    return indent + "; ".join(statements) + comment  # one line still: tracebacks keep their line numbers


def stub(source: str) -> str:
    """The type stub of ``source`` in the ``pytorch_lightning`` flavour: its rewrite, with only the declarations.

    Function bodies become ``...`` (their docstrings stay, for IDEs) and the module-level statements that only act
    at import (registration, checks) go. The rest is the rewritten text itself, ``# type: ignore`` comments included.
    """
    text = rewrite(source)
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    cuts = [(node.lineno, node.end_lineno or node.lineno, "") for node in tree.body if not _declares(node)]
    for function in _functions(tree.body):
        body = function.body[1:] if ast.get_docstring(function, clean=False) is not None else function.body
        if body:
            # A decorated statement starts at its first decorator.
            first = min([body[0].lineno, *(d.lineno for d in getattr(body[0], "decorator_list", []))])
            cuts.append((first, body[-1].end_lineno or body[-1].lineno, " " * body[0].col_offset + "...\n"))
    for first, last, replacement in sorted(cuts, reverse=True):
        lines[first - 1 : last] = [replacement] if replacement else []
    return re.sub(r"\n{4,}", "\n\n\n", "".join(lines)).rstrip("\n") + "\n"


def _declares(node: ast.stmt) -> bool:
    """Whether ``node``, a module-level statement, belongs in a stub."""
    if isinstance(node, ast.If):
        return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)  # a docstring
    # A module constant, not a patch of another module's attribute.
    if isinstance(node, ast.Assign):
        return all(isinstance(target, ast.Name) for target in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name)
    return isinstance(node, (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))


def _functions(statements: list[ast.stmt]) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions and methods defined by ``statements``, in classes too, but not inside other functions."""
    found: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append(node)
        elif isinstance(node, ast.ClassDef):
            found += _functions(node.body)
    return found


def stubs() -> dict[Path, str]:
    """The flavour's type stubs as :func:`write_stubs` writes them, by path."""
    found = {}
    for module in sorted(namespaced_modules() | namespaced_packages() | {"__init__"}):
        source = source_file(module)
        path = STUBS / source.relative_to(_ROOT).with_suffix(".pyi")
        up = "../" * (len(path.relative_to(STUBS).parts))
        found[path] = (
            f"# Generated from {up}{source.relative_to(_ROOT).as_posix()} by {__name__}.write_stubs(); never edit.\n"
            + stub(source.read_text())
        )
    return found


def write_stubs() -> None:
    """Regenerate the flavour's type stubs from this package's sources, after any change to a copied module."""
    wanted = stubs()
    for path in STUBS.rglob("*.pyi"):
        if path not in wanted:
            path.unlink()  # the module is no longer copied (or no longer exists)
    for folder in sorted(STUBS.rglob("*"), reverse=True):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    for path, text in wanted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


class _Flavour(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``lightning_ddp_amp.pytorch_lightning[.subpackage][.module]`` from this package's files, rewritten."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == NAMESPACE:
            return self._spec(fullname, "__init__", package=True)
        module = fullname.removeprefix(NAMESPACE + ".")
        if module != fullname and module in namespaced_packages():
            return self._spec(fullname, module, package=True)
        if module == fullname or module not in namespaced_modules():
            return None  # shared modules are imported under their own name only
        return self._spec(fullname, module, package=False)

    def _spec(self, fullname: str, module: str, package: bool) -> importlib.machinery.ModuleSpec:
        origin = str(source_file(module))
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=origin, is_package=package)
        spec.has_location = True  # __file__ is the real source file
        if package:
            spec.submodule_search_locations = []  # no directory: every submodule comes from this finder
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        assert module.__spec__ is not None and module.__spec__.origin is not None
        origin = module.__spec__.origin
        exec(compile(rewrite(Path(origin).read_text()), origin, "exec"), module.__dict__)


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
        importlib.import_module(NAMESPACE)
    except Exception as error:
        warnings.warn(
            f"lightning_ddp_amp could not set itself up for pytorch_lightning"
            f" {getattr(sys.modules.get('pytorch_lightning'), '__version__', '?')} ({type(error).__name__}: {error});"
            ' pytorch_lightning.Trainer will not know strategy="envddp" or the "apex-O*" / "amp-O*" precision values.'
            " Install a pytorch-lightning release between 2.5 and 2.6, or use `import lightning`.",
            stacklevel=2,
        )


def _is(finder: object, kind: type) -> bool:
    # By name, not isinstance: a reloaded _namespaces must recognise the finders the previous one installed.
    return type(finder).__qualname__ == kind.__qualname__ and type(finder).__module__ == kind.__module__


def install() -> None:
    """Make ``lightning_ddp_amp.pytorch_lightning`` importable, and register it with ``pytorch_lightning``."""
    if not any(_is(finder, _Flavour) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Flavour())
    if "pytorch_lightning" in sys.modules:
        _register()
    elif not any(_is(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
