"""How the package's modules import one another and Lightning, read from the source (ast, so without importing it),
and the import paths users are shown.

* Public paths (:data:`PUBLIC`): the names the README and docs import, from the modules they name, are there
  (the one check here that imports the package).
* No import cycles: every import counts, at module level, inside functions and under ``if TYPE_CHECKING:``.
* Layers (:data:`LAYERS`): a module imports only from its own part of the package or from a lower layer, so
  ``launch/`` and ``amp/`` never import each other, ``ddp/`` builds on both, the two doors ``trainer/`` and ``fabric/``
  on ``ddp/`` and never on each other, and ``commands/`` on the doors.
* ``_lightning/`` is the one door to Lightning's private API: no module outside it imports a private Lightning name,
  or reaches for an underscore attribute of an object other than its own (``self``/``cls``), also by a string
  (``getattr``, ``attrgetter``) or through the signature of a private function. What a subclass
  inherits from Lightning (``self._launcher``, ...) is checked against Lightning's classes in
  ``tests/test_lightning_internals.py``.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "lightning_ddp_amp"
ROOT = Path(__file__).resolve().parents[1] / "src" / PACKAGE
FENCE = f"{PACKAGE}._lightning"
LIGHTNING_ROOTS = ("lightning", "pytorch_lightning", "lightning_fabric")
#: Lightning modules without an underscore that its documentation does not cover either.
UNDOCUMENTED_LIGHTNING = (
    "lightning.pytorch.overrides",
    "lightning.pytorch.loops",
    "lightning.pytorch.trainer.connectors",
    "lightning.pytorch.loggers.logger",
)

#: Attributes without an underscore on Lightning objects that its documentation does not cover: its loops' parts.
UNDOCUMENTED_ATTRIBUTES = ("epoch_loop", "batch_progress")
#: Underscore attributes the package reads that are not Lightning's, and whose they are.
NOT_LIGHTNING = {
    "_amp_stash": "apex amp's state on an optimizer",
    "_amp_lazy_init": "apex amp's optimizer hook",
    "_amp_state": "apex amp's module state, which holds O1's handle",
    "_VF": "torch.nn.modules.rnn's reference to torch's RNN functions, which apex O1 replaces by its shim (apex_o1)",
    "_enable_caching": "apex amp's O1 handle: what amp.init(enable_caching=False) sets",
    "_get_scale_async": "torch's GradScaler: its scale without the device sync of get_scale() (compare.recording)",
    "_weights_only_unpickler": "torch's module of its weights-only unpickler (safe_load)",
    "_get_allowed_globals": "torch's weights-only allowlist, the one list of what a tensor is pickled with (safe_load)",
}

#: The import paths the README and docs show, and the names they import from each.
PUBLIC = {
    PACKAGE: (
        "AmpPrecision",
        "ApexUnavailableError",
        "CheckpointError",
        "CompareScriptError",
        "EnvDDPStrategy",
        "LauncherEnvironmentError",
        "PeerError",
        "PrecisionConfigurationError",
        "StrategyConfigurationError",
        "TopologyMismatchError",
        "convert_apex_checkpoint",
    ),
    f"{PACKAGE}.trainer.cli": ("LightningCLI",),
    f"{PACKAGE}.pytorch_lightning": ("AmpPrecision", "EnvDDPStrategy"),
    f"{PACKAGE}.pytorch_lightning.trainer.cli": ("LightningCLI",),
}


#: The parts of the package, by folder or top-level module ("" is the package's ``__init__``), lowest layer first.
LAYERS: list[dict[str, set[str]]] = [
    {"base": {"errors", "_lightning", "_standalone", "safe_load", "versions", "precision_strings", "rank_zero"}},
    {"launch": {"launch"}, "amp": {"amp"}},
    {"ddp": {"ddp"}},
    {"trainer": {"trainer"}, "fabric": {"fabric"}},
    {"commands": {"commands"}},
    {"public API": {"", "__main__"}},
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: The package's modules, without the pytorch_lightning flavour the build writes from them (git-ignored).
MODULES = {
    _module_name(path): path
    for path in sorted(ROOT.rglob("*.py"))
    if path.relative_to(ROOT).parts[0] != "pytorch_lightning"
}


def _trees() -> Iterator[tuple[str, ast.Module]]:
    for name, path in MODULES.items():
        yield name, ast.parse(path.read_text(), str(path))


def _imported(module: str, tree: ast.Module) -> Iterator[tuple[str, list[str], int]]:
    """``(module, names, line)`` for every import anywhere in ``tree``; relative imports made absolute."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base, [alias.name for alias in node.names], node.lineno


