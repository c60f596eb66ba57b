"""AmpPrecision in one process: arguments, precision strings, the errors a user can meet, and training on the CPU
with the native backend and with the apex test double (tests/doubles/apex)."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning as L
import pytest
import torch
from conftest import Flavour, _forget_apex, needs_cpu_fp16
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp import (
    AmpPrecision,
    ApexUnavailableError,
    EnvDDPStrategy,
    PrecisionConfigurationError,
    StrategyConfigurationError,
)
from lightning_ddp_amp.amp.native_backend import NativeAmp
from lightning_ddp_amp.fabric import AmpPrecision as FabricAmpPrecision
from lightning_ddp_amp.launch.process_group import destroy_process_group

DATA = TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(0)), torch.randn(32, 1))


class TwoModels(L.LightningModule):
    """Two sub-models, one optimizer, a per-step LR schedule; records what the training step saw."""

    def __init__(
        self, amp_models: bool = True, overflow_at_step: int = -1, manual_losses: int = 0, overflow_loss_id: int = -1
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
        self.model_b = torch.nn.Linear(16, 1)
        self.overflow_at_step = overflow_at_step
        self.overflow_loss_id = overflow_loss_id
        self.manual_losses = manual_losses
        self.automatic_optimization = manual_losses == 0
        self.hidden_dtypes: set[torch.dtype] = set()
        self.output_dtypes: set[torch.dtype] = set()
        if amp_models:
            self.configure_amp_models = lambda: [self.model_a, self.model_b]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.model_a(x)
        output = self.model_b(hidden)
        self.hidden_dtypes.add(hidden.dtype)
        self.output_dtypes.add(output.dtype)
        loss = torch.nn.functional.mse_loss(output.float(), y.float())
        overflow = self.global_step == self.overflow_at_step
        if overflow and self.overflow_loss_id < 0:
            loss = loss * float("inf")
        if self.manual_losses:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            for loss_id in range(self.manual_losses):
                part = loss / (loss_id + 1)
                if overflow and loss_id == self.overflow_loss_id:
                    part = part * float("inf")
                last = loss_id == self.manual_losses - 1
                amp = {"loss_id": loss_id} if isinstance(self.trainer.precision_plugin, AmpPrecision) else {}
                self.manual_backward(part, retain_graph=not last, **amp)
            optimizer.step()
            self.lr_schedulers().step()
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def trainer(**kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        strategy="envddp",
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return L.Trainer(**options)


def fit(model: L.LightningModule, **kwargs: Any) -> L.Trainer:
    t = trainer(**kwargs)
    t.fit(model, DataLoader(DATA, batch_size=4))
    return t


# --- arguments ------------------------------------------------------------------------------------------------

BAD_ARGUMENTS = [
    ({"opt_level": "O4"}, "opt_level", "it must be one of 'O0', 'O1', 'O2', 'O3'"),
    ({"backend": "cuda"}, "backend", "it must be one of 'auto', 'apex', 'native'"),
    ({"dtype": "float8"}, "dtype", "it must be one of 'float16', 'bfloat16'"),
    ({"models": "model_a"}, "models", "non-empty list of attribute names"),
    ({"models": []}, "models", "non-empty list of attribute names"),
    ({"loss_scale": -1}, "loss_scale", 'it must be "dynamic" or a positive number'),
    ({"loss_scale": "huge"}, "loss_scale", 'it must be "dynamic" or a positive number'),
    ({"num_losses": 0}, "num_losses", "at least 1"),
    ({"num_losses": True}, "num_losses", "at least 1"),
    ({"min_loss_scale": 0}, "min_loss_scale", "it must be positive"),
    ({"max_loss_scale": -2}, "max_loss_scale", "it must be positive"),
    ({"min_loss_scale": 8, "max_loss_scale": 4}, "min_loss_scale", "it is above max_loss_scale=4"),
    ({"cast_model_outputs": "floaty"}, "cast_model_outputs", "it is not a torch dtype"),
    ({"opt_level": "O1", "keep_batchnorm_fp32": True}, "keep_batchnorm_fp32", "only applies to opt_level O2 and O3"),
    ({"backend": "native", "opt_level": "O3", "loss_scale": 128}, "loss_scale", "no loss scaler"),
    ({"backend": "native", "dtype": "bfloat16", "loss_scale": 128}, "loss_scale", "bfloat16 needs no loss scaling"),
    ({"backend": "native", "opt_level": "O2", "keep_batchnorm_fp32": False}, "keep_batchnorm_fp32", "always runs"),
    ({"backend": "native", "opt_level": "O3", "keep_batchnorm_fp32": True}, "keep_batchnorm_fp32", "whole model"),
]


@pytest.mark.parametrize(("kwargs", "field", "words"), BAD_ARGUMENTS, ids=[str(c[0]) for c in BAD_ARGUMENTS])
def test_bad_argument_names_the_field_its_value_and_the_fix(kwargs: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(PrecisionConfigurationError) as raised:
        AmpPrecision(**kwargs)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}=")
    assert words in str(raised.value)
    assert "Fix: " in str(raised.value)


# --- precision strings ----------------------------------------------------------------------------------------


# Each runs against `lightning` and the standalone `pytorch_lightning` (the `flavour` fixture in conftest.py).


def flavoured_trainer(flavour: Flavour, **kwargs: Any) -> Any:
    return flavour.pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **kwargs)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_amp_strings_resolve_to_amp_precision(level: str, no_apex: None, flavour: Flavour) -> None:
    plugin = flavoured_trainer(flavour, precision=f"amp-{level}").precision_plugin
    assert type(plugin) is flavour.plugins.AmpPrecision
    assert isinstance(plugin, flavour.pl.plugins.precision.Precision)
    assert (plugin.opt_level, plugin.backend) == (level, "native")


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_apex_strings_resolve_to_the_apex_backend(level: str, apex_double: ModuleType, flavour: Flavour) -> None:
    trainer = flavoured_trainer(flavour, strategy="envddp", precision=f"apex-{level}")
    assert type(trainer.strategy) is flavour.plugins.EnvDDPStrategy
    assert type(trainer.precision_plugin) is flavour.plugins.AmpPrecision
    assert (trainer.precision_plugin.opt_level, trainer.precision_plugin.backend) == (level, "apex")


def test_amp_strings_prefer_apex_when_it_is_importable(apex_double: ModuleType, flavour: Flavour) -> None:
    assert flavoured_trainer(flavour, precision="amp-O2").precision_plugin.backend == "apex"


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_native_strings_run_torchs_amp_even_where_apex_is_importable(
    level: str, apex_double: ModuleType, flavour: Flavour
) -> None:
    # compare's "native-O1" is the Trainer's too: AmpPrecision(opt_level="O1", backend="native").
    plugin = flavoured_trainer(flavour, strategy="envddp", precision=f"native-{level}").precision_plugin
    assert type(plugin) is flavour.plugins.AmpPrecision
    assert (plugin.opt_level, plugin.backend) == (level, "native")


@pytest.mark.parametrize(
    ("value", "plugin_type"),
    [
        ("32-true", "Precision"),
        (32, "Precision"),
        ("16-mixed", "MixedPrecision"),
        ("bf16-mixed", "MixedPrecision"),
        ("16-true", "HalfPrecision"),
        ("bf16-true", "HalfPrecision"),
        ("64-true", "DoublePrecision"),
        ("64", "DoublePrecision"),
        ("bf16", "MixedPrecision"),
        ("16", "MixedPrecision"),
        (16, "MixedPrecision"),
    ],
)
def test_lightnings_own_values_behave_as_before(value: Any, plugin_type: str, flavour: Flavour) -> None:
    plugin = flavoured_trainer(flavour, precision=value).precision_plugin
    assert type(plugin) is getattr(flavour.pl.plugins.precision, plugin_type)


@pytest.mark.parametrize("value", ["apex-O9", "native-O4", "apex", "native", "fp8", "half"])
def test_other_strings_are_the_packages_to_refuse_naming_its_values(value: str, flavour: Flavour) -> None:
    # Near one of its strings or not: Lightning's refusal would list none of them (more: test_mistyped_names.py).
    with pytest.raises(PrecisionConfigurationError, match=f"^precision={value!r}: ") as raised:
        flavoured_trainer(flavour, precision=value)
    assert "apex-O0 ... apex-O3, amp-O0 ... amp-O3, native-O0 ... native-O3 and Lightning's" in raised.value.fix
    assert "32-true" in raised.value.fix and "16-mixed" in raised.value.fix


@pytest.mark.parametrize("value", [17, 8, 1.5])
def test_other_values_that_are_no_string_are_still_rejected_by_lightning(value: object, flavour: Flavour) -> None:
    with pytest.raises(ValueError, match="is invalid") as raised:
        flavoured_trainer(flavour, precision=value)
    assert not isinstance(raised.value, PrecisionConfigurationError)


def test_a_precision_string_and_a_precision_plugin_conflict(no_apex: None) -> None:
    with pytest.raises(PrecisionConfigurationError) as raised:
        trainer(precision="amp-O1", plugins=[AmpPrecision()])
    assert str(raised.value).startswith("precision='amp-O1': plugins also holds a precision plugin (AmpPrecision)")


def test_bfloat16_under_auto_says_why_it_runs_natively(
    apex_double: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        trainer(plugins=[AmpPrecision(dtype="bfloat16")])
    (line,) = [r.getMessage() for r in caplog.records if "AmpPrecision" in r.getMessage()]
    assert line == (
        "AmpPrecision: apex amp has no bfloat16, so opt_level O1 runs on torch.amp: torch.autocast(bfloat16) with no"
        " loss scaling"
    )


def test_falling_back_to_native_prints_one_line_with_the_mapping(
    no_apex: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        trainer(precision="amp-O2")
    lines = [r.getMessage() for r in caplog.records if "AmpPrecision" in r.getMessage()]
    assert lines == [
        "AmpPrecision: NVIDIA apex amp is not importable, so opt_level O2 runs on torch.amp: torch.autocast(float16)"
        " with dynamic loss scaling; weights stay fp32 as O2's master weights"
    ]


def test_falling_back_with_a_fixed_loss_scale_names_the_scale(no_apex: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        trainer(plugins=[AmpPrecision(loss_scale=128.0)])
    lines = [r.getMessage() for r in caplog.records if "AmpPrecision" in r.getMessage()]
    assert lines == [
        "AmpPrecision: NVIDIA apex amp is not importable, so opt_level O1 runs on torch.amp: torch.autocast(float16)"
        " with a fixed loss scale of 128"
    ]


# --- apex that cannot run -------------------------------------------------------------------------------------


@pytest.fixture
def cuda_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch says on a machine with CUDA (only what the precision plugin reads before it builds anything)."""
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_apex_on_a_machine_without_cuda_says_so_and_points_at_amp_first(no_apex: None) -> None:
    with pytest.raises(ApexUnavailableError) as raised:
        trainer(precision="apex-O2")
    message = str(raised.value)
    assert message.startswith("precision='apex-O2': apex amp needs CUDA, and this machine has none (torch ")
    assert 'Fix: use precision="amp-O2"' in message
    assert "from source" not in message  # no build of apex makes it run here


