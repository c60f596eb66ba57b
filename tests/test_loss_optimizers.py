"""A GAN's traps, on both front doors, in one process: which optimizers a loss is scaled for
(``lightning_ddp_amp.amp.loss_optimizers``: the one whose parameters the loss reaches, the ones ``optimizers=`` names,
or a refusal where the classic script's choice cannot be known), the script's own shuffle under Fabric's envddp in one
process, and envddp's answer to DDP's unused parameters. On the apex test double and on torch's AMP; the GAN against
the hand-written apex script, on one and two ranks, is in test_gan_reference.py."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import lightning as L
import pytest
import torch
from conftest import needs_cpu_fp16
from lightning.fabric import Fabric
from test_precision import trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp import AmpPrecision
from lightning_ddp_amp.errors import PrecisionConfigurationError
from lightning_ddp_amp.fabric import AmpPrecision as FabricAmpPrecision
from lightning_ddp_amp.fabric import setup_models


def gan() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)  # the discriminator, the generator


def fabric_gan(plugin: FabricAmpPrecision) -> tuple[Fabric, Any, Any, Any, Any]:
    fabric = Fabric(strategy="envddp", plugins=[plugin], accelerator="cpu")
    fabric.launch()
    d, g = gan()
    opt_d, opt_g = torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)
    [d, g], opt_d, opt_g = setup_models(fabric, [d, g], opt_d, opt_g)
    return fabric, d, g, opt_d, opt_g


def weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [param.detach().clone() for param in module.parameters()]


def moved(module: torch.nn.Module, before: list[torch.Tensor]) -> bool:
    return not all(torch.equal(param, old) for param, old in zip(module.parameters(), before, strict=True))


@needs_cpu_fp16
def test_fabric_scales_a_discriminator_loss_for_the_discriminators_optimizer_alone(apex_double: ModuleType) -> None:
    # The discriminator's overflow skips its own next step, not the generator's: apex skips every optimizer it is
    # handed, so handing it both (a superset) would skip the generator too.
    plugin = FabricAmpPrecision("O1", "apex", num_losses=2)
    fabric, d, g, opt_d, opt_g = fabric_gan(plugin)
    x = torch.randn(8, 4)
    d_before, g_before = weights(d), weights(g)
    fabric.backward(d(x).float().mean() * float("inf"), loss_id=0)
    opt_d.step()
    fabric.backward(d(g(x)).float().mean(), loss_id=1, optimizers=opt_g)
    opt_g.step()
    assert plugin.step_skipped(opt_d) and not moved(d, d_before)
    assert not plugin.step_skipped(opt_g) and moved(g, g_before)
    scale_loss = [event["optimizers"] for event in apex_double.events if event["event"] == "scale_loss"]
    assert scale_loss == [1, 1]
    assert [scaler["loss_scale"] for scaler in plugin.state_dict()["loss_scalers"]] == [2.0**15, 2.0**16]


@needs_cpu_fp16
def test_fabric_refuses_a_loss_that_reaches_several_optimizers_without_optimizers(apex_double: ModuleType) -> None:
    fabric, d, g, _, opt_g = fabric_gan(FabricAmpPrecision("O1", "apex", num_losses=3))
    loss = d(g(torch.randn(8, 4))).float().mean()  # a generator's loss, through the discriminator
    with pytest.raises(PrecisionConfigurationError) as refused:
        fabric.backward(loss, loss_id=2)
    message = str(refused.value)
    assert message.startswith("optimizers=None: fabric.backward(loss, loss_id=2) with 2 optimizers set up")
    assert "the parameters of optimizers 0 (SGD) and 1 (SGD)" in message
    assert "`with amp.scale_loss(loss, optimizer, loss_id=2) as scaled_loss:`" in message
    assert message.endswith(
        "Fix: name them as the classic line `with amp.scale_loss(loss, optimizer, loss_id=2) as"
        " scaled_loss:` did: fabric.backward(loss, loss_id=2, optimizers=optimizer)"
    )
    fabric.backward(loss, loss_id=2, optimizers=opt_g)  # the fix runs


def test_native_amp_asks_the_same_as_apex(no_apex: None) -> None:
    # One GradScaler checks each optimizer's own gradients, so the choice changes nothing natively; asking all the
    # same keeps a script that runs on apex-O1 running on native-O1 and back.
    fabric, d, g, opt_d, _ = fabric_gan(FabricAmpPrecision("O0", "native"))
    with pytest.raises(PrecisionConfigurationError, match=r"^optimizers=None: fabric.backward\(loss, loss_id=0\)"):
        fabric.backward(d(g(torch.randn(8, 4))).mean())
    fabric.backward(d(torch.randn(8, 4)).mean())  # the discriminator's own loss: its optimizer, chosen
    opt_d.step()


def test_one_optimizer_takes_every_loss_without_looking(no_apex: None) -> None:
    fabric = Fabric(strategy="envddp", plugins=[FabricAmpPrecision("O0", "native")], accelerator="cpu")
    fabric.launch()
    d, g = gan()
    [d, g], optimizer = setup_models(fabric, [d, g], torch.optim.SGD([*d.parameters(), *g.parameters()], lr=0.1))
    fabric.backward(d(g(torch.randn(8, 4))).mean())
    optimizer.step()


def test_fabric_one_process_keeps_the_scripts_shuffle() -> None:
    # No DistributedSampler(num_replicas=1, seed=0) swapped in: the order comes from the script's own seed, as with a
    # plain DataLoader and Fabric's single-device strategy.
    data = TensorDataset(torch.arange(8))

    def order(loader: Any) -> list[int]:
        torch.manual_seed(2809)
        return [int(x) for (batch,) in loader for x in batch]

    fabric = Fabric(strategy="envddp", accelerator="cpu")
    fabric.launch()
    plain = order(DataLoader(data, batch_size=4, shuffle=True))
    kept = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
    kept.sampler.set_epoch(1)  # the classic loop's line runs, and changes nothing
    assert order(kept) == plain
    single = Fabric(devices=1, accelerator="cpu")
    assert order(single.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))) == plain


class GAN(L.LightningModule):
    """A discriminator and a generator, one optimizer each, trained by hand; ``steps`` says what each step does."""

    def __init__(self, name_generator_optimizer: bool = True) -> None:
        super().__init__()
        self.d, self.g = gan()
        self.automatic_optimization = False
        self.name_generator_optimizer = name_generator_optimizer
        self.d_before, self.g_before = weights(self.d), weights(self.g)
        self.skipped: list[tuple[bool, bool]] = []

    def configure_amp_models(self) -> list[torch.nn.Module]:
        return [self.d, self.g]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        opt_d, opt_g = self.optimizers()
        opt_d.zero_grad()
        overflow = float("inf") if batch_idx == 0 else 1.0
        self.manual_backward(self.d(x).float().mean() * overflow, loss_id=0)
        opt_d.step()
        opt_g.zero_grad()
        named = {"optimizers": opt_g} if self.name_generator_optimizer else {}
        self.manual_backward(self.d(self.g(x)).float().mean(), loss_id=1, **named)
        opt_g.step()
        plugin = self.trainer.precision_plugin
        self.skipped.append((plugin.step_skipped(opt_d.optimizer), plugin.step_skipped(opt_g.optimizer)))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.d.parameters(), lr=0.1), torch.optim.SGD(self.g.parameters(), lr=0.1)


def fit_gan(model: GAN) -> L.Trainer:
    fitted = trainer(plugins=[AmpPrecision("O1", "apex", num_losses=2)])
    fitted.fit(model, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    return fitted


@needs_cpu_fp16
def test_manual_backward_scales_a_discriminator_loss_for_its_optimizer_alone(apex_double: ModuleType) -> None:
    model = GAN()
    fitted = fit_gan(model)
    assert model.skipped == [(True, False), (False, False)]
    scale_loss = [event["optimizers"] for event in apex_double.events if event["event"] == "scale_loss"]
    assert scale_loss == [1, 1, 1, 1]
    assert [scaler["loss_scale"] for scaler in fitted.precision_plugin.state_dict()["loss_scalers"]] == [
        2.0**15,
        2.0**16,
    ]


@needs_cpu_fp16
def test_manual_backward_refuses_a_loss_that_reaches_several_optimizers(apex_double: ModuleType) -> None:
    with pytest.raises(PrecisionConfigurationError) as refused:
        fit_gan(GAN(name_generator_optimizer=False))
    message = str(refused.value)
    assert message.startswith("optimizers=None: self.manual_backward(loss, loss_id=1) with 2 optimizers set up")
    assert message.endswith("self.manual_backward(loss, loss_id=1, optimizers=optimizer)")


@pytest.mark.parametrize("find_unused_parameters", [None, True])
def test_ddps_unused_parameter_error_names_envddps_setting(find_unused_parameters: bool | None) -> None:
    # A GAN's losses in one DDP wrap of the LightningModule: Lightning's advice would be its own ddp, where apex cannot
    # run. With the search already on, there is nothing to advise.
    from lightning_ddp_amp import EnvDDPStrategy

    strategy = EnvDDPStrategy(accelerator=None, find_unused_parameters=find_unused_parameters)
    strategy._ddp_kwargs = strategy.ddp_options
    torchs = "Expected to have finished reduction in the prior iteration before starting a new one."
    error = RuntimeError(torchs)
    strategy.on_exception(error)
    if find_unused_parameters:
        assert "ddp_find_unused_parameters_true" in str(error)  # Lightning's, left as it is
        return
    message = str(error)
    assert message.startswith("find_unused_parameters=False: a backward in training_step left parameters")
    assert 'Fix: keep envddp and let it search: Trainer(strategy="envddp_find_unused_parameters_true")' in message
    assert "'ddp_find_unused_parameters_true' wraps the model before amp.initialize" in message