def import_graph() -> dict[str, set[str]]:
    """Which of the package's modules each of them imports (``from package import module`` counts as the module)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in _trees():
        for imported, names, _ in _imported(name, tree):
            submodules = {f"{imported}.{each}" for each in names}
            targets = submodules & MODULES.keys()
            if imported in MODULES and (not names or targets != submodules):
                targets.add(imported)  # the module itself, or names that are its attributes
            graph[name] |= targets - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for successor in sorted(graph[node]):
            cycle = visit(successor, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> None:
    """Point the checks at a package of ``files`` (module name -> source) instead of the real one."""
    (tmp_path / PACKAGE).mkdir()
    modules = {}
    for name, source in files.items():
        modules[f"{PACKAGE}.{name}"] = path = tmp_path / PACKAGE / f"{name}.py"
        path.write_text(source + "\n")
    monkeypatch.setattr(f"{__name__}.MODULES", modules)


@pytest.mark.parametrize(
    "b_imports_a",
    [
        "from lightning_ddp_amp import a",
        "import lightning_ddp_amp.a as a",
        "from . import a",
        "def f():\n    from lightning_ddp_amp.a import x",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x",
    ],
)
def test_the_cycle_check_sees_every_kind_of_import(
    b_imports_a: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_package(tmp_path, monkeypatch, {"a": "from lightning_ddp_amp import b", "b": b_imports_a})
    assert find_cycle(import_graph()) == [f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]


def part_of(module: str) -> tuple[int, str]:
    """The layer and the part of ``module``, one of the package's."""
    top = module.removeprefix(PACKAGE).removeprefix(".").split(".")[0]
    for layer, parts in enumerate(LAYERS):
        for part, members in parts.items():
            if top in members:
                return layer, part
    raise AssertionError(f"{module} is in no part of LAYERS: add its folder or module there")


def layer_violations() -> list[str]:
    """``a -> b`` for each import of a module from another part of the same layer or from a higher one."""
    graph = import_graph()
    found = []
    for module, imported in sorted(graph.items()):
        layer, part = part_of(module)
        for other in sorted(imported):
            if other == PACKAGE:
                continue  # `import lightning_ddp_amp` registers the plugins; the cycle check keeps it from looping
            other_layer, other_part = part_of(other)
            if other_part != part and other_layer >= layer:
                found.append(f"{module} ({part}) -> {other} ({other_part})")
    return found