def test_apex_not_installed_says_where_apex_amp_exists_and_the_native_alternatives(
    no_apex: None, cuda_machine: None
) -> None:
    with pytest.raises(ApexUnavailableError) as raised:
        trainer(precision="apex-O1")
    message = str(raised.value)
    assert message.startswith("precision='apex-O1': NVIDIA apex is not installed.")
    assert "apex.amp exists only in NVIDIA apex releases up to 25.05 (it was removed from apex in May 2025)" in message
    assert "built from source" in message
    assert 'precision="amp-O1"' in message and 'precision="16-mixed"' in message


def test_apex_without_amp_says_it_was_removed(apex_without_amp: None, cuda_machine: None) -> None:
    with pytest.raises(ApexUnavailableError) as raised:
        AmpPrecision(backend="apex")
    message = str(raised.value)
    assert message.startswith("backend='apex': the installed apex (")
    assert "has no apex.amp: NVIDIA removed it after release 25.05" in message


def test_auto_backend_without_amp_falls_back_to_native(apex_without_amp: None) -> None:
    assert AmpPrecision(backend="auto").backend == "native"


def test_apex_on_a_cpu_accelerator_is_an_error(apex_double: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(apex_double, "supports_cpu", False)  # as real apex: CUDA only
    with pytest.raises(ApexUnavailableError) as raised:
        trainer(precision="apex-O1")
    assert str(raised.value).startswith("accelerator='cpu': apex amp needs CUDA")
    assert 'precision="amp-O1"' in str(raised.value)


def test_amp_under_a_strategy_that_wraps_first_runs_natively_though_apex_is_there(
    apex_double: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        built = trainer(strategy="ddp", devices=1, precision="amp-O1")
    assert built.precision_plugin.backend == "native"
    lines = [r.getMessage() for r in caplog.records if "AmpPrecision" in r.getMessage()]
    assert lines == [
        "AmpPrecision: strategy='DDPStrategy': this strategy wraps the model in DistributedDataParallel before the"
        " precision plugin sees it, but apex requires amp.initialize before the wrap, so opt_level O1 runs on"
        " torch.amp: torch.autocast(float16) with dynamic loss scaling"
    ]


def test_amp_under_envddp_runs_apex_where_apex_can_run(apex_double: ModuleType) -> None:
    assert trainer(precision="amp-O1").precision_plugin.backend == "apex"


def test_apex_with_lightnings_ddp_points_at_envddp(apex_double: ModuleType) -> None:
    with pytest.raises(PrecisionConfigurationError) as raised:
        trainer(strategy="ddp", devices=1, precision="apex-O1")
    message = str(raised.value)
    assert message.startswith("strategy='DDPStrategy': this strategy wraps the model in DistributedDataParallel")
    assert 'use strategy="envddp"' in message


def test_apex_asks_the_strategy_whether_it_connects_precision_before_its_ddp_wrap(apex_double: ModuleType) -> None:
    class InitializesBeforeTheWrap(DDPStrategy):
        connects_precision_before_wrap = True

    strategy = InitializesBeforeTheWrap()
    assert trainer(strategy=strategy, devices=1, precision="apex-O1").strategy is strategy


def test_the_plugin_hands_its_hooks_to_the_backend_it_was_given(apex_double: ModuleType) -> None:
    assert type(AmpPrecision(backend="apex").amp_backend).__name__ == "ApexAmp"
    assert type(AmpPrecision(backend="native", dtype="bfloat16").amp_backend).__name__ == "NativeAmp"


def test_apex_bfloat16_is_an_error(apex_double: ModuleType) -> None:
    with pytest.raises(PrecisionConfigurationError, match=r"^dtype='bfloat16': apex amp computes in float16 only"):
        AmpPrecision(backend="apex", dtype="bfloat16")


def test_auto_backend_runs_bfloat16_natively_even_with_apex(apex_double: ModuleType) -> None:
    assert AmpPrecision(dtype="bfloat16").backend == "native"


def test_apex_ddp_without_apex_is_an_error(no_apex: None) -> None:
    with pytest.raises(ApexUnavailableError, match=r"^ddp_impl='apex': NVIDIA apex is not installed"):
        EnvDDPStrategy(ddp_impl="apex")


def test_apex_ddp_rejects_torch_ddp_options(apex_double: ModuleType) -> None:
    with pytest.raises(StrategyConfigurationError, match=r"^ddp_impl='apex': find_unused_parameters belong to torch"):
        EnvDDPStrategy(ddp_impl="apex", find_unused_parameters=True)


@pytest.mark.parametrize("option", [{"broadcast_buffers": True}, {"static_graph": False}])
def test_apex_ddp_rejects_torch_ddp_options_even_at_torchs_default(apex_double: ModuleType, option: Any) -> None:
    # torch's defaults differ between releases (broadcast_buffers: True in 2.1, None in 2.13): refused on every one.
    with pytest.raises(StrategyConfigurationError, match=rf"^ddp_impl='apex': {next(iter(option))} belong to torch"):
        EnvDDPStrategy(ddp_impl="apex", **option)


# --- native backend on the CPU --------------------------------------------------------------------------------


@needs_cpu_fp16
def test_native_o1_runs_fp16_autocast_with_a_scaler_on_the_cpu(no_apex: None) -> None:
    model = TwoModels()
    t = fit(model, precision="amp-O1")
    assert model.hidden_dtypes == {torch.float16}
    assert t.precision == "16-mixed"
    state = t.precision_plugin.state_dict()
    assert state["backend"] == "native"
    assert set(state["grad_scaler"]) >= {"scale", "_growth_tracker"}
    assert all(p.dtype == torch.float32 for p in model.parameters())


@needs_cpu_fp16
def test_native_scaler_counts_every_step_without_overflow(no_apex: None) -> None:
    # A scale of 1024 leaves fp16 room: no step overflows, so every step grows the scaler's tracker.
    t = fit(TwoModels(), plugins=[AmpPrecision(backend="native", max_loss_scale=1024.0)])
    assert t.precision_plugin.state_dict()["grad_scaler"]["_growth_tracker"] == t.global_step == 8


def test_native_bfloat16_needs_no_scaler(no_apex: None) -> None:
    model = TwoModels()
    t = fit(model, plugins=[AmpPrecision(dtype="bfloat16")])
    assert model.hidden_dtypes == {torch.bfloat16}
    assert t.precision == "bf16-mixed"
    assert native_scaler(t) is None


def test_native_o0_is_fp32(no_apex: None) -> None:
    model = TwoModels()
    assert fit(model, precision="amp-O0").precision == "32-true"
    assert model.hidden_dtypes == {torch.float32}


@needs_cpu_fp16
def test_native_o3_casts_the_selected_modules_as_apex_would(no_apex: None) -> None:
    model = TwoModels(amp_models=False)
    fit(model, plugins=[AmpPrecision(opt_level="O3", backend="native", models=["model_a"])])
    assert model.model_a[0].weight.dtype == torch.float16
    assert model.model_b.weight.dtype == torch.float32
    assert model.hidden_dtypes == {torch.float32}  # model_a ran in fp16; apex casts its output back to fp32


@needs_cpu_fp16
def test_native_o3_of_the_whole_module_casts_the_batch(no_apex: None) -> None:
    model = TwoModels(amp_models=False)
    assert fit(model, precision="amp-O3").precision == "16-true"
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert model.hidden_dtypes == model.output_dtypes == {torch.float16}


@needs_cpu_fp16
def test_native_cast_model_outputs(no_apex: None) -> None:
    model = TwoModels()
    fit(model, plugins=[AmpPrecision(cast_model_outputs="float32")])
    assert model.hidden_dtypes == {torch.float32}  # the selected modules' outputs, cast back under autocast


@needs_cpu_fp16
def test_native_max_loss_scale_caps_the_scalers_growth(no_apex: None) -> None:
    # The scale starts at the cap, four clean steps short of GradScaler's growth interval (2000): the fifth of
    # the eight steps would double it.
    plugin = AmpPrecision(max_loss_scale=1024.0)
    t = trainer(plugins=[plugin])
    plugin.load_state_dict({"backend": "native", "loss_scalers": [{"loss_scale": 1024.0, "unskipped": 1996}]})
    t.fit(TwoModels(), DataLoader(DATA, batch_size=4))
    assert plugin.state_dict()["loss_scalers"] == [{"loss_scale": 1024.0, "unskipped": 4}]


@needs_cpu_fp16
def test_native_min_loss_scale_floors_the_scaler_after_an_overflow(no_apex: None) -> None:
    t = fit(TwoModels(overflow_at_step=3), plugins=[AmpPrecision(min_loss_scale=256.0, max_loss_scale=256.0)])
    assert native_scaler(t).get_scale() == 256.0  # halved by the overflow, then floored
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 7


@needs_cpu_fp16
def test_native_runs_under_lightnings_own_ddp(no_apex: None) -> None:

    model = TwoModels()
    try:
        t = fit(model, strategy="ddp", devices=1, precision="amp-O1")
    finally:
        destroy_process_group()
    assert model.hidden_dtypes == {torch.float16}
    assert t.global_step == 8


def test_lbfgs_works_where_nothing_is_scaled(no_apex: None) -> None:
    class WithLBFGS(TwoModels):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    assert fit(WithLBFGS(), precision="amp-O0").global_step == 8


@needs_cpu_fp16
def test_lbfgs_with_loss_scaling_is_an_error(no_apex: None) -> None:
    class WithLBFGS(TwoModels):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    with pytest.raises(PrecisionConfigurationError, match=r"^optimizer='LBFGS': LBFGS re-evaluates its closure"):
        fit(WithLBFGS(), precision="amp-O1")


@needs_cpu_fp16
def test_native_overflow_skips_the_step_and_holds_the_schedule(no_apex: None) -> None:
    model = TwoModels(overflow_at_step=3)
    t = fit(model, plugins=[AmpPrecision(max_loss_scale=256.0)])
    scheduler = t.lr_scheduler_configs[0].scheduler
    assert t.global_step == 8
    assert scheduler.last_epoch == 7  # 8 steps, one skipped on overflow
    assert native_scaler(t).get_scale() == 128.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


@needs_cpu_fp16
def test_native_scaler_state_survives_a_checkpoint(no_apex: None, tmp_path: Path) -> None:
    t = fit(TwoModels(overflow_at_step=1), plugins=[AmpPrecision(max_loss_scale=256.0)])
    t.save_checkpoint(tmp_path / "amp.ckpt")
    saved = torch.load(tmp_path / "amp.ckpt", weights_only=False)["AmpPrecision"]
    assert saved["grad_scaler"]["scale"] == 128.0
    resumed = trainer(max_epochs=2, plugins=[AmpPrecision(max_loss_scale=256.0)])
    restored: dict[str, Any] = {}

    class Probe(TwoModels):
        def on_train_start(self) -> None:
            restored.update(self.trainer.precision_plugin.state_dict())

    resumed.fit(Probe(), DataLoader(DATA, batch_size=4), ckpt_path=tmp_path / "amp.ckpt")
    assert restored["grad_scaler"] == saved["grad_scaler"]


def test_a_foreign_precision_state_is_a_clear_error(no_apex: None) -> None:
    with pytest.raises(PrecisionConfigurationError, match=r"^checkpoint=\['scale'\]: .*not written by AmpPrecision"):
        AmpPrecision().load_state_dict({"scale": 2.0})


# --- apex backend, with the test double -----------------------------------------------------------------------


def events(amp: ModuleType, kind: str) -> list[dict[str, Any]]:
    return [e for e in amp.events if e["event"] == kind]


#: The double computes in fp16 as apex does: from apex's initial scale of 2**16, TwoModels' first gradients
#: overflow. A ceiling of 1024 leaves fp16 room, so only the overflows a test injects skip steps.
NO_NATURAL_OVERFLOW = {"max_loss_scale": 1024.0}


def fresh_apex_double(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A new copy of the apex double, for a second amp.initialize in this process (lightning_ddp_amp allows one
    per copy), with torch unpatched from the last copy's O1 first."""
    import apex.amp

    apex.amp.unpatch_torch_for_tests()
    _forget_apex(monkeypatch)
    import apex.amp as amp

    return amp


@needs_cpu_fp16
def test_initialize_gets_the_sub_models_and_the_one_optimizer(apex_double: ModuleType) -> None:
    fit(TwoModels(), precision="apex-O1")
    (initialize,) = events(apex_double, "initialize")
    assert initialize["models"] == ["Sequential", "Linear"]
    assert initialize["optimizers"] == ["SGD"]
    assert initialize["opt_level"] == "O1"


@needs_cpu_fp16
def test_models_can_be_named_on_the_plugin(apex_double: ModuleType) -> None:
    fit(TwoModels(amp_models=False), plugins=[AmpPrecision(backend="apex", models=["model_b", "model_a"])])
    assert events(apex_double, "initialize")[0]["models"] == ["Linear", "Sequential"]


@needs_cpu_fp16
def test_default_is_the_lightning_module(apex_double: ModuleType) -> None:
    fit(TwoModels(amp_models=False), precision="apex-O1")
    assert events(apex_double, "initialize")[0]["models"] == ["TwoModels"]


def test_unknown_model_name_lists_the_children(apex_double: ModuleType) -> None:
    with pytest.raises(PrecisionConfigurationError) as raised:
        fit(TwoModels(amp_models=False), plugins=[AmpPrecision(backend="apex", models=["encoder"])])
    assert str(raised.value).startswith("models='encoder': TwoModels has no sub-module of that name")
    assert "model_a, model_b" in str(raised.value)


def test_both_model_sources_conflict(apex_double: ModuleType) -> None:
    with pytest.raises(PrecisionConfigurationError, match=r"^models=\['model_a'\]: TwoModels also defines"):
        fit(TwoModels(), plugins=[AmpPrecision(backend="apex", models=["model_a"])])


@needs_cpu_fp16
def test_amp_initialize_options_reach_apex(apex_double: ModuleType) -> None:
    plugin = AmpPrecision(
        opt_level="O2",
        backend="apex",
        keep_batchnorm_fp32=True,
        loss_scale=128.0,
        num_losses=2,
        min_loss_scale=1.0,
        max_loss_scale=4096.0,
        cast_model_outputs="float32",
    )
    fit(TwoModels(), plugins=[plugin])
    (initialize,) = events(apex_double, "initialize")
    assert {k: initialize[k] for k in ("opt_level", "keep_batchnorm_fp32", "loss_scale", "num_losses")} == {
        "opt_level": "O2",
        "keep_batchnorm_fp32": True,
        "loss_scale": 128.0,
        "num_losses": 2,
    }
    assert (initialize["min_loss_scale"], initialize["max_loss_scale"]) == (1.0, 4096.0)
    assert initialize["cast_model_outputs"] == "torch.float32"


@needs_cpu_fp16
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_every_backward_runs_inside_scale_loss_and_steps_take_no_closure(apex_double: ModuleType, level: str) -> None:
    # The double's O2 optimizer.step() rejects a closure, as apex's does.
    t = fit(TwoModels(), precision=f"apex-{level}")
    assert apex_double.backward_outside_scale_loss() == 0
    assert len(events(apex_double, "scale_loss")) == t.global_step == 8


@needs_cpu_fp16
def test_gradient_accumulation_delays_unscaling_until_the_last_micro_batch(apex_double: ModuleType) -> None:
    t = fit(TwoModels(), precision="apex-O1", accumulate_grad_batches=2)
    assert [e["delay_unscale"] for e in events(apex_double, "scale_loss")] == [True, False] * 4
    assert t.global_step == 4


def apex_loop_with_two_losses(amp: ModuleType) -> tuple[TwoModels, set[torch.dtype]]:
    """TwoModels(manual_losses=2)'s training, written by hand with apex's API (O1, two loss scalers), no Lightning.

    Returns the trained module and the dtypes its hidden layer produced.
    """
    module = TwoModels(manual_losses=2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    [model_a, model_b], optimizer = amp.initialize(
        [module.model_a, module.model_b], optimizer, opt_level="O1", num_losses=2, verbosity=0
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    hidden_dtypes = set()
    for x, y in DataLoader(DATA, batch_size=4):
        optimizer.zero_grad()
        hidden = model_a(x)
        hidden_dtypes.add(hidden.dtype)
        loss = torch.nn.functional.mse_loss(model_b(hidden).float(), y.float())
        for loss_id in (0, 1):
            with amp.scale_loss(loss / (loss_id + 1), optimizer, loss_id=loss_id) as scaled:
                scaled.backward(retain_graph=loss_id == 0)
        skipped = optimizer._amp_stash.already_patched  # apex's one-call skip after an overflow
        optimizer.step()
        if not skipped:
            scheduler.step()
    return module, hidden_dtypes


@needs_cpu_fp16
def test_manual_optimization_with_two_losses_matches_apex_by_hand(
    apex_double: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = TwoModels(manual_losses=2)
    fit(model, plugins=[AmpPrecision(backend="apex", num_losses=2)])
    assert [e["loss_id"] for e in events(apex_double, "scale_loss")] == [0, 1] * 8
    assert apex_double.backward_outside_scale_loss() == 0
    reference, reference_dtypes = apex_loop_with_two_losses(fresh_apex_double(monkeypatch))
    assert model.hidden_dtypes == reference_dtypes == {torch.float16}
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert (mine - theirs).abs().max().item() <= 1e-6


@needs_cpu_fp16
def test_an_overflow_in_one_of_two_losses_still_skips_the_step(apex_double: ModuleType) -> None:
    model = TwoModels(manual_losses=2, overflow_at_step=3, overflow_loss_id=0)
    t = fit(model, plugins=[AmpPrecision(backend="apex", num_losses=2, **NO_NATURAL_OVERFLOW)])
    assert len(events(apex_double, "skipped_step")) == 1
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == t.global_step - 1


@needs_cpu_fp16
def test_a_loss_id_beyond_num_losses_is_an_error(apex_double: ModuleType) -> None:
    with pytest.raises(PrecisionConfigurationError, match=r"^loss_id=1: AmpPrecision has num_losses=1 loss scaler"):
        fit(TwoModels(manual_losses=2), precision="apex-O1")


@needs_cpu_fp16
def test_manual_backward_can_name_its_optimizers(apex_double: ModuleType) -> None:
    class TwoOptimizers(TwoModels):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt_a, opt_b = self.optimizers()
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.model_b(self.model_a(x)), y)
            self.manual_backward(loss, optimizers=[opt_a])
            opt_a.step()
            opt_a.zero_grad()
            opt_b.zero_grad()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.model_a.parameters(), lr=0.1), torch.optim.SGD(
                self.model_b.parameters(), lr=0.1
            )

    model = TwoOptimizers()
    model.automatic_optimization = False
    fit(model, precision="apex-O1")
    assert {e["optimizers"] for e in events(apex_double, "scale_loss")} == {1}


def test_static_loss_scale_of_one_never_reads_as_a_skip(apex_double: ModuleType) -> None:
    # apex takes a short cut for O0 (static scale 1): nothing is unscaled or checked, nothing is skipped.
    t = fit(TwoModels(), precision="apex-O0")
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == t.global_step == 8


@needs_cpu_fp16
def test_configure_amp_models_may_return_one_module(apex_double: ModuleType) -> None:
    model = TwoModels(amp_models=False)
    model.configure_amp_models = lambda: model.model_a
    fit(model, precision="apex-O1")
    assert events(apex_double, "initialize")[0]["models"] == ["Sequential"]


def test_apex_o2_of_the_whole_module_casts_the_batch(apex_double: ModuleType) -> None:
    # apex O2/O3 cast the module and patch its forward, which Lightning never calls: the batch is cast instead.
    plugin = AmpPrecision(opt_level="O2", backend="apex")
    model = TwoModels(amp_models=False)
    plugin.connect(model, [torch.optim.SGD(model.parameters(), lr=0.1)], [])
    batch = plugin.convert_input((torch.ones(2, 8), torch.arange(2)))
    assert (batch[0].dtype, batch[1].dtype) == (torch.float16, torch.int64)


@pytest.mark.parametrize("wrapper", ["torch", "apex"])
def test_apex_refuses_a_model_wrapped_in_ddp_before_amp_initialize(apex_double: ModuleType, wrapper: str) -> None:
    # What a strategy that wraps first hands over: the wrapper, not the LightningModule (built without a process group).
    import apex.parallel  # the double's, beside the apex.amp the fixture imported

    ddp = torch.nn.parallel.DistributedDataParallel if wrapper == "torch" else apex.parallel.DistributedDataParallel
    wrapped = ddp.__new__(ddp)
    torch.nn.Module.__init__(wrapped)
    wrapped.module = TwoModels()
    plugin = AmpPrecision(backend="apex")
    with pytest.raises(
        PrecisionConfigurationError, match=r"^strategy='DistributedDataParallel': the model reached the"
    ):
        plugin.connect(wrapped, [torch.optim.SGD(wrapped.parameters(), lr=0.1)], [])
    assert events(apex_double, "initialize") == []


def test_apex_state_before_initialize_waits_for_it(apex_double: ModuleType) -> None:
    plugin = AmpPrecision(backend="apex")
    assert plugin.state_dict() == {"backend": "apex", "opt_level": "O1", "loss_scalers": []}
    plugin.load_state_dict(
        {"backend": "apex", "opt_level": "O1", "loss_scalers": [{"loss_scale": 8.0, "unskipped": 3}]}
    )
    model = TwoModels()
    plugin.connect(model, [torch.optim.SGD(model.parameters(), lr=0.1)], [])
    assert apex_double.state_dict()["loss_scaler0"] == {"loss_scale": 8.0, "unskipped": 3}


@needs_cpu_fp16
def test_o2_momentum_restored_from_a_checkpoint_is_fp32_on_the_master_weights(
    apex_double: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # apex builds O2's fp32 master weights at the first backward. Lightning restores the optimizer before that,
    # so unless the plugin builds them at once, the momentum lands on the fp16 params and is rounded to fp16.
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last")
    plugin = AmpPrecision(opt_level="O2", backend="apex")
    fit(TwoModels(), plugins=[plugin], callbacks=[checkpoint], enable_checkpointing=True)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    fresh_apex_double(monkeypatch)
    restored: dict[str, Any] = {}

    class Probe(TwoModels):
        def on_train_start(self) -> None:
            optimizer = self.trainer.optimizers[0]
            restored["params"] = [p for group in optimizer.param_groups for p in group["params"]]
            # Cloned: the epoch that follows updates the buffers in place.
            restored["state"] = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
            restored["model"] = list(self.parameters())

    resumed = trainer(max_epochs=2, plugins=[AmpPrecision(opt_level="O2", backend="apex")])
    resumed.fit(Probe(), DataLoader(DATA, batch_size=4), ckpt_path=tmp_path / "last.ckpt")
    masters = restored["params"]
    assert {p.dtype for p in masters} == {torch.float32}
    assert not any(m is p for m in masters for p in restored["model"])
    assert set(restored["state"]) == {id(m) for m in masters}
    for index, master in enumerate(masters):
        buffer = restored["state"][id(master)]["momentum_buffer"]
        assert buffer.dtype == torch.float32
        assert torch.equal(buffer, saved[index]["momentum_buffer"])


@needs_cpu_fp16
def test_o2_resume_restores_the_fp32_master_weights_not_their_fp16_copies(
    apex_double: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # apex's own checkpoint has only the fp16-rounded weights: rebuilt from them, the masters lose their low bits.
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last")
    first = fit(
        TwoModels(),
        plugins=[AmpPrecision(opt_level="O2", backend="apex")],
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    saved = [p.detach().clone() for p in apex_double.master_params(first.optimizers[0])]
    assert any(not torch.equal(p, p.half().float()) for p in saved)
    fresh_apex_double(monkeypatch)
    restored: list[torch.Tensor] = []

    class Probe(TwoModels):
        def on_train_start(self) -> None:
            restored.extend(
                p.detach().clone() for group in self.trainer.optimizers[0].param_groups for p in group["params"]
            )

    resumed = trainer(max_epochs=2, plugins=[AmpPrecision(opt_level="O2", backend="apex")])
    resumed.fit(Probe(), DataLoader(DATA, batch_size=4), ckpt_path=tmp_path / "last.ckpt")
    assert len(restored) == len(saved)
    for mine, theirs in zip(restored, saved, strict=True):
        assert torch.equal(mine, theirs)


def test_o2_master_weights_of_another_model_are_a_clear_error(apex_double: ModuleType) -> None:
    plugin = AmpPrecision(opt_level="O2", backend="apex")
    plugin.load_state_dict({"backend": "apex", "loss_scalers": [], "master_weights": [torch.zeros(3)]})
    model = TwoModels()
    with pytest.raises(PrecisionConfigurationError, match=r"^checkpoint='1 master weights': they do not fit"):
        plugin.connect(model, [torch.optim.SGD(model.parameters(), lr=0.1)], [])


def skip_aware_step_lr() -> Any:
    from lightning_ddp_amp.trainer.skip_aware_scheduler import SkipAwareScheduler

    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    return SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), lambda _: False)


def test_skip_aware_scheduler_sets_attributes_on_the_wrapped_scheduler() -> None:
    scheduler = skip_aware_step_lr()
    scheduler.gamma = 0.25
    assert scheduler.scheduler.gamma == 0.25


# torch's check that optimizer.step() ran first cannot follow a deep-copied optimizer: it warns on any copy.
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_a_deep_copy_of_a_skip_aware_scheduler_steps_and_changes_on_its_own() -> None:
    scheduler = skip_aware_step_lr()
    duplicate = copy.deepcopy(scheduler)
    duplicate.step()
    duplicate.gamma = 0.25
    assert type(duplicate) is type(scheduler)
    assert (duplicate.last_epoch, duplicate.get_last_lr(), duplicate.gamma) == (1, [0.5], 0.25)
    assert (scheduler.last_epoch, scheduler.get_last_lr(), scheduler.gamma) == (0, [1.0], 0.5)


def test_a_shallow_copy_of_a_skip_aware_scheduler_forwards_to_the_same_scheduler() -> None:
    scheduler = skip_aware_step_lr()
    duplicate = copy.copy(scheduler)
    duplicate.optimizer.step()
    duplicate.step()
    assert type(duplicate) is type(scheduler)
    assert duplicate.scheduler is scheduler.scheduler
    assert (duplicate.gamma, duplicate.last_epoch, scheduler.last_epoch) == (0.5, 1, 1)


@needs_cpu_fp16
def test_apex_overflow_skips_the_step_and_holds_the_schedule(apex_double: ModuleType) -> None:
    model = TwoModels(overflow_at_step=3)
    t = fit(model, plugins=[AmpPrecision(backend="apex", **NO_NATURAL_OVERFLOW)])
    assert len(events(apex_double, "skipped_step")) == 1
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == t.global_step - 1
    assert t.precision_plugin.state_dict()["loss_scalers"] == [{"loss_scale": 512.0, "unskipped": 4}]
    assert all(torch.isfinite(p).all() for p in model.parameters())


@needs_cpu_fp16
def test_gradient_clipping_clips_the_fp32_master_gradients(apex_double: ModuleType) -> None:
    # Under O2 the optimizer steps fp32 masters with their own gradients; clipping the fp16 model's gradients
    # (scaled, and not what the step uses) would leave the masters' gradients as they were.
    norms: list[tuple[float, float]] = []

    class Clipped(TwoModels):
        def configure_gradient_clipping(
            self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
        ) -> None:
            masters = [p for group in optimizer.param_groups for p in group["params"]]
            assert all(m.dtype == torch.float32 for m in masters)
            assert not any(m is p for m in masters for p in self.parameters())
            before = torch.cat([m.grad.flatten() for m in masters]).norm().item()
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            norms.append((before, torch.cat([m.grad.flatten() for m in masters]).norm().item()))

    clip = 0.05
    plugin = AmpPrecision(opt_level="O2", backend="apex", **NO_NATURAL_OVERFLOW)
    t = fit(Clipped(), plugins=[plugin], gradient_clip_val=clip)
    assert len(norms) == t.global_step == 8
    assert all(before > clip for before, _ in norms)  # every step had something to clip
    assert all(after <= clip * (1 + 1e-6) for _, after in norms)


class ClippingRecorder(TwoModels):
    """Records the norm of every gradient before and after Lightning's clipping, at each step."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[tuple[float, float]] = []

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        before = torch.cat([p.grad.flatten() for p in self.parameters()]).norm().item()
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms.append((before, torch.cat([p.grad.flatten() for p in self.parameters()]).norm().item()))


@needs_cpu_fp16
def test_native_gradient_clipping_clips_the_unscaled_gradients(no_apex: None) -> None:
    # Until GradScaler.unscale_ they are the loss scale times the true gradients: clipped then, the step would get
    # gradients the scale times smaller than the clip asked for.
    clip = 0.05
    fp32, native = ClippingRecorder(), ClippingRecorder()
    fit(fp32, gradient_clip_val=clip)
    fit(native, plugins=[AmpPrecision(backend="native", max_loss_scale=1024.0)], gradient_clip_val=clip)
    assert native.norms[0][0] == pytest.approx(fp32.norms[0][0], rel=0.01)  # the same first step, in fp16
    assert all(before > clip for before, _ in native.norms)  # every step had something to clip
    assert all(after <= clip * (1 + 1e-6) for _, after in native.norms)


@needs_cpu_fp16
def test_a_second_fit_in_the_same_process_is_a_clear_error_naming_the_fit(apex_double: ModuleType) -> None:
    fit(TwoModels(), precision="apex-O1")
    with pytest.raises(
        PrecisionConfigurationError,
        match=r"^backend='apex': trainer\.fit would call amp\.initialize again, but an earlier trainer\.fit in this"
        r" process initialized apex amp.*Fix: start each fit in a new process",
    ):
        fit(TwoModels(), precision="apex-O1")


class Evaluated(TwoModels):
    """TwoModels that also validates, tests and predicts, recording the dtypes of model_a's weights and output."""

    def __init__(self, amp_models: bool = True) -> None:
        super().__init__(amp_models=amp_models)
        self.seen: dict[str, set[tuple[torch.dtype, torch.dtype]]] = {}

    def evaluation_step(self, stage: str, batch: Any) -> torch.Tensor:
        hidden = self.model_a(batch[0])
        self.seen.setdefault(stage, set()).add((self.model_a[0].weight.dtype, hidden.dtype))
        return self.model_b(hidden).float()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.evaluation_step("validate", batch), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", torch.nn.functional.mse_loss(self.evaluation_step("test", batch), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.evaluation_step("predict", batch)


@needs_cpu_fp16
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_evaluation_after_fit_runs_the_amp_initialized_model_without_initializing_again(
    apex_double: ModuleType, level: str
) -> None:
    model = Evaluated()
    t = fit(model, precision=f"apex-{level}")
    loader = DataLoader(DATA, batch_size=4)
    (validated,) = t.validate(model, loader, verbose=False)
    (tested,) = t.test(model, loader, verbose=False)
    predictions = t.predict(model, loader)
    assert len(events(apex_double, "initialize")) == 1
    assert validated["val_loss"] == pytest.approx(tested["test_loss"])
    assert torch.isfinite(torch.cat(predictions)).all()
    # O1 computes the linear layers in fp16 on fp32 weights; O2/O3 keep the sub-models in fp16, their outputs cast
    # to fp32 by the forward amp.initialize patched.
    weights_output = (torch.float32, torch.float16) if level == "O1" else (torch.float16, torch.float32)
    assert model.seen == {stage: {weights_output} for stage in ("validate", "test", "predict")}


class SharedWeights(TwoModels):
    """model_a used twice before one backward, as a GAN's discriminator on real and fake data is."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.model_a(x) + self.model_a(2 * x)
        return torch.nn.functional.mse_loss(self.model_b(hidden).float(), y.float())


@needs_cpu_fp16
def test_apex_o1_trains_a_weight_used_twice_a_step_past_apexs_weight_cast_cache(apex_double: ModuleType) -> None:
    # apex 25.05's cache check read grad_fn.next_functions[1] and failed with IndexError (NVIDIA/apex#1228).
    t = fit(SharedWeights(), precision="apex-O1")
    assert t.global_step == 8
    assert all(torch.isfinite(p).all() for p in t.lightning_module.parameters())


class Transformer(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.encoder = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_out", self.encoder(self.embed(batch[0].reshape(-1, 2, 8))).float().mean())


@needs_cpu_fp16
def test_a_transformer_evaluates_after_an_apex_o1_fit_off_torchs_fused_fast_path(
    apex_double: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    # Under O1 the fused kernel met fp16 activations beside fp32 weights: "expected m1 and m2 to have the same dtype".
    with caplog.at_level(logging.INFO):
        t = fit(TwoModels(), precision="apex-O1")
    said = [r.getMessage() for r in caplog.records if "fast path" in r.getMessage()]
    assert len(said) == 1 and "torch.backends.mha.set_fastpath_enabled(False)" in said[0]
    (validated,) = t.validate(Transformer().eval(), DataLoader(DATA, batch_size=4), verbose=False)
    assert math.isfinite(validated["val_out"])
    assert not torch.backends.mha.get_fastpath_enabled()


@needs_cpu_fp16
def test_a_transformer_under_apex_o1_on_a_torch_without_the_fast_path_switch_is_refused_naming_the_fix(
    apex_double: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on torch 2.1 and 2.2 (named by its path: the native backend's tests run without the apex module).
    monkeypatch.setattr("lightning_ddp_amp.amp.apex_o1._attention_fast_path_switch", lambda: None)
    t = fit(TwoModels(), precision="apex-O1")
    with pytest.raises(
        PrecisionConfigurationError,
        match=r"^torch='.*': in eval mode encoder runs torch's fused attention kernel, which apex O1's fp16"
        r" activations break.*Fix: install torch 2\.3 or later",
    ):
        t.validate(Transformer(), DataLoader(DATA, batch_size=4), verbose=False)


@needs_cpu_fp16
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_apex_levels_that_patch_no_torch_function_leave_the_fast_path_on(apex_double: ModuleType, level: str) -> None:
    fit(TwoModels(), precision=f"apex-{level}")
    assert torch.backends.mha.get_fastpath_enabled()


@needs_cpu_fp16
def test_a_new_trainer_evaluates_the_model_an_o2_fit_cast_whole_with_its_batch_cast(apex_double: ModuleType) -> None:
    model = Evaluated(amp_models=False)
    fit(model, precision="apex-O2")
    trainer(precision="apex-O2").validate(model, DataLoader(DATA, batch_size=4), verbose=False)
    assert model.seen == {"validate": {(torch.float16, torch.float16)}}


@needs_cpu_fp16
@pytest.mark.parametrize("amp_models", [True, False], ids=["sub-models", "whole-module"])
def test_evaluating_another_model_after_an_o2_fit_runs_it_as_built(apex_double: ModuleType, amp_models: bool) -> None:
    # The whole module's batch is cast to fp16 for the model amp.initialize cast, not for another one.
    t = fit(Evaluated(amp_models), precision="apex-O2")
    other = Evaluated(amp_models)
    t.validate(other, DataLoader(DATA, batch_size=4), verbose=False)
    assert other.seen == {"validate": {(torch.float32, torch.float32)}}


def test_a_native_checkpoint_carries_its_loss_scale_to_apex(apex_double: ModuleType) -> None:
    plugin = AmpPrecision(backend="apex")
    model = TwoModels()
    plugin.connect(model, [torch.optim.SGD(model.parameters(), lr=0.1)], [])
    plugin.load_state_dict({"backend": "native", "loss_scalers": [{"loss_scale": 512.0, "unskipped": 7}]})
    assert apex_double.state_dict()["loss_scaler0"] == {"loss_scale": 512.0, "unskipped": 7}


def native_scaler(trainer: L.Trainer) -> Any:
    """The GradScaler of the Trainer's native AmpPrecision backend (None where it scales nothing)."""
    backend = trainer.precision_plugin.amp_backend
    assert isinstance(backend, NativeAmp)
    return backend.scaler


class AdamTwoModels(TwoModels):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3, eps=self.eps)


@needs_cpu_fp16
@pytest.mark.parametrize("backend", ["apex", "native"])
def test_o3_refuses_an_eps_that_rounds_to_zero_in_float16_naming_the_optimizer_and_the_fix(
    apex_double: ModuleType, backend: str
) -> None:
    with pytest.raises(
        PrecisionConfigurationError,
        match=r"^eps=1e-08: opt_level O3 steps the float16 weights themselves, where Adam's eps rounds to 0.*"
        r"Fix: pass Adam\(\.\.\., eps=1e-4\)",
    ):
        fit(AdamTwoModels(eps=1e-8), plugins=[AmpPrecision(opt_level="O3", backend=backend)])


@needs_cpu_fp16
def test_o3_leaves_the_eps_of_an_optimizer_over_modules_it_does_not_cast_alone(apex_double: ModuleType) -> None:
    model = AdamTwoModels(eps=1e-8)
    model.configure_amp_models = lambda: [model.model_b]
    model.configure_optimizers = lambda: [  # type: ignore[method-assign]
        torch.optim.SGD(model.model_b.parameters(), lr=0.1),
        torch.optim.Adam(model.model_a.parameters(), lr=1e-3, eps=1e-8),  # model_a stays fp32
    ]
    plugin = AmpPrecision(opt_level="O3", backend="apex")
    plugin.connect(model, model.configure_optimizers(), [])
    assert next(model.model_a.parameters()).dtype == torch.float32


@needs_cpu_fp16
@pytest.mark.parametrize(("level", "eps"), [("O3", 1e-4), ("O2", 1e-8)])
def test_an_eps_float16_holds_or_fp32_master_weights_train_adam(
    apex_double: ModuleType, level: str, eps: float
) -> None:
    t = fit(AdamTwoModels(eps=eps), plugins=[AmpPrecision(opt_level=level, backend="apex")])
    assert t.global_step == 8


def test_fabrics_messages_name_the_backend_that_runs_a_plugin_left_to_choose(apex_double: ModuleType) -> None:
    fabric = Fabric(strategy="envddp", plugins=[FabricAmpPrecision("O3")], accelerator="cpu")
    fabric.launch()
    with pytest.raises(PrecisionConfigurationError) as raised:
        fabric.setup_module(torch.nn.Linear(8, 1))
    assert "under precision 'apex-O3' amp.initialize needs the model together with its optimizer" in str(raised.value)


# --- apex's registration API (a function on none of O1's lists) ---------------------------------------------------


class EinsumModel(L.LightningModule):
    """A Linear, then ``torch.einsum`` with an fp32 parameter: einsum is on none of apex O1's lists."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.mix = torch.nn.Parameter(torch.randn(4, 1))
        self.dtypes: list[torch.dtype] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = torch.einsum("bi,ij->bj", self.linear(x), self.mix)
        self.dtypes.append(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@needs_cpu_fp16
def test_a_function_on_none_of_apex_o1s_lists_meets_fp16_and_fp32_and_fails_as_in_apex(
    apex_double: ModuleType,
) -> None:
    with pytest.raises(RuntimeError, match=r"expected scalar type (Half but found Float|Float but found Half)"):
        fit(EinsumModel(), precision="apex-O1", max_steps=1)


@needs_cpu_fp16
@pytest.mark.parametrize(
    ("register", "computes_in"),
    [
        ("register_promote_function", torch.float32),
        ("register_float_function", torch.float32),
        ("register_half_function", torch.float16),
    ],
)
def test_apex_registration_before_fit_takes_effect_under_apex_o1(
    apex_double: ModuleType, register: str, computes_in: torch.dtype
) -> None:
    getattr(apex_double, register)(torch, "einsum")
    model = EinsumModel()
    fit(model, precision="apex-O1", max_steps=2)
    assert model.dtypes == [computes_in, computes_in]


# --- RNNs under apex O1 (the 2-rank equivalence is test_apex_reference.py's) ------------------------------------


class LinearThenLSTM(L.LightningModule):
    """A Linear feeding an LSTM, which gets its input by keyword: O1 makes the Linear's output fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.lstm = torch.nn.LSTM(8, 4, batch_first=True)
        self.dtypes: list[torch.dtype] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out, _ = self.lstm(input=self.linear(x).unsqueeze(1))
        self.dtypes.append(out.dtype)
        return torch.nn.functional.mse_loss(out[:, -1, :1].float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@needs_cpu_fp16
def test_an_lstm_given_o1s_fp16_activation_by_keyword_trains_in_fp16_and_the_fix_is_said_once(
    apex_double: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    model = LinearThenLSTM()
    with caplog.at_level(logging.INFO):
        fit(model, precision="apex-O1", max_steps=2)
    assert model.dtypes == [torch.float16, torch.float16]
    said = [r.getMessage() for r in caplog.records if "apex O1 runs RNNs in fp16" in r.getMessage()]
    assert len(said) <= 1  # once a process: an earlier test in this process may have said it
