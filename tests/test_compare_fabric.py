"""``lightning-ddp-amp compare`` on a kept loop: each run's ``Fabric(...)`` gets the run's precision, as the Trainer does.

In one process, the patch is put on a subclass of Fabric, so that Fabric itself stays as it was; one run through
compare's ``sitecustomize`` checks that a script's own ``Fabric`` is patched in both namespaces.
docs/design/compare-fabric.md has the whole design and the launched tests to come.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import lightning.fabric
import pytest
from conftest import needs_cpu_fp16, worker_env
from lightning.fabric import Fabric
from lightning.fabric.plugins import HalfPrecision, MixedPrecision

from lightning_ddp_amp.commands.compare import command as compare
from lightning_ddp_amp.commands.compare.fabric_patching import PRECISION_VARIABLE, changes_of, patch_fabric
from lightning_ddp_amp.commands.compare.run_folder import PLAN_VARIABLE, Plan
from lightning_ddp_amp.fabric import AmpPrecision


def patched_fabric(tmp_path: Path, precision: str) -> type[Fabric]:
    """A subclass of Fabric, patched as a run of ``precision`` patches the script's."""

    class ScriptFabric(Fabric):
        pass

    namespace = SimpleNamespace(__name__="lightning.fabric", Fabric=ScriptFabric, plugins=lightning.fabric.plugins)
    patch_fabric(namespace, Plan("run", precision, steps=4, directory=str(tmp_path)))
    return ScriptFabric


def changes(fabric: Fabric) -> list[str]:
    return changes_of(fabric).replaced


@needs_cpu_fp16
def test_a_fabric_built_at_another_precision_gets_the_runs_amp_level_and_lists_the_change(tmp_path: Path) -> None:
    fabric = patched_fabric(tmp_path, "native-O2")(accelerator="cpu", devices=1, precision="bf16-mixed")
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision)
    assert (plugin.backend, plugin.opt_level) == ("native", "O2")
    assert changes(fabric) == ["precision='bf16-mixed' -> 'native-O2'"]


def test_a_lightning_precision_string_is_handed_to_fabric_as_it_is(tmp_path: Path) -> None:
    fabric = patched_fabric(tmp_path, "bf16-mixed")(accelerator="cpu", devices=1, precision="32-true")
    assert isinstance(fabric.strategy.precision, MixedPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"


def test_apex_levels_run_apex_under_the_runs_opt_level(tmp_path: Path, apex_double: ModuleType) -> None:
    fabric = patched_fabric(tmp_path, "apex-O1")(strategy="envddp", accelerator="cpu", devices=1, precision="native-O1")
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision)
    assert (plugin.backend, plugin.opt_level) == ("apex", "O1")


@needs_cpu_fp16
def test_a_scripts_amp_precision_is_replaced_and_its_settings_carried_to_the_runs_level(tmp_path: Path) -> None:
    script_plugin = AmpPrecision(
        opt_level="O1", backend="native", num_losses=3, loss_scale=128.0, max_loss_scale=2.0**16
    )
    fabric = patched_fabric(tmp_path, "native-O2")(accelerator="cpu", devices=1, plugins=[script_plugin])
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision) and plugin is not script_plugin
    assert plugin.opt_level == "O2"
    settings = plugin.settings
    assert (settings.num_losses, settings.loss_scale, settings.max_loss_scale) == (3, 128.0, 2.0**16)
    assert changes(fabric) == [
        "precision=None -> 'native-O2'",
        "removed the precision plugin AmpPrecision",
        "kept the script's AmpPrecision settings (num_losses, loss scale, ...)",
    ]


@needs_cpu_fp16
def test_settings_the_runs_level_refuses_are_dropped_and_num_losses_kept(tmp_path: Path) -> None:
    script_plugin = AmpPrecision(opt_level="O2", backend="native", keep_batchnorm_fp32=True, num_losses=2)
    fabric = patched_fabric(tmp_path, "native-O1")(accelerator="cpu", devices=1, plugins=script_plugin)
    settings = fabric.strategy.precision.settings
    assert (settings.opt_level, settings.num_losses, settings.keep_batchnorm_fp32) == ("O1", 2, None)
    assert changes(fabric)[-1].startswith("kept only num_losses of the script's AmpPrecision (keep_batchnorm_fp32=")


def test_a_lightning_precision_plugin_is_removed_for_the_runs_precision(tmp_path: Path) -> None:
    script_plugins: list[Any] = [HalfPrecision("bf16-true")]
    fabric = patched_fabric(tmp_path, "32-true")(accelerator="cpu", devices=1, plugins=script_plugins)
    assert type(fabric.strategy.precision).__name__ == "Precision"
    assert changes(fabric) == ["precision=None -> '32-true'", "removed the precision plugin HalfPrecision"]


def test_the_scripts_own_precision_is_no_change(tmp_path: Path) -> None:
    fabric = patched_fabric(tmp_path, "32-true")(accelerator="cpu", devices=1, precision="32-true")
    assert changes(fabric) == []


def test_fabric_runs_precision_variable_is_removed_so_that_the_runs_precision_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PRECISION_VARIABLE, "bf16-mixed")
    monkeypatch.setenv("LT_CLI_USED", "1")  # as `fabric run` sets it: Fabric would refuse a precision that differs
    fabric = patched_fabric(tmp_path, "32-true")(accelerator="cpu", devices=1, precision="16-mixed")
    assert type(fabric.strategy.precision).__name__ == "Precision"
    assert changes(fabric) == [
        f"removed {PRECISION_VARIABLE}='bf16-mixed', which Fabric takes over precision",
        "precision='bf16-mixed' -> '32-true'",
    ]


def test_a_scripts_fabric_is_patched_in_both_namespaces_through_compares_site(tmp_path: Path) -> None:
    """A script that never imports the package: its ``lightning.fabric.Fabric`` and the standalone
    ``lightning_fabric.Fabric`` both train at the run's precision."""
    pytest.importorskip("pytorch_lightning")
    plan = tmp_path / "plan.json"
    Plan("run", "bf16-mixed", steps=4, directory=str(tmp_path)).write(plan)
    probe = (
        "import lightning.fabric, pytorch_lightning, lightning_fabric\n"
        "for door in (lightning.fabric.Fabric, lightning_fabric.Fabric):\n"
        "    plugin = door(accelerator='cpu', devices=1, precision='32-true').strategy.precision\n"
        "    print(type(plugin).__module__.split('.')[0], plugin.precision)\n"
    )
    env = worker_env({PLAN_VARIABLE: str(plan)})
    env["PYTHONPATH"] = os.pathsep.join([str(compare.SITE), *filter(None, [env.get("PYTHONPATH")])])
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    printed = result.stdout.splitlines()
    assert printed == ["lightning bf16-mixed", "lightning_fabric bf16-mixed"], result.stderr[-2000:]
    assert not (tmp_path / "errors").exists(), json.dumps([p.read_text() for p in (tmp_path / "errors").iterdir()])
