"""EnvDDPStrategy's DDP options decided against the precision plugin: what apex O2 / O3 and native O3 need from DDP.

apex O2's ``optimizer.zero_grad()`` detaches each model gradient in place, which torch refuses on DDP's bucket
views; O2 / O3 models already have half-precision gradients, which compression hooks cannot compress further.
The two-rank run that proves the bucket-view default is ``test_apex_reference.py``'s O2 pair under torch DDP; here
the strategy builds its DDP wrapper inside a one-rank process group of the test's own process.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from conftest import needs_cpu_fp16
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp import AmpPrecision, EnvDDPStrategy, PrecisionConfigurationError, StrategyConfigurationError
from lightning_ddp_amp.launch.process_group import destroy_process_group


def trainer(**kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(accelerator="cpu", logger=False, enable_progress_bar=False, max_epochs=1)
    options.update(kwargs)
    return L.Trainer(**options)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo process group of this process alone: DDP's constructor needs one (envddp builds DDP only on ranks)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_process_group()


def ddp_built_by(strategy: EnvDDPStrategy) -> DistributedDataParallel:
    """The wrapper ``configure_ddp`` (the last step of the strategy's ``setup``) builds around a model."""
    strategy.model = torch.nn.Linear(4, 1)
    strategy.configure_ddp()
    assert isinstance(strategy.model, DistributedDataParallel)
    return strategy.model


@pytest.mark.parametrize("precision", ["apex-O0", "apex-O1", "apex-O2", "apex-O3"])
def test_gradients_are_no_bucket_views_under_apex_which_holds_them_itself(
    apex_double: ModuleType, one_rank_group: None, precision: str
) -> None:
    # O0/O1/O3 stash the gradients around each amp.scale_loss (accumulation), O2's zero_grad detaches them in place:
    # bucket views would alias the stash, or refuse the detach. tests/test_fabric.py's accumulation shows the first.
    strategy = trainer(strategy="envddp", precision=precision).strategy
    assert isinstance(strategy, EnvDDPStrategy)
    assert "gradient_as_bucket_view" not in strategy.ddp_options
    assert ddp_built_by(strategy).gradient_as_bucket_view is False


def test_native_amp_keeps_bucket_views(no_apex: None, one_rank_group: None) -> None:
    strategy = trainer(strategy="envddp", precision="amp-O2").strategy
    assert isinstance(strategy, EnvDDPStrategy)
    assert strategy.ddp_options == {"gradient_as_bucket_view": True}
    assert ddp_built_by(strategy).gradient_as_bucket_view is True


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


def snapshot(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor | None]:
    """Copies of the tensors' gradients as they are now (None where there is none)."""
    return [None if t.grad is None else t.grad.detach().clone() for t in tensors]


class ZeroGradSetToNone(L.LightningModule):
    """Overrides ``optimizer_zero_grad`` as torch code often does: ``zero_grad(set_to_none=...)``.

    Notes, after each ``zero_grad``, the gradients of the model's parameters and of the optimizer's other parameters
    (apex O2's fp32 masters). The affine BatchNorm stays fp32 under apex O2, beside the fp16 Linear layers.
    """

    def __init__(self, set_to_none: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
        self.set_to_none = set_to_none
        self.model_grads: list[list[torch.Tensor | None]] = []
        self.master_grads: list[list[torch.Tensor | None]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).float().pow(2).mean()

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=self.set_to_none)
        model = {id(p) for p in self.parameters()}
        masters = (p for group in optimizer.param_groups for p in group["params"] if id(p) not in model)
        self.model_grads.append(snapshot(self.parameters()))
        self.master_grads.append(snapshot(masters))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model: L.LightningModule, precision: str) -> L.Trainer:
    t = trainer(strategy="envddp", precision=precision, enable_checkpointing=False, enable_model_summary=False)
    t.fit(model, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    return t


@needs_cpu_fp16
def test_zero_grad_set_to_none_under_apex_o2_explains_itself(apex_double: ModuleType) -> None:
    with pytest.raises(PrecisionConfigurationError) as raised:
        fit(ZeroGradSetToNone(set_to_none=True), "apex-O2")
    message = str(raised.value)
    assert message.startswith("set_to_none=True: apex O2's optimizer.zero_grad() takes no set_to_none")
    assert "Fix: call optimizer.zero_grad()" in message


@needs_cpu_fp16
def test_zero_grad_set_to_none_false_under_apex_o2_zeroes_through_apex(apex_double: ModuleType) -> None:
    model = ZeroGradSetToNone(set_to_none=False)
    assert fit(model, "apex-O2").global_step == 4
    assert {p.dtype for p in model.parameters()} == {torch.float16, torch.float32}
    # apex 25.05's O2 zero_grad: the model's gradients (fp16, and the fp32 BatchNorm's) zeroed in place, the fp32
    # masters' dropped. The first zero_grad comes before any backward: nothing to zero yet.
    assert len(model.model_grads) == len(model.master_grads) == 4
    for model_grads, master_grads in zip(model.model_grads[1:], model.master_grads[1:], strict=True):
        assert all(grad is not None and not grad.any() for grad in model_grads), model_grads
        assert master_grads == [None] * 4


@needs_cpu_fp16
def test_zero_grad_set_to_none_under_apex_o1_is_torchs(apex_double: ModuleType) -> None:
    assert fit(ZeroGradSetToNone(set_to_none=True), "apex-O1").global_step == 4
    assert not dist.is_initialized()
