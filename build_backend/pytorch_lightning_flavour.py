"""The ``pytorch_lightning`` flavour of the package, written from its sources when it is built (``lightning_ddp_amp_backend.py``).

Lightning is published twice: as ``lightning.pytorch`` / ``lightning.fabric`` inside the ``lightning`` package, and
as the standalone ``pytorch_lightning`` / ``lightning_fabric``, with separate class hierarchies and separate strategy
registries; a strategy must derive from the ``DDPStrategy`` of the Trainer it is given to. Lightning's release tooling
writes the standalone packages from the one source with the imports renamed (``.actions/assistant.py``); this does
the same for this package: ``src/lightning_ddp_amp/pytorch_lightning/`` is written from the package's own modules,
``lightning.pytorch`` renamed ``pytorch_lightning`` and ``lightning.fabric`` renamed ``lightning_fabric``, before
setuptools builds a wheel, an sdist or an editable install (``lightning_ddp_amp_backend.py``). Nothing is rewritten at import, and nothing generated is
versioned (the folder is git-ignored); the flavour's modules are real files, which type checkers read.

Only the modules that import Lightning, directly or through one another, get a copy; the others (errors, the
launcher environment, the AMP backends, the SIGTERM watcher, ``rank_zero``'s once-only cache) are shared, so one
``except LauncherEnvironmentError`` catches both flavours' errors and process-wide state exists once. A subpackage of
the flavour holds only the copied modules. Every rewrite keeps the line count, so a traceback's line is the source's.

By hand (``tests/conftest.py`` does it before every test session, so that tests never run a stale copy)::

    python build_backend/pytorch_lightning_flavour.py
"""

from __future__ import annotations

import ast
import os
import re
import sys
import tempfile
from pathlib import Path

PACKAGE = "lightning_ddp_amp"
#: Where the ``pytorch_lightning`` flavour lives, as a module.
FLAVOUR = f"{PACKAGE}.pytorch_lightning"
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE
#: Modules never copied: the entry points and the hook that imports the flavour. Relative to the package.
NEVER = frozenset({"__main__", "commands.main", "_standalone"})
#: The public classes of the copied modules, as messages and docs name them (``lightning_ddp_amp.AmpPrecision``).
PUBLIC_CLASSES = ("EnvDDPStrategy", "AmpPrecision", "LauncherEnvironment")
_HEADER = "# Generated from {source} by build_backend/pytorch_lightning_flavour.py; edit that file, never this one.\n"


