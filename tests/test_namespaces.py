"""The standalone `pytorch_lightning`: the same plugins, written from the same sources when the package is built
(build_backend/pytorch_lightning_flavour.py; tests/conftest.py writes it again before every session).

The precision-string tests (test_precision.py) and the equivalence with the recipe (test_multiprocess.py) run
against both namespaces too; tests/test_packaging.py checks the flavour of a built wheel.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning_flavour as flavour
import torch
from conftest import worker_env

import lightning_ddp_amp

pl = pytest.importorskip("pytorch_lightning")
import lightning_ddp_amp.pytorch_lightning as plugins  # noqa: E402

SOURCE = Path(lightning_ddp_amp.__file__).parent
REPO = Path(__file__).parents[1]
COPIED = flavour.copied_modules()


def test_plugins_derive_from_the_standalone_packages_classes() -> None:
    import lightning.pytorch as lightning_pytorch

    assert issubclass(plugins.EnvDDPStrategy, pl.strategies.DDPStrategy)
    assert not issubclass(plugins.EnvDDPStrategy, lightning_pytorch.strategies.DDPStrategy)
    assert issubclass(plugins.AmpPrecision, pl.plugins.precision.Precision)
    assert pl.strategies.StrategyRegistry["envddp"]["strategy"] is plugins.EnvDDPStrategy
    assert lightning_pytorch.strategies.StrategyRegistry["envddp"]["strategy"] is lightning_ddp_amp.EnvDDPStrategy


def test_one_source_of_truth_shared_errors_and_modules() -> None:
    # Written from the very files of lightning_ddp_amp, at build time; the shared modules are not copied.
    written = Path(sys.modules[plugins.EnvDDPStrategy.__module__].__file__ or "")
    assert written == SOURCE / "pytorch_lightning" / "trainer" / "strategy.py"
    assert written.read_text().startswith(flavour.rewrite((SOURCE / "trainer" / "strategy.py").read_text(), COPIED))
    assert plugins.LauncherEnvironmentError is lightning_ddp_amp.LauncherEnvironmentError
    assert plugins.read_topology is lightning_ddp_amp.read_topology
    assert {"trainer.strategy", "trainer.precision", "trainer.cli"} <= COPIED
    assert {"_lightning", "trainer", "fabric"} <= flavour.copied_packages(COPIED)
    for module, path in flavour.modules().items():
        if module not in COPIED | flavour.NEVER | {"__init__"}:
            assert not any(m.split(".")[0] == "lightning" for m in flavour.imports(path)), module


@pytest.mark.parametrize("module", sorted(COPIED))
def test_every_copied_module_imports_only_the_standalone_package_and_the_copies(module: str) -> None:
    # Parsed after the rewrite: an import form the rewrite misses (`import lightning as L`) would mix the two class
    # hierarchies, and fails here.
    source = (SOURCE / f"{module.replace('.', '/')}.py").read_text()
    rewritten = flavour.rewrite(source, COPIED)
    assert rewritten.count("\n") == source.count("\n")  # tracebacks point at the source's lines
    in_flavour = COPIED | flavour.copied_packages(COPIED) | set(flavour.PUBLIC_CLASSES)
    for node in ast.walk(ast.parse(rewritten)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            assert name.split(".")[0] != "lightning", f"{module}.py still imports {name}"
            flavoured = name.removeprefix(f"{flavour.FLAVOUR}.")
            assert flavoured == name or _prefixes(flavoured) & in_flavour, f"{module}.py imports {name}: not copied"
            shared = name.removeprefix("lightning_ddp_amp.")
            assert shared == name or not _prefixes(shared) & COPIED, f"{module}.py imports the original {name}"


def test_an_import_over_several_lines_is_rewritten_and_the_lines_below_keep_their_numbers() -> None:
    source = (
        "from lightning_ddp_amp import (  # noqa: E402\n"
        "    _lightning,\n"
        "    errors,\n"
        ")\n"
        "import lightning_ddp_amp._lightning.connectors as connectors, lightning\n"
        "from lightning.pytorch import Trainer\n"
        "import lightning\n"
        "x = lightning_ddp_amp._lightning.connectors.install(lightning_ddp_amp.errors.nearest)\n"
    )
    rewritten = flavour.rewrite(source, frozenset({"_lightning.connectors"}))
    assert rewritten.splitlines() == [
        "from lightning_ddp_amp.pytorch_lightning import _lightning; from lightning_ddp_amp import errors",
        "",
        "",
        "",
        "import lightning_ddp_amp.pytorch_lightning._lightning.connectors as connectors, pytorch_lightning as lightning",
        "from pytorch_lightning import Trainer",
        "import pytorch_lightning as lightning",
        "x = lightning_ddp_amp.pytorch_lightning._lightning.connectors.install(lightning_ddp_amp.errors.nearest)",
    ]


def _prefixes(name: str) -> set[str]:
    """``a``, ``a.b`` and ``a.b.c`` for ``a.b.c``."""
    parts = name.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts) + 1)}


@pytest.mark.parametrize("module", sorted(COPIED))
def test_every_copied_module_imports_in_the_standalone_flavour(module: str) -> None:
    imported = importlib.import_module(f"{flavour.FLAVOUR}.{module}")
    assert imported.__file__ == str(SOURCE / "pytorch_lightning" / f"{module.replace('.', '/')}.py")


def test_the_flavour_on_disk_is_todays_and_nothing_of_it_is_versioned() -> None:
    written = {path: path.read_text() for path in (SOURCE / "pytorch_lightning").rglob("*.py")}
    assert written == flavour.flavour_files()
    tracked = subprocess.run(
        ["git", "ls-files", "src/lightning_ddp_amp/pytorch_lightning"], cwd=REPO, capture_output=True, text=True
    )
    assert tracked.returncode == 0 and tracked.stdout == "", tracked.stdout


def test_the_flavour_is_written_again_only_where_a_source_changed(tmp_path: Path) -> None:
    import shutil

    source = tmp_path / "lightning_ddp_amp"
    shutil.copytree(SOURCE, source, ignore=shutil.ignore_patterns("pytorch_lightning", "__pycache__"))
    assert len(flavour.write_flavour(source)) == len(flavour.flavour_files(source))
    assert flavour.write_flavour(source) == []
    errors = (source / "trainer" / "cli.py").read_text()
    (source / "trainer" / "cli.py").write_text(errors + "\n# changed\n")
    (source / "pytorch_lightning" / "stale.py").write_text("")
    assert flavour.write_flavour(source) == [source / "pytorch_lightning" / "trainer" / "cli.py"]
    assert not (source / "pytorch_lightning" / "stale.py").exists()


#: What the README recommends, as a user writes it, with one wrong argument.
USER_FILE = """\
import pytorch_lightning