def test_no_part_imports_a_peer_or_a_higher_layer() -> None:
    assert layer_violations() == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {"launch.a": "from lightning_ddp_amp.ddp import b", "ddp.b": ""},
            ["launch.a (launch) -> lightning_ddp_amp.ddp.b"],
        ),
        (
            {"launch.a": "from lightning_ddp_amp.amp.b import x", "amp.b": ""},
            ["launch.a (launch) -> lightning_ddp_amp.amp.b"],
        ),
        (
            {
                "ddp.a": "from lightning_ddp_amp.amp import b",
                "amp.b": "from lightning_ddp_amp import errors",
                "errors": "",
            },
            [],
        ),
    ],
    ids=["lower-imports-higher", "peers", "higher-imports-lower"],
)
def test_the_layer_check_finds_what_it_looks_for(
    files: dict[str, str], expected: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_package(tmp_path, monkeypatch, files)
    found = layer_violations()
    assert len(found) == len(expected)
    assert all(f"{PACKAGE}.{each}" in line for each, line in zip(expected, found, strict=True))


def _lightning_module(name: str) -> str | None:
    """``name`` spelled as in ``lightning``, or None when it is not Lightning's."""
    root, _, rest = name.partition(".")
    if root not in LIGHTNING_ROOTS:
        return None
    spelled = {"pytorch_lightning": "lightning.pytorch", "lightning_fabric": "lightning.fabric"}.get(root, root)
    return f"{spelled}.{rest}" if rest else spelled


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def in_fence(module: str) -> bool:
    """Whether ``module`` is the fence, the package ``_lightning`` or one of its modules."""
    return module == FENCE or module.startswith(f"{FENCE}.")


def private_lightning_imports() -> list[str]:
    """``module:line imported`` for each import of a private Lightning name outside ``_lightning/``."""
    found = []
    for module, tree in _trees():
        if in_fence(module):
            continue
        for imported, names, line in _imported(module, tree):
            spelled = _lightning_module(imported)
            if spelled is None:
                continue
            private_names = [each for each in names if _private(each)]
            if any(_private(part) for part in spelled.split(".")) or spelled.startswith(UNDOCUMENTED_LIGHTNING):
                private_names = names or [imported]
            found += [f"{module}:{line} {imported}.{each}" for each in private_names]
    return found


def test_only_the_fence_imports_private_lightning_names() -> None:
    assert private_lightning_imports() == []


#: Calls that read an attribute named by a string: the second argument (or ``name=``) is the attribute's name.
REFLECTIVE = ("getattr", "setattr", "hasattr", "delattr", "builtins.getattr", "inspect.getattr_static")
#: Calls that read attributes by dotted strings, every argument one.
ATTRGETTERS = ("attrgetter", "operator.attrgetter")
#: Calls that read a function's signature from the function itself, its first argument.
SIGNATURES = (
    "signature",
    "inspect.signature",
    "inspect.Signature.from_callable",
    "getfullargspec",
    "inspect.getfullargspec",
)


class _ForeignPrivateAttributes(ast.NodeVisitor):
    """Collects underscore attributes read from an object that is not self or cls, and Lightning's loop parts.

    ``super()._x`` counts unless the enclosing method is ``_x`` itself (an override calling the one it overrides).
    ``getattr(x, "_y")`` and its siblings count as reading ``x._y``, also when the string is a constant bound to a
    name (``NAME = "_y"``). The signature of a private function counts (``inspect.signature(trainer._fit_impl)``),
    and so does the signature of a function handed in as a parameter, whose owner the check cannot see: such a
    callable is Lightning's (a launcher is handed ``Trainer._fit_impl``), so it is bound in the fence.
    """

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self.function = ""
        self.parameters: set[str] = set()
        self.strings: dict[str, str] = {}

    def visit_Module(self, node: ast.Module) -> None:
        for each in ast.walk(node):
            if (
                isinstance(each, ast.Assign)
                and isinstance(each.value, ast.Constant)
                and isinstance(each.value.value, str)
            ):
                named = [target.id for target in each.targets if isinstance(target, ast.Name)]
                self.strings |= dict.fromkeys(named, each.value.value)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer = self.function, self.parameters
        arguments = node.args
        every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
        self.function, self.parameters = node.name, {each.arg for each in every if each is not None}
        self.generic_visit(node)
        self.function, self.parameters = outer

    def visit_Attribute(self, node: ast.Attribute) -> None:
        owner = node.value
        own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
        overridden = isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super" and node.attr == self.function
        if node.attr in UNDOCUMENTED_ATTRIBUTES or (
            _private(node.attr) and node.attr not in NOT_LIGHTNING and not own and not overridden
        ):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = ast.unparse(node.func)
        named: list[ast.expr] = []
        if function in REFLECTIVE:
            named = [*node.args[1:2], *(keyword.value for keyword in node.keywords if keyword.arg == "name")]
        elif function in ATTRGETTERS:
            named = list(node.args)
        names = [part for each in named for part in (self._string(each) or "").split(".")]
        if any(_private(name) and name not in NOT_LIGHTNING for name in names):
            self.found.append((node.lineno, ast.unparse(node)))
        if function in SIGNATURES and node.args and self._private_callable(node.args[0]):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)

    def _string(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return self.strings.get(node.id) if isinstance(node, ast.Name) else None

    def _private_callable(self, node: ast.expr) -> bool:
        """Whether ``node`` names a private function, or one handed in as a parameter."""
        if isinstance(node, ast.Name) and node.id in self.parameters:
            return True
        return any(
            (isinstance(each, ast.Attribute) and _private(each.attr))
            or (isinstance(each, ast.Name) and _private(each.id))
            for each in ast.walk(node)
        )


def foreign_private_attributes() -> list[str]:
    """``module:line expression`` for each underscore attribute of another object read outside ``_lightning/``."""
    found = []
    for module, tree in _trees():
        if not in_fence(module):
            visitor = _ForeignPrivateAttributes()
            visitor.visit(tree)
            found += [f"{module}:{line} {expression}" for line, expression in visitor.found]
    return found


def test_only_the_fence_reads_underscore_attributes_of_other_objects() -> None:
    assert foreign_private_attributes() == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from lightning.fabric.strategies.registry import _StrategyRegistry", ["_StrategyRegistry"]),
        ("from pytorch_lightning.overrides.distributed import UnrepeatedDistributedSampler", ["Unrepeated"]),
        ("from lightning.pytorch.loggers.logger import DummyLogger", ["DummyLogger"]),
        ("import lightning.pytorch.trainer.connectors.accelerator_connector as c", ["connectors"]),
        ("from lightning.pytorch.strategies import DDPStrategy", []),
        ("x.trainer._accelerator_connector", ["_accelerator_connector"]),
        ("trainer.fit_loop.epoch_loop.batch_progress.current", ["batch_progress", "epoch_loop"]),
        ("getattr(loop, '_broadcast_sigterm_tensor')", ["_broadcast_sigterm_tensor"]),
        ("hasattr(loop, name='_broadcast_sigterm_tensor')", ["_broadcast_sigterm_tensor"]),
        ("NAME = '_broadcast_sigterm_tensor'\nsetattr(loop, NAME, None)", ["NAME"]),
        ("import operator\noperator.attrgetter('fit_loop._data_source')(trainer)", ["_data_source"]),
        ("getattr(loop, 'broadcast')", []),
        ("import inspect\ninspect.signature(self._fit_impl)", ["_fit_impl"]),
        ("from inspect import signature\nsignature(getattr(t, '_fit_impl'))", ["_fit_impl"]),
        ("import inspect\ndef launch(function, *args):\n    inspect.signature(function).bind(*args)", ["function"]),
        ("import inspect\ndef f(cls):\n    fit = cls.fit\n    inspect.signature(fit)", []),
        ("import inspect\ninspect.signature(Trainer.__init__)", []),
        ("class A:\n    def _setup_model(self, m):\n        return super()._setup_model(m) + self._ddp_kwargs", []),
        ("class A:\n    def setup(self, m):\n        return super()._setup_model(m)", ["_setup_model"]),
    ],
)
def test_the_fence_checks_find_what_they_look_for(
    source: str, expected: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_package(tmp_path, monkeypatch, {"fake": source})
    found = private_lightning_imports() + foreign_private_attributes()
    assert len(found) == len(expected)
    assert all(word in line for word, line in zip(expected, found, strict=True))


def test_the_fence_is_the_lightning_package_and_its_modules_only() -> None:
    assert in_fence(f"{PACKAGE}._lightning") and in_fence(f"{PACKAGE}._lightning.connectors")
    assert not in_fence(f"{PACKAGE}._lightning_extras") and not in_fence(f"{PACKAGE}.trainer._lightning")


@pytest.mark.parametrize(("module", "name"), [(module, name) for module, names in PUBLIC.items() for name in names])
def test_a_public_name_imports_from_the_path_the_docs_show(module: str, name: str) -> None:
    if ".pytorch_lightning" in module:
        pytest.importorskip("pytorch_lightning")
    imported = importlib.import_module(module)
    assert name in getattr(imported, "__all__", [name]), f"{module}.__all__ lacks {name}"
    assert getattr(imported, name).__name__ == name


#: The most lines a module holds before a second concept has moved in (Lightning's ddp.py and amp.py are a few
#: hundred each), and the most the strategy class holds: a handful of Lightning's named steps, each short.
MAX_MODULE_LINES = 450
MAX_STRATEGY_LINES = 450


def test_no_module_grows_past_one_concept() -> None:
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules by concept: {long}"


def test_the_strategy_class_stays_a_handful_of_lightnings_steps() -> None:
    tree = ast.parse(MODULES[f"{PACKAGE}.trainer.strategy"].read_text())
    (strategy,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "EnvDDPStrategy"]
    assert strategy.end_lineno is not None
    assert strategy.end_lineno - strategy.lineno + 1 <= MAX_STRATEGY_LINES


def test_the_layout_table_of_the_maintainers_page_lists_every_module() -> None:
    # A newcomer finds where a behaviour lives from docs/maintainers.md's Layout: every module has its row.
    page = (ROOT.parents[1] / "docs" / "maintainers.md").read_text()
    layout = page.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for row in layout.splitlines():
        cells = row.split("|")
        if len(cells) > 3 and cells[1].strip().startswith("`"):
            folder = cells[1].strip().strip("`").strip("/")
            for module in cells[2].split(","):
                listed.add(f"{folder}/{module.strip().strip('`')}".lstrip("/"))
    modules = {
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if "pytorch_lightning" not in path.parts and not (path.name == "__init__.py" and path.parent != ROOT)
    }
    assert sorted(modules - listed) == []
