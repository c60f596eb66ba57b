"""The standalone `pytorch_lightning`: the same plugins, built from the same source (lightning_ddp_amp/_namespaces.py).

The precision-string tests (test_precision.py) and the equivalence with the recipe (test_multiprocess.py) run
against both namespaces too.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import worker_env

import lightning_ddp_amp
from lightning_ddp_amp import _namespaces

pl = pytest.importorskip("pytorch_lightning")
import lightning_ddp_amp.pytorch_lightning as plugins  # noqa: E402

SOURCE = Path(lightning_ddp_amp.__file__).parent


def test_plugins_derive_from_the_standalone_packages_classes() -> None:
    import lightning.pytorch as lightning_pytorch

    assert issubclass(plugins.EnvDDPStrategy, pl.strategies.DDPStrategy)
    assert not issubclass(plugins.EnvDDPStrategy, lightning_pytorch.strategies.DDPStrategy)
    assert issubclass(plugins.AmpPrecision, pl.plugins.precision.Precision)
    assert pl.strategies.StrategyRegistry["envddp"]["strategy"] is plugins.EnvDDPStrategy
    assert lightning_pytorch.strategies.StrategyRegistry["envddp"]["strategy"] is lightning_ddp_amp.EnvDDPStrategy


def test_one_source_of_truth_shared_errors_and_modules() -> None:
    # Built from the very files of lightning_ddp_amp, not a copy in the repository.
    assert Path(sys.modules[plugins.EnvDDPStrategy.__module__].__file__ or "") == SOURCE / "trainer" / "strategy.py"
    assert plugins.LauncherEnvironmentError is lightning_ddp_amp.LauncherEnvironmentError
    assert plugins.read_topology is lightning_ddp_amp.read_topology
    copied = _namespaces.namespaced_modules()
    assert {"trainer.strategy", "trainer.precision", "trainer.cli", "_lightning"} <= copied
    for module, path in _namespaces._modules().items():
        if module not in copied | {"__init__", "__main__", "_namespaces"}:
            assert not any(m.split(".")[0] == "lightning" for m in _namespaces._imports(path)), module


@pytest.mark.parametrize("module", sorted(_namespaces.namespaced_modules()))
def test_every_copied_module_imports_only_the_standalone_package_and_the_copies(module: str) -> None:
    # Parsed after the rewrite: an import form the rewrite misses (`import lightning as L`, a parenthesised
    # `from lightning_ddp_amp import (...)`) would mix the two class hierarchies, and fails here.
    source = _namespaces.source_file(module).read_text()
    rewritten = _namespaces.rewrite(source)
    assert rewritten.count("\n") == source.count("\n")  # tracebacks point at the real lines
    copied = _namespaces.namespaced_modules()
    for node in ast.walk(ast.parse(rewritten)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            assert name.split(".")[0] != "lightning", f"{module}.py still imports {name}"
            flavour = name.removeprefix(f"{_namespaces.NAMESPACE}.")
            in_flavour = copied | _namespaces.namespaced_packages() | set(_namespaces._PUBLIC_CLASSES)
            assert flavour == name or _prefixes(flavour) & in_flavour, f"{module}.py imports {name}: not copied"
            shared = name.removeprefix("lightning_ddp_amp.")
            assert shared == name or not _prefixes(shared) & copied, f"{module}.py imports the original {name}"


def _prefixes(name: str) -> set[str]:
    """``a``, ``a.b`` and ``a.b.c`` for ``a.b.c``."""
    parts = name.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts) + 1)}


@pytest.mark.parametrize("module", sorted(_namespaces.namespaced_modules()))
def test_every_copied_module_imports_in_the_standalone_flavour(module: str) -> None:
    path = _namespaces.source_file(module)
    assert importlib.import_module(f"{_namespaces.NAMESPACE}.{module}").__file__ == str(path)


def test_the_type_stubs_are_the_rewritten_sources() -> None:
    # Type checkers and IDEs read the stubs, not the import hook: they must declare what the hook builds.
    committed = {path: path.read_text() for path in _namespaces.STUBS.rglob("*.pyi")}
    expected = _namespaces.stubs()
    stale = sorted(
        path.relative_to(_namespaces.STUBS).as_posix()
        for path in committed.keys() | expected.keys()
        if committed.get(path) != expected.get(path)
    )
    assert not stale, (
        f"stubs={stale}: out of date with the sources."
        " Fix: python -c 'from lightning_ddp_amp import _namespaces; _namespaces.write_stubs()'"
    )


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
    # A signal has one handler per process: whichever Trainer trains, its strategy watches the one SIGTERM flag.
    from lightning_ddp_amp.trainer import resume

    copied = importlib.import_module(f"{_namespaces.NAMESPACE}.trainer.resume")
    assert copied is not resume
    assert copied.PREEMPTION is resume.PREEMPTION


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
    assert "class_path: lightning_ddp_amp.pytorch_lightning.AmpPrecision" in _namespaces.rewrite(
        "class_path: lightning_ddp_amp.AmpPrecision"
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