from lightning_ddp_amp.pytorch_lightning import AmpPrecision, EnvDDPStrategy

s: pytorch_lightning.strategies.DDPStrategy = EnvDDPStrategy()
p: pytorch_lightning.plugins.precision.Precision = AmpPrecision()
EnvDDPStrategy(timeout="ten minutes")
"""


def test_a_user_file_type_checks_against_the_standalone_classes(tmp_path: Path) -> None:
    # Were the classes Any, or lightning.pytorch's, the wrong argument would pass or the assignments would fail.
    # The package comes from MYPYPATH, so that an error in its stubs is reported too.
    (tmp_path / "user.py").write_text(USER_FILE)
    command = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"), "user.py"]
    env = worker_env({"MYPYPATH": str(SOURCE.parent)})
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, result.stdout + result.stderr
    assert errors[0].startswith('user.py:7: error: Argument "timeout" to "EnvDDPStrategy" has incompatible type "str"')


def test_process_wide_state_exists_once_in_both_flavours() -> None:
    # A signal has one handler per process, a decision is said once, an RNN is hooked once, apex O1's shims are
    # wrapped once: whichever Trainer trains, both flavours reach the one copy of each.
    from lightning_ddp_amp import rank_zero
    from lightning_ddp_amp.amp import apex_backend, apex_o1
    from lightning_ddp_amp.trainer import resume

    copied = importlib.import_module(f"{flavour.FLAVOUR}.trainer.resume")
    assert copied is not resume
    assert copied.PREEMPTION is resume.PREEMPTION
    for shared in (rank_zero, apex_o1, apex_backend):
        name = shared.__name__.removeprefix("lightning_ddp_amp.")
        assert name not in COPIED
        assert not (SOURCE / "pytorch_lightning" / f"{name.replace('.', '/')}.py").exists()


#: Module-level values that are state (filled as the process runs), not constants: an empty container.
_EMPTY_CONTAINERS = ("set", "dict", "list", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "WarningCache")


def _state(tree: ast.Module) -> list[str]:
    found = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        called = value.func if isinstance(value, ast.Call) and not value.args and not value.keywords else None
        name = getattr(called, "attr", getattr(called, "id", None))
        empty_literal = isinstance(value, (ast.Set, ast.Dict, ast.List)) and not getattr(
            value, "elts", getattr(value, "keys", [1])
        )
        if name in _EMPTY_CONTAINERS or empty_literal:
            found += [target.id for target in targets if isinstance(target, ast.Name)]
    return found


def test_no_copied_module_holds_process_wide_state() -> None:
    # State in a copied module would exist once per flavour: it belongs in a shared module (rank_zero, preemption).
    held = {
        module: _state(ast.parse(path.read_text())) for module, path in flavour.modules().items() if module in COPIED
    }
    assert {module: names for module, names in held.items() if names} == {}
    assert _state(ast.parse("SAID = WarningCache()\nHOOKED: weakref.WeakSet[int] = weakref.WeakSet()\nX = {}")) == [
        "SAID",
        "HOOKED",
        "X",
    ]


def test_checking_whether_pytorch_lightning_is_installed_keeps_the_registration() -> None:
    code = (
        "import importlib.util, lightning_ddp_amp\n"
        "assert importlib.util.find_spec('pytorch_lightning') is not None\n"
        "import pytorch_lightning as pl\n"
        "print('envddp' in pl.strategies.StrategyRegistry, type(pl.__loader__).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["True", "SourceFileLoader"], result.stderr


def test_messages_name_the_standalone_classes() -> None:
    assert "class_path: lightning_ddp_amp.pytorch_lightning.AmpPrecision" in flavour.rewrite(
        "class_path: lightning_ddp_amp.AmpPrecision", COPIED
    )


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning_ddp_amp; import pytorch_lightning as pl",
        "import pytorch_lightning as pl; import lightning_ddp_amp",
        "import pytorch_lightning as pl; import lightning_ddp_amp.pytorch_lightning",
    ],
    ids=["package-first", "pytorch-lightning-first", "explicit"],
)
def test_strategy_and_precision_strings_work_whatever_the_import_order(imports: str) -> None:
    code = (
        f"{imports}\n"
        "t = pl.Trainer(strategy='envddp', precision='amp-O1', accelerator='cpu', logger=False)\n"
        "print(type(t.strategy).__module__, type(t.precision_plugin).__module__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "lightning_ddp_amp.pytorch_lightning.trainer.strategy",
        "lightning_ddp_amp.pytorch_lightning.trainer.precision",
    ]


def test_a_failure_to_build_the_standalone_flavour_is_a_warning_not_a_broken_import() -> None:
    code = (
        "import sys, lightning_ddp_amp\n"
        "sys.modules['lightning_ddp_amp.pytorch_lightning'] = None  # the flavour cannot be imported\n"
        "import pytorch_lightning as pl\n"
        "print('envddp' in pl.strategies.StrategyRegistry)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
    assert "lightning_ddp_amp could not set itself up for pytorch_lightning" in result.stderr
    assert 'pytorch_lightning.Trainer will not know strategy="envddp"' in result.stderr


def test_lightning_users_do_not_import_pytorch_lightning() -> None:
    code = "import lightning_ddp_amp, sys; print('pytorch_lightning' in sys.modules)"
    command = [sys.executable, "-X", "importtime", "-c", code]
    result = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
    imported = [
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    ]
    assert "lightning_ddp_amp" in imported
    standalone = [name for name in imported if name.split(".")[0] in ("pytorch_lightning", "lightning_fabric")]
    assert not standalone


def test_cli_accepts_the_precision_strings_in_a_config(tmp_path: Path) -> None:
    from lightning_ddp_amp.pytorch_lightning.trainer.cli import LightningCLI

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  strategy: envddp\n  precision: amp-O1\n  accelerator: cpu\n  logger: false\n")
    cli = LightningCLI(Model, args=["--config", str(config)], run=False)
    assert isinstance(cli.trainer, pl.Trainer)
    assert type(cli.trainer.strategy) is plugins.EnvDDPStrategy
    assert type(cli.trainer.precision_plugin) is plugins.AmpPrecision


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning_ddp_amp; import pytorch_lightning; import lightning_fabric as lf",
        "import lightning_fabric as lf; import lightning_ddp_amp.pytorch_lightning",
    ],
    ids=["with-pytorch-lightning", "explicit"],
)
def test_standalone_fabric_knows_envddp_and_the_precision_strings(imports: str) -> None:
    # lightning_fabric is the standalone Fabric: the flavour registers in its registry and hooks its connector.
    code = (
        f"{imports}\n"
        "f = lf.Fabric(strategy='envddp', precision='native-O1', accelerator='cpu')\n"
        "print(type(f.strategy).__module__, type(f.strategy.precision).__module__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "lightning_ddp_amp.pytorch_lightning.fabric.strategy",
        "lightning_ddp_amp.pytorch_lightning.fabric.precision",
    ]
