"""The standalone `pytorch_lightning`: the same plugins, built from the same source (lightning_ddp_amp/_namespaces.py).

The precision-string tests (test_precision.py) and the equivalence with the recipe (test_multiprocess.py) run
against both namespaces too.
"""

from __future__ import annotations

import ast
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
    assert Path(sys.modules[plugins.EnvDDPStrategy.__module__].__file__ or "") == SOURCE / "strategy.py"
    assert plugins.LauncherEnvironmentError is lightning_ddp_amp.LauncherEnvironmentError
    assert plugins.read_topology is lightning_ddp_amp.read_topology
    copied = _namespaces.namespaced_modules()
    assert {"strategy", "precision", "cli", "_lightning"} <= copied
    for path in SOURCE.glob("*.py"):
        if path.stem not in copied | {"__init__", "__main__", "_namespaces"}:
            assert not any(m.split(".")[0] == "lightning" for m in _namespaces._imports(path)), path.name


@pytest.mark.parametrize("module", sorted(_namespaces.namespaced_modules()))
def test_every_copied_module_imports_only_the_standalone_package_and_the_copies(module: str) -> None:
    # Parsed after the rewrite: an import form the rewrite misses (`import lightning as L`, a parenthesised
    # `from lightning_ddp_amp import (...)`) would mix the two class hierarchies, and fails here.
    source = (SOURCE / f"{module}.py").read_text()
    rewritten = _namespaces.rewrite(source)
    assert rewritten.count("\n") == source.count("\n")  # tracebacks point at the real lines
    copied = _namespaces.namespaced_modules()
    for node in ast.walk(ast.parse(rewritten)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            assert name.split(".")[0] != "lightning", f"{module}.py still imports {name}"
            shared = name.removeprefix("lightning_ddp_amp.")
            assert shared == name or shared.split(".")[0] not in copied, f"{module}.py imports the original {name}"


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
        "lightning_ddp_amp.pytorch_lightning.strategy",
        "lightning_ddp_amp.pytorch_lightning.precision",
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
    result = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr


def test_cli_accepts_the_precision_strings_in_a_config(tmp_path: Path) -> None:
    from lightning_ddp_amp.pytorch_lightning.cli import LightningCLI

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
