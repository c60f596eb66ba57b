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


def imports(path: Path, submodules: frozenset[str] = frozenset()) -> set[str]:
    """Every module ``path`` imports, anywhere in it.

    ``from package import module`` counts as the module; the package counts too unless every name it imports is one
    of ``submodules`` (dotted, absolute): ``from lightning_ddp_amp.commands.compare import patching`` imports only
    ``patching``, ``from lightning_ddp_amp import _lightning, AmpPrecision`` imports the package and ``_lightning``.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= names if names <= submodules else names | {node.module}
    return found


def copied_modules(source: Path = SOURCE) -> frozenset[str]:
    """The modules that import Lightning, directly or through one another ("trainer.strategy")."""
    every = modules(source)
    packages = {".".join(path.parent.relative_to(source).parts) for path in source.rglob("__init__.py")} - {""}
    submodules = frozenset(f"{PACKAGE}.{name}" for name in set(every) | packages)
    imported = {name: imports(path, submodules) for name, path in every.items() if name not in NEVER | {"__init__"}}
    found = {name for name, names in imported.items() if any(m.split(".")[0] == "lightning" for m in names)}
    # A package whose module is copied is the flavour's too (``from lightning_ddp_amp import _lightning``).
    while more := {
        name
        for name, names in imported.items()
        if name not in found
        and any(m.removeprefix(PACKAGE + ".") in found | copied_packages(frozenset(found)) for m in names)
    }:
        found |= more
    return frozenset(found)


def copied_packages(copied: frozenset[str]) -> frozenset[str]:
    """The flavour's subpackages: those holding a copied module ("trainer", "commands.compare", ...)."""
    return frozenset(module.rsplit(".", depth)[0] for module in copied for depth in range(1, module.count(".") + 1))


class _Names:
    """Which dotted names of the package belong to the flavour: a copied module, or what a copied package holds."""

    def __init__(self, copied: frozenset[str], source: Path) -> None:
        self.copied = copied
        self.packages = copied_packages(copied)
        packages = {
            ".".join(path.parent.relative_to(source).parts)
            for path in source.rglob("__init__.py")
            if path.relative_to(source).parts[0] != "pytorch_lightning"
        }
        self.known = (set(modules(source)) | packages) - {"__init__", ""}

    def flavoured(self, dotted: str) -> bool:
        """Whether ``lightning_ddp_amp.<dotted>`` names something of the flavour (a module, a package, or a name in one).

        The longest prefix of ``dotted`` that is a module or package of the source decides: a copied module or package
        is the flavour's; a name of the package itself is only when it is one of :data:`PUBLIC_CLASSES`.
        """
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            prefix = ".".join(parts[:end])
            if prefix in self.known:
                return prefix in self.copied or prefix in self.packages
        return parts[0] in PUBLIC_CLASSES


def rewrite(text: str, copied: frozenset[str], source: Path = SOURCE) -> str:
    """``text``, a module of the package, as it reads in the ``pytorch_lightning`` flavour. Line numbers are kept.

    Import statements are rewritten from their syntax tree, so that their form (parentheses, several lines, ``as``)
    does not matter: each name the package imports comes from the flavour when it is the flavour's (a copied
    module, or a name a copied module or package holds), from the package otherwise. Everywhere else (code,
    messages, docstrings) the dotted names are renamed by the same rule, as Lightning's tooling renames its own.
    """
    names = _Names(copied, source)
    statements = sorted(
        (node for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.Import, ast.ImportFrom))),
        key=lambda node: (node.lineno, node.col_offset),
    )
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(line: int, column: int) -> int:  # ast's columns count UTF-8 bytes
        return starts[line - 1] + len(lines[line - 1].encode()[:column].decode())

    pieces, done = [], 0
    for node in statements:
        begin = offset(node.lineno, node.col_offset)
        end = offset(node.end_lineno or node.lineno, node.end_col_offset or 0)
        pieces.append(_rename(text[done:begin], names))
        spanned = text.count("\n", begin, end)
        # One line, then the lines the statement spanned more, empty: the lines below keep their numbers.
        pieces.append(_statement(node, names) + "\n" * spanned if spanned else _statement(node, names))
        done = end
    pieces.append(_rename(text[done:], names))
    return "".join(pieces)


def _rename(text: str, names: _Names) -> str:
    """Lightning's names and the flavour's, renamed in ``text`` (no import statement)."""
    text = re.sub(r"\blightning\.pytorch\b", "pytorch_lightning", text)
    text = re.sub(r"\blightning\.fabric\b", "lightning_fabric", text)
    return re.sub(rf"\b{PACKAGE}((?:\.\w+)+)", lambda match: _module(match.group(0), names), text)


def _module(dotted: str, names: _Names) -> str:
    """``dotted``, a module or a name in one, as the flavour imports it."""
    for old, new in (("lightning.pytorch", "pytorch_lightning"), ("lightning.fabric", "lightning_fabric")):
        if dotted == old or dotted.startswith(old + "."):
            return new + dotted.removeprefix(old)
    inside = dotted.removeprefix(PACKAGE + ".")
    if inside == dotted or inside.startswith("pytorch_lightning") or not names.flavoured(inside):
        return dotted
    return f"{FLAVOUR}.{inside}"


def _statement(node: ast.Import | ast.ImportFrom, names: _Names) -> str:
    """The import statement ``node`` as the flavour writes it, on one line."""
    if isinstance(node, ast.Import):
        aliases = []
        for alias in node.names:
            if alias.name == "lightning" and alias.asname is None:
                aliases.append("pytorch_lightning as lightning")
            elif alias.name == PACKAGE and alias.asname is None:
                aliases.append(FLAVOUR)  # binds lightning_ddp_amp too, and registers the flavour
            else:
                aliases.append(_module(alias.name, names) + (f" as {alias.asname}" if alias.asname else ""))
        return f"import {', '.join(aliases)}"
    module = "." * node.level + (node.module or "")
    spelled = [alias.name + (f" as {alias.asname}" if alias.asname else "") for alias in node.names]
    if node.level or not (module == PACKAGE or module.startswith(PACKAGE + ".")):
        return f"from {_module(module, names) if not node.level else module} import {', '.join(spelled)}"
    inside = module.removeprefix(PACKAGE).removeprefix(".")
    flavoured = [
        name
        for alias, name in zip(node.names, spelled, strict=True)
        if names.flavoured(f"{inside}.{alias.name}" if inside else alias.name)
    ]
    shared = [name for name in spelled if name not in flavoured]
    lines = [f"from {FLAVOUR}{'.' + inside if inside else ''} import {', '.join(flavoured)}"] if flavoured else []
    lines += [f"from {module} import {', '.join(shared)}"] if shared else []
    return "; ".join(lines)


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
        found[written] = rewrite(original.read_text(), copied, source) + header
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
