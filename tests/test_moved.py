"""The old module paths from before the subpackages: each warns once, naming the new path, and is the moved module.

The only test that imports them; the package and the other tests use the new paths.
"""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = {
    "environment": "launch.environment",
    "cluster_environment": "launch.cluster_environment",
    "devices": "launch.devices",
    "process_group": "launch.process_group",
    "selflaunch": "launch.selflaunch",
    "preemption": "launch.preemption",
    "strategy": "ddp.strategy",
    "ddp_options": "ddp.ddp_options",
    "data": "ddp.data",
    "resume": "ddp.resume",
    "precision": "amp.precision",
    "amp_backend": "amp.amp_backend",
    "apex_amp": "amp.apex_amp",
    "native_amp": "amp.native_amp",
    "apex_loader": "amp.apex_loader",
    "compare_recorder": "compare.recorder",
    "compare_report": "compare.report",
}


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_path_warns_with_the_new_one_and_is_the_moved_module(
    old: str, new: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = f"lightning_ddp_amp.{old}", f"lightning_ddp_amp.{new}"
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported for the first time, so it warns
    moved = importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=rf"^{old} moved to {new}: import it from there\.") as warned:
        module = importlib.import_module(old)
    assert len(warned) == 1
    assert module is moved  # every name the same object, and patching the old path patches the real module


@pytest.mark.parametrize("old", ["strategy", "precision", "resume", "data", "cluster_environment", "native_amp"])
def test_an_old_path_of_the_pytorch_lightning_flavour_warns_with_its_new_one(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pytorch_lightning")
    flavour = "lightning_ddp_amp.pytorch_lightning"
    old, new = f"{flavour}.{old}", f"{flavour}.{MOVED[old]}"
    monkeypatch.delitem(sys.modules, old, raising=False)
    moved = importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=rf"^{old} moved to {new}: import it from there\."):
        assert importlib.import_module(old) is moved
