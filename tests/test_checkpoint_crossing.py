"""A checkpoint written under apex amp goes on under torch's AMP or fp32, with the weights apex trained.

apex O2 trains fp32 master copies of fp16 weights: the checkpoint's weights are those masters, so a run resumed under
``32-true``, native AMP or Lightning's ``16-mixed`` starts from them bit for bit; the loss scale carries where the
new precision scales losses, and rank 0 says what carried and what did not. On the CPU with the apex double. An
apex O2 resume still restores its masters exactly: ``test_precision.py::test_o2_resume_restores_the_fp32_master_weights``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning as L
import pytest
import torch
from conftest import needs_cpu_fp16
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from test_precision import DATA, TwoModels, fit, fresh_apex_double, trainer
from torch.utils.data import DataLoader

from lightning_ddp_amp import AmpPrecision

pytestmark = needs_cpu_fp16


class Probe(TwoModels):
    """Records the weights and the precision plugin's loss scale as the resumed run starts."""

    def on_train_start(self) -> None:
        self.started = {name: p.detach().clone() for name, p in self.named_parameters()}
        plugin = self.trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        self.scale = plugin.current_loss_scale if isinstance(plugin, AmpPrecision) else scaler and scaler.get_scale()


def train_under_apex(level: str, folder: Path) -> tuple[dict[str, torch.Tensor], float]:
    """Train a few steps under apex ``level``; returns the fp32 weights apex trained (by name) and the loss scale."""
    first = fit(
        TwoModels(),
        plugins=[AmpPrecision(opt_level=level, backend="apex")],
        callbacks=[ModelCheckpoint(dirpath=folder, filename="last")],
        enable_checkpointing=True,
    )
    plugin = first.precision_plugin
    assert isinstance(plugin, AmpPrecision)
    module = first.lightning_module
    trained = {name: p.detach().clone() for name, p in module.named_parameters()}
    names = {id(p): name for name, p in module.named_parameters()}
    for param, master in plugin.amp_backend.master_weight_pairs():
        trained[names[id(param)]] = master.detach().clone()
    assert all(t.dtype == torch.float32 for t in trained.values())
    scale = plugin.current_loss_scale
    assert scale is not None
    return trained, scale


def resume(folder: Path, precision: Any, caplog: pytest.LogCaptureFixture) -> Probe:
    probe = Probe()
    options = (
        {"plugins": [precision]} if isinstance(precision, L.pytorch.plugins.Precision) else {"precision": precision}
    )
    with caplog.at_level(logging.INFO):
        trainer(max_epochs=2, **options).fit(probe, DataLoader(DATA, batch_size=4), ckpt_path=folder / "last.ckpt")
    return probe


def test_an_apex_o2_checkpoint_holds_the_fp32_masters_as_its_weights(apex_double: ModuleType, tmp_path: Path) -> None:
    trained, scale = train_under_apex("O2", tmp_path)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    weights = {name: checkpoint["state_dict"][name] for name in trained}
    assert all(torch.equal(weights[name], trained[name]) for name in trained)
    # The fp16 copies apex's own state_dict would have saved differ from what apex trained.
    assert any(not torch.equal(t, t.half().float()) for t in trained.values())
    assert checkpoint["AmpPrecision"]["fp32_weights"] is True
    assert checkpoint["MixedPrecision"]["scale"] == scale  # what Lightning's 16-mixed reads


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("target", ["native fp16", "32-true"])
def test_an_apex_checkpoint_resumes_under_native_amp_or_fp32_from_the_weights_apex_trained(
    level: str, target: str, apex_double: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    trained, scale = train_under_apex(level, tmp_path)
    fresh_apex_double(monkeypatch)
    native = target == "native fp16"
    probe = resume(tmp_path, AmpPrecision(opt_level="O1", backend="native") if native else "32-true", caplog)
    assert probe.started.keys() == trained.keys()
    for name, weight in trained.items():
        assert torch.equal(probe.started[name], weight), name  # bit for bit
    weights = "apex O2's fp32 master weights (the checkpoint's weights)" if level == "O2" else "the fp32 weights"
    said = f"Resuming a checkpoint of apex amp {level} under "
    (line,) = [record.getMessage() for record in caplog.records if record.getMessage().startswith(said)]
    if native:
        assert probe.scale == scale
        assert line.endswith(f": carried {weights}, the loss scale {scale:g}")
    else:
        assert probe.scale is None
        assert f": carried {weights}; dropped the loss scale {scale:g} (" in line and "scales no loss)" in line


def test_lightnings_own_16_mixed_resumes_an_apex_checkpoint_with_its_loss_scale(
    apex_double: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trained, scale = train_under_apex("O2", tmp_path)
    fresh_apex_double(monkeypatch)
    sixteen = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    probe = resume(tmp_path, sixteen, caplog)
    assert probe.scale == scale
    assert all(torch.equal(probe.started[name], weight) for name, weight in trained.items())
    assert any(
        "under MixedPrecision(precision='16-mixed'): carried apex O2's fp32" in r.getMessage() for r in caplog.records
    )


class Tied(TwoModels):
    """A second name for model_a's first weight, as tied embeddings have (``lm_head.weight is wte.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tied = torch.nn.Linear(8, 16)
        self.tied.weight = self.model_a[0].weight


def test_every_name_of_a_tied_weight_holds_its_fp32_master(apex_double: ModuleType, tmp_path: Path) -> None:
    first = fit(
        Tied(),
        plugins=[AmpPrecision(opt_level="O2", backend="apex")],
        callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="last")],
        enable_checkpointing=True,
    )
    module = first.lightning_module
    (master,) = [m for p, m in first.precision_plugin.amp_backend.master_weight_pairs() if p is module.tied.weight]
    weights = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert not torch.equal(master, master.half().float())
    assert torch.equal(weights["tied.weight"], master) and torch.equal(weights["model_a.0.weight"], master)
