"""EnvDDPStrategy's DDP options decided against the precision plugin: what apex O2 / O3 and native O3 need from DDP.

apex O2's ``optimizer.zero_grad()`` detaches each model gradient in place, which torch refuses on DDP's bucket
views; O2 / O3 models already have half-precision gradients, which compression hooks cannot compress further.
The two-rank run that proves the bucket-view default is ``test_apex_reference.py``'s O2 pair under torch DDP.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp import AmpPrecision, EnvDDPStrategy, PrecisionConfigurationError, StrategyConfigurationError


def trainer(**kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(accelerator="cpu", logger=False, enable_progress_bar=False, max_epochs=1)
    options.update(kwargs)
    return L.Trainer(**options)


@pytest.mark.parametrize(("precision", "bucket_view"), [("apex-O1", True), ("apex-O2", False), ("apex-O3", True)])
def test_gradients_are_bucket_views_unless_apex_keeps_master_weights(
    apex_double: ModuleType, precision: str, bucket_view: bool
) -> None:
    strategy = trainer(strategy="envddp", precision=precision).strategy
    assert isinstance(strategy, EnvDDPStrategy)
    assert strategy.ddp_options.get("gradient_as_bucket_view", False) is bucket_view


def test_native_amp_keeps_bucket_views(no_apex: None) -> None:
    strategy = trainer(strategy="envddp", precision="amp-O2").strategy
    assert isinstance(strategy, EnvDDPStrategy)
    assert strategy.ddp_options == {"gradient_as_bucket_view": True}


def test_bucket_views_asked_for_under_apex_o2_name_both_settings_and_the_fix(apex_double: ModuleType) -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        trainer(strategy=EnvDDPStrategy(gradient_as_bucket_view=True), precision="apex-O2")
    message = str(raised.value)
    assert message.startswith("gradient_as_bucket_view=True: under AmpPrecision(backend='apex', opt_level='O2')")
    assert "param.grad.detach_()" in message
    assert "Fix: drop gradient_as_bucket_view=True" in message


def test_bucket_views_turned_off_by_hand_are_fine_under_apex_o2(apex_double: ModuleType) -> None:
    strategy = trainer(strategy=EnvDDPStrategy(gradient_as_bucket_view=False), precision="apex-O2").strategy
    assert isinstance(strategy, EnvDDPStrategy)
    assert "gradient_as_bucket_view" not in strategy.ddp_options


@pytest.mark.parametrize(
    ("strategy_options", "field", "value"),
    [
        ({"ddp_comm_hook": "fp16"}, "ddp_comm_hook", "fp16"),
        ({"ddp_comm_hook": "bf16"}, "ddp_comm_hook", "bf16"),
        ({"ddp_comm_wrapper": default_hooks.bf16_compress_wrapper}, "ddp_comm_wrapper", "bf16"),
    ],
)
@pytest.mark.parametrize("precision", ["apex-O2", "apex-O3"])
def test_compressing_half_precision_gradients_is_an_error(
    apex_double: ModuleType, precision: str, strategy_options: dict[str, Any], field: str, value: str
) -> None:
    if field == "ddp_comm_wrapper":
        strategy_options = {**strategy_options, "ddp_comm_hook": default_hooks.allreduce_hook}
    with pytest.raises(StrategyConfigurationError) as raised:
        trainer(strategy=EnvDDPStrategy(**strategy_options), precision=precision)
    message = str(raised.value)
    assert message.startswith(f"{field}='{value}': under AmpPrecision(backend='apex', opt_level='{precision[-2:]}')")
    assert "the model's gradients are already float16" in message
    assert ("compresses nothing" in message) is (value == "fp16")
    assert f"Fix: drop {field}" in message


def test_compressing_native_o3_bfloat16_gradients_is_an_error(no_apex: None) -> None:
    plugin = AmpPrecision(opt_level="O3", backend="native", dtype="bfloat16")
    with pytest.raises(StrategyConfigurationError, match=r"^ddp_comm_hook='fp16': .*already bfloat16.*round them"):
        trainer(strategy=EnvDDPStrategy(ddp_comm_hook="fp16"), plugins=[plugin])


def test_compression_hooks_are_fine_where_apex_keeps_fp32_gradients(apex_double: ModuleType) -> None:
    strategy = trainer(strategy=EnvDDPStrategy(ddp_comm_hook="fp16"), precision="apex-O1").strategy
    assert strategy._ddp_comm_hook is default_hooks.fp16_compress_hook  # type: ignore[attr-defined]


def test_compression_hooks_are_fine_under_native_o2(no_apex: None) -> None:
    strategy = trainer(strategy=EnvDDPStrategy(ddp_comm_hook="bf16"), precision="amp-O2").strategy
    assert strategy._ddp_comm_hook is default_hooks.bf16_compress_hook  # type: ignore[attr-defined]


class ZeroGradSetToNone(L.LightningModule):
    """Overrides ``optimizer_zero_grad`` as torch code often does: ``zero_grad(set_to_none=...)``."""

    def __init__(self, set_to_none: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.set_to_none = set_to_none

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).float().pow(2).mean()

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=self.set_to_none)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model: L.LightningModule, precision: str) -> L.Trainer:
    t = trainer(strategy="envddp", precision=precision, enable_checkpointing=False, enable_model_summary=False)
    t.fit(model, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    return t


def test_zero_grad_set_to_none_under_apex_o2_explains_itself(apex_double: ModuleType) -> None:
    with pytest.raises(PrecisionConfigurationError) as raised:
        fit(ZeroGradSetToNone(set_to_none=True), "apex-O2")
    message = str(raised.value)
    assert message.startswith("set_to_none=True: apex O2's optimizer.zero_grad() takes no set_to_none")
    assert "Fix: call optimizer.zero_grad()" in message


def test_zero_grad_set_to_none_false_under_apex_o2_zeroes_through_apex(apex_double: ModuleType) -> None:
    assert fit(ZeroGradSetToNone(set_to_none=False), "apex-O2").global_step == 4


def test_zero_grad_set_to_none_under_apex_o1_is_torchs(apex_double: ModuleType) -> None:
    assert fit(ZeroGradSetToNone(set_to_none=True), "apex-O1").global_step == 4
    assert not dist.is_initialized()