def modules(source: Path = SOURCE) -> dict[str, Path]:
    """The package's modules (``__init__`` for the package itself, not its subpackages'), by relative name."""
    found = {}
    for path in sorted(source.rglob("*.py")):
        parts = path.relative_to(source).with_suffix("").parts
        if parts[0] != "pytorch_lightning" and (len(parts) == 1 or parts[-1] != "__init__"):
            found[".".join(parts)] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (``from package import module`` counts as the module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def copied_modules(source: Path = SOURCE) -> frozenset[str]:
    """The modules that import Lightning, directly or through one another ("trainer.strategy")."""
    imported = {name: imports(path) for name, path in modules(source).items() if name not in NEVER | {"__init__"}}
    found = {name for name, names in imported.items() if any(m.split(".")[0] == "lightning" for m in names)}
    while more := {
        name
        for name, names in imported.items()
        if name not in found and any(m.removeprefix(PACKAGE + ".") in found for m in names)
    }:
        found |= more
    return frozenset(found)


def copied_packages(copied: frozenset[str]) -> frozenset[str]:
    """The flavour's subpackages: those holding a copied module ("trainer", "commands.compare", ...)."""
    return frozenset(module.rsplit(".", depth)[0] for module in copied for depth in range(1, module.count(".") + 1))


def rewrite(text: str, copied: frozenset[str]) -> str:
    """``text``, a module of the package, as it reads in the ``pytorch_lightning`` flavour. Line numbers are kept.

    Dotted names are renamed wherever they appear (code, messages, docstrings), as Lightning's tooling does; the
    statements ``from lightning_ddp_amp[.subpackage] import a, b`` and ``import lightning`` are rewritten from their
    syntax tree, so that their form (parentheses, several lines) does not matter.
    """
    packages = copied_packages(copied)
    text = re.sub(r"\blightning\.pytorch\b", "pytorch_lightning", text)
    text = re.sub(r"\blightning\.fabric\b", "lightning_fabric", text)
    renamed = "|".join(re.escape(name) for name in sorted(copied | set(PUBLIC_CLASSES), key=len, reverse=True))
    text = re.sub(rf"\b{PACKAGE}\.({renamed})\b", rf"{FLAVOUR}.\1", text)
    lines = text.splitlines(keepends=True)
    for node in sorted(_import_statements(text), key=lambda node: node.lineno, reverse=True):
        replacement = _statement(node, copied, packages)
        if replacement is None:
            continue
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        # The offsets count UTF-8 bytes.
        before = lines[first].encode()[: node.col_offset].decode()
        after = lines[last].encode()[node.end_col_offset :].decode()
        # One line, then as many empty ones as the statement spanned more: the lines below keep their numbers.
        lines[first : last + 1] = [before + replacement + after] + ["\n"] * (last - first)
    return "".join(lines)


def _import_statements(text: str) -> list[ast.Import | ast.ImportFrom]:
    return [node for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _statement(node: ast.Import | ast.ImportFrom, copied: frozenset[str], packages: frozenset[str]) -> str | None:
    """``node`` rewritten for the flavour, on one line; None when it stays as it is."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        if names == ["lightning"] and node.names[0].asname is None:
            return "import pytorch_lightning as lightning"
        if names == [PACKAGE] and node.names[0].asname is None:
            return f"import {FLAVOUR}"  # binds lightning_ddp_amp, and registers the flavour
        return None
    if node.level or node.module is None or not (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
        return None
    subpackage = node.module.removeprefix(PACKAGE).removeprefix(".")
    if subpackage and subpackage not in packages:
        return None  # a shared subpackage, or a copied module (already renamed)
    prefix = f"{subpackage}." if subpackage else ""
    in_flavour = copied | packages | (set() if subpackage else set(PUBLIC_CLASSES))
    names = [alias.name + (f" as {alias.asname}" if alias.asname else "") for alias in node.names]
    flavoured = [name for alias, name in zip(node.names, names, strict=True) if prefix + alias.name in in_flavour]
    shared = [name for name in names if name not in flavoured]
    if not flavoured:
        return None
    module = f".{subpackage}" if subpackage else ""
    statements = [f"from {FLAVOUR}{module} import {', '.join(flavoured)}"]
    statements += [f"from {PACKAGE}{module} import {', '.join(shared)}"] if shared else []
    return "; ".join(statements)


def flavour_files(source: Path = SOURCE) -> dict[Path, str]:
    """What :func:`write_flavour` writes, by path: each copied module and subpackage, and the package's ``__init__``."""
    copied = copied_modules(source)
    target = source / "pytorch_lightning"
    found = {}
    for module in sorted(copied | copied_packages(copied) | {""}):
        path = source.joinpath(*module.split(".")) if module else source
        original = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        written = target / original.relative_to(source)
        back = "../" * (len(written.relative_to(target).parts))
        header = _HEADER.format(source=f"{back}{original.relative_to(source).as_posix()}")
        found[written] = rewrite(original.read_text(), copied) + header
    return found


def write_flavour(source: Path = SOURCE) -> list[Path]:
    """Write ``src/lightning_ddp_amp/pytorch_lightning/`` from the sources; returns the files it changed.

    A file is replaced only when its text changes, atomically, so builds running side by side (``make -j envs``)
    never read half a file; a file no module produces any more is removed (the header at its end says it was
    generated).
    """
    wanted = flavour_files(source)
    target = source / "pytorch_lightning"
    for path in list(target.rglob("*")) if target.exists() else []:
        if path.is_file() and path not in wanted:
            path.unlink(missing_ok=True)
    for folder in sorted((p for p in target.rglob("*") if p.is_dir()), reverse=True) if target.exists() else []:
        if not any(folder.iterdir()):
            folder.rmdir()
    changed = []
    for path, text in wanted.items():
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
        changed.append(path)
    return changed


if __name__ == "__main__":
    written = write_flavour()
    print(f"{FLAVOUR}: {len(written)} file(s) written", file=sys.stderr)
