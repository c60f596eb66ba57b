"""``Fabric(strategy="envddp", precision=...)``: the classic loop kept under Lightning Fabric.

One process (no launcher: envddp trains alone, unwrapped) for what Fabric builds, refuses and does at each call, with
the apex test double where apex is meant; two ranks for the classic script against its Fabric version."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import (
    Preloaded,
    Torchrun,
    check,
    finish,
    free_port,
    launcher_variables,
    needs_cpu_fp16,
    start_python,
)
from lightning.fabric import Fabric
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
from lightning_utilities.core.rank_zero import WarningCache
from test_launchers import MPIRUN_RANK_3_OF_4, SRUN_RANK_3_OF_4, TORCHRUN_RANK_0_OF_2

import lightning_ddp_amp
from lightning_ddp_amp import rank_zero
from lightning_ddp_amp.errors import PrecisionConfigurationError, StrategyConfigurationError
from lightning_ddp_amp.fabric import AmpPrecision, EnvDDPStrategy, setup_models
from lightning_ddp_amp.launch.environment import read_topology
from lightning_ddp_amp.launch.process_group import destroy_process_group

EXAMPLES = Path(__file__).parents[1] / "examples"


def fabric_for(precision: str, strategy: str = "envddp") -> Fabric:
    fabric = Fabric(strategy=strategy, precision=precision, accelerator="cpu")  # type: ignore[arg-type]
    fabric.launch()
    return fabric


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(fabric: Fabric, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scale: float = 1.0) -> None:
    optimizer.zero_grad()
    x = torch.randn(4, 8)
    loss = model(x).float().pow(2).mean() * scale
    fabric.backward(loss)
    optimizer.step()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_apex_strings_build_envddp_with_apex(level: str, apex_double: ModuleType) -> None:
    fabric = Fabric(strategy="envddp", precision=f"apex-{level}", accelerator="cpu")  # type: ignore[arg-type]
    assert isinstance(fabric.strategy, EnvDDPStrategy)
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision)
    assert (plugin.backend, plugin.opt_level) == ("apex", level)


@pytest.mark.parametrize("flag", ["native-O0", "native-O1", "native-O2", "native-O3", "amp-O1", "amp-O3"])
def test_native_and_amp_strings_build_envddp_with_torch_amp(flag: str, no_apex: None) -> None:
    fabric = Fabric(strategy="envddp", precision=flag, accelerator="cpu")  # type: ignore[arg-type]
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision)
    assert (plugin.backend, plugin.opt_level, plugin.flag) == ("native", flag[-2:], f"native-{flag[-2:]}")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "64-true"])
def test_lightnings_own_precisions_reach_fabric_unchanged(precision: str) -> None:
    fabric = Fabric(strategy="envddp", precision=precision, accelerator="cpu")  # type: ignore[arg-type]
    assert isinstance(fabric.strategy, EnvDDPStrategy)
    assert type(fabric.strategy.precision).__module__.startswith("lightning.fabric")


def test_a_precision_string_neither_fabric_nor_the_package_knows_is_refused_with_both_lists() -> None:
    # Near none of them, so nothing is named (a near one is: tests/test_mistyped_names.py).
    with pytest.raises(PrecisionConfigurationError) as raised:
        Fabric(strategy="envddp", precision="fp8", accelerator="cpu")  # type: ignore[arg-type]
    assert str(raised.value).startswith(
        "precision='fp8': not a precision Lightning or lightning_ddp_amp knows. Fix: name"
    )
    assert "apex-O0 ... apex-O3, amp-O0 ... amp-O3, native-O0 ... native-O3 and Lightning's" in raised.value.fix
    assert "bf16-mixed" in raised.value.fix


def test_an_invalid_precision_that_is_no_string_is_still_fabrics_to_refuse() -> None:
    with pytest.raises(ValueError, match="Precision 17 is invalid") as raised:
        Fabric(strategy="envddp", precision=17, accelerator="cpu")  # type: ignore[arg-type]
    assert not isinstance(raised.value, PrecisionConfigurationError)


def test_a_precision_string_beside_a_precision_plugin_is_refused(no_apex: None) -> None:
    with pytest.raises(PrecisionConfigurationError, match=r"precision='native-O1'.*plugins also holds"):
        Fabric(strategy="envddp", precision="native-O1", plugins=[Precision()], accelerator="cpu")  # type: ignore[arg-type]


def test_the_plugin_instance_goes_in_plugins(no_apex: None) -> None:
    plugin = AmpPrecision(opt_level="O2", backend="native")
    fabric = Fabric(strategy="envddp", plugins=[plugin], accelerator="cpu")
    assert fabric.strategy.precision is plugin


def test_fabric_runs_envddp_as_one_process_without_a_launcher() -> None:
    fabric = fabric_for("32-true")
    assert (fabric.world_size, fabric.global_rank, fabric.strategy.num_nodes) == (1, 0, 1)
    model, optimizer = fabric.setup(*model_and_optimizer())
    assert not isinstance(model.module, torch.nn.parallel.DistributedDataParallel)
    train_step(fabric, model, optimizer)


@pytest.mark.parametrize("strategy", ["ddp", "auto"])
def test_an_apex_level_with_another_strategy_is_refused_at_fabric(strategy: str, apex_double: ModuleType) -> None:
    # Fabric calls no precision hook with the optimizers: only envddp runs amp.initialize before the wrap.
    with pytest.raises(PrecisionConfigurationError) as raised:
        Fabric(strategy=strategy, precision="apex-O1", accelerator="cpu")  # type: ignore[arg-type]
    message = str(raised.value)
    assert "Fabric(precision='apex-O1')" in message
    assert "amp.initialize" in message
    assert "Fabric(strategy=\"envddp\", precision='apex-O1')" in message


def test_amp_levels_with_another_strategy_run_on_torch_amp(apex_double: ModuleType) -> None:
    fabric = Fabric(strategy="ddp", precision="amp-O1", accelerator="cpu", devices=1)  # type: ignore[arg-type]
    assert isinstance(fabric.strategy, DDPStrategy) and not isinstance(fabric.strategy, EnvDDPStrategy)
    assert fabric.strategy.precision.backend == "native"  # type: ignore[attr-defined]


def test_native_levels_run_with_single_device_fabric(no_apex: None) -> None:
    fabric = Fabric(precision="native-O1", accelerator="cpu")  # type: ignore[arg-type]
    assert isinstance(fabric.strategy, SingleDeviceStrategy)
    assert isinstance(fabric.strategy.precision, AmpPrecision)


def test_two_models_and_an_optimizer_in_one_setup_are_refused(no_apex: None) -> None:
    fabric = fabric_for("32-true")
    model_a, model_b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD([*model_a.parameters(), *model_b.parameters()], lr=0.1)
    with pytest.raises(StrategyConfigurationError) as raised:
        fabric.setup(model_a, model_b, optimizer)
    message = str(raised.value)
    assert "fabric.setup='(Linear, Linear, SGD)'" in message
    assert "Linear would be treated as an optimizer" in message
    assert "setup_models(fabric, [model_a, model_b], optimizer)" in message


@needs_cpu_fp16
def test_setup_runs_amp_initialize_on_the_model_and_the_raw_optimizer(apex_double: ModuleType) -> None:
    fabric = fabric_for("apex-O2")
    model, optimizer = model_and_optimizer()
    model, fabric_optimizer = fabric.setup(model, optimizer)
    assert {param.dtype for param in model.parameters()} == {torch.float16}  # cast by amp.initialize (O2)
    assert hasattr(optimizer, "_amp_stash") and fabric_optimizer.optimizer is optimizer
    masters = list(apex_double.master_params(optimizer))
    assert {master.dtype for master in masters} == {torch.float32}


def test_setup_module_before_the_optimizer_under_apex_is_refused(apex_double: ModuleType) -> None:
    fabric = fabric_for("apex-O1")
    model, _ = model_and_optimizer()
    with pytest.raises(PrecisionConfigurationError) as raised:
        fabric.setup_module(model)
    message = str(raised.value)
    assert "fabric.setup_module='Sequential'" in message
    assert "amp.initialize needs the model together with its optimizer" in message
    assert "fabric.setup(model, optimizer)" in message


@needs_cpu_fp16
def test_an_optimizer_set_up_apart_from_its_models_under_apex_is_refused(apex_double: ModuleType) -> None:
    fabric = fabric_for("apex-O1")
    model, optimizer = model_and_optimizer()
    fabric.setup(model, optimizer)
    _, other = model_and_optimizer()
    with pytest.raises(PrecisionConfigurationError, match=r"fabric\.setup_optimizers='SGD'.*amp\.initialize together"):
        fabric.setup_optimizers(other)


@needs_cpu_fp16
def test_a_second_setup_under_apex_is_refused(apex_double: ModuleType) -> None:
    fabric = fabric_for("apex-O1")
    fabric.setup(*model_and_optimizer())
    with pytest.raises(PrecisionConfigurationError) as raised:
        fabric.setup(*model_and_optimizer())
    message = str(raised.value)
    assert "call='fabric.setup(model, optimizer)'" in message
    assert "apex supports one amp.initialize per process" in message
    assert "setup_models(fabric, [model_a, model_b], optimizer)" in message


@needs_cpu_fp16
def test_setup_models_initializes_every_model_with_the_shared_optimizer_once(apex_double: ModuleType) -> None:
    fabric = fabric_for("apex-O2")
    model_a, model_b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD([*model_a.parameters(), *model_b.parameters()], lr=0.1)
    [set_a, set_b], fabric_optimizer = setup_models(fabric, [model_a, model_b], optimizer)
    assert set_a.module is model_a and set_b.module is model_b
    assert model_a.weight.dtype == model_b.weight.dtype == torch.float16
    assert len(list(apex_double.master_params(optimizer))) == 4
    fabric_optimizer.zero_grad()
    fabric.backward(set_b(set_a(torch.randn(2, 8))).float().sum())
    fabric_optimizer.step()


@pytest.mark.parametrize("models", [[], ["not a module"]])
def test_setup_models_needs_a_list_of_modules(models: list[object], no_apex: None) -> None:
    fabric = fabric_for("native-O1")
    with pytest.raises(StrategyConfigurationError, match=r"setup_models takes a list of torch\.nn\.Module"):
        setup_models(fabric, models, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))  # type: ignore[arg-type]


def test_setup_models_needs_the_shared_optimizer(no_apex: None) -> None:
    fabric = fabric_for("native-O1")
    with pytest.raises(StrategyConfigurationError, match="optimizers='none'"):
        setup_models(fabric, [torch.nn.Linear(1, 1)])


@needs_cpu_fp16
def test_zero_grad_of_fabrics_optimizer_is_apex_o2s(apex_double: ModuleType) -> None:
    # Fabric's wrapper finds torch's zero_grad on the class before apex's patch on the instance: torch's would drop
    # only the fp32 masters' gradients, and the fp16 model gradients would accumulate into the next step.
    fabric = fabric_for("apex-O2")
    model, optimizer = fabric.setup(*model_and_optimizer())
    fabric.backward(model(torch.randn(4, 8)).float().pow(2).mean())
    assert any(param.grad.abs().sum() > 0 for param in model.parameters())
    optimizer.zero_grad()
    assert all(param.grad is None or param.grad.abs().sum() == 0 for param in model.parameters())
    with pytest.raises(PrecisionConfigurationError, match="set_to_none"):
        optimizer.zero_grad(set_to_none=True)


@needs_cpu_fp16
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_skips_the_step_and_clipping_returns_the_norm_instead_of_raising(
    level: str, apex_double: ModuleType
) -> None:
    fabric = fabric_for(f"apex-{level}")
    model, optimizer = fabric.setup(*model_and_optimizer())
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision)
    before = [param.detach().clone() for param in model.parameters()]
    scale = plugin.current_loss_scale
    optimizer.zero_grad()
    fabric.backward(model(torch.randn(4, 8)).float().sum() * 1e30)  # fp16 gradients overflow at any loss scale
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # Fabric's default error_if_nonfinite=True
    if level == "O1":  # the gradients clipped are the model's own, inf; apex O2 unscales into the masters
        assert not math.isfinite(float(norm))
    optimizer.step()
    assert plugin.step_skipped(optimizer)
    assert all(torch.equal(param, old) for param, old in zip(model.parameters(), before, strict=True))
    assert plugin.current_loss_scale == scale / 2
    train_step(fabric, model, optimizer)  # the next step runs
    assert not plugin.step_skipped(optimizer)
    assert not all(torch.equal(param, old) for param, old in zip(model.parameters(), before, strict=True))


@needs_cpu_fp16
def test_clipping_under_apex_o2_clips_the_fp32_masters(apex_double: ModuleType) -> None:
    fabric = fabric_for("apex-O2")
    model, optimizer = fabric.setup(*model_and_optimizer())
    optimizer.zero_grad()
    # A small loss: its gradients times apex's first loss scale (2**16) stay within float16.
    fabric.backward(model(torch.randn(4, 8)).float().pow(2).mean() * 1e-3)
    norm = fabric.clip_gradients(model, optimizer, max_norm=1e-5)
    assert math.isfinite(float(norm)) and float(norm) > 1e-5  # no overflow, and a norm to clip
    masters = list(apex_double.master_params(optimizer.optimizer))
    assert {master.dtype for master in masters} == {torch.float32}
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in masters]))
    assert total.item() == pytest.approx(float(norm) * 1e-5 / (float(norm) + 1e-6), rel=1e-4)  # torch's clip


@needs_cpu_fp16
def test_save_and_load_carry_the_loss_scale_and_apex_o2s_fp32_masters(apex_double: ModuleType, tmp_path: Path) -> None:
    fabric = fabric_for("apex-O2")
    model, optimizer = fabric.setup(*model_and_optimizer())
    train_step(fabric, model, optimizer)
    plugin = fabric.strategy.precision
    state = {"model": model, "optimizer": optimizer, "amp": plugin}
    fabric.save(tmp_path / "state.pt", state)
    masters = [master.detach().clone() for master in apex_double.master_params(optimizer.optimizer)]
    scale = plugin.current_loss_scale  # type: ignore[attr-defined]
    train_step(fabric, model, optimizer, scale=1e30)  # an overflow: the loss scale halves
    train_step(fabric, model, optimizer)
    assert plugin.current_loss_scale != scale  # type: ignore[attr-defined]
    fabric.load(tmp_path / "state.pt", state)
    assert plugin.current_loss_scale == scale  # type: ignore[attr-defined]
    restored = list(apex_double.master_params(optimizer.optimizer))
    assert all(torch.equal(a, b) for a, b in zip(restored, masters, strict=True))


def test_a_state_not_written_by_amp_precision_is_refused(no_apex: None) -> None:
    plugin = AmpPrecision(opt_level="O1", backend="native")
    with pytest.raises(PrecisionConfigurationError, match="it was not written by AmpPrecision"):
        plugin.load_state_dict({"scaler": {}})


def test_a_loss_id_beyond_num_losses_is_refused(no_apex: None) -> None:
    fabric = fabric_for("native-O0")
    model, _ = fabric.setup(*model_and_optimizer())
    with pytest.raises(PrecisionConfigurationError, match=r"loss_id=1.*num_losses=1"):
        fabric.backward(model(torch.randn(2, 8)).sum(), loss_id=1)


def test_num_nodes_against_the_launcher_is_checked_at_fabric() -> None:
    with pytest.raises(lightning_ddp_amp.TopologyMismatchError, match="drop num_nodes from the Fabric"):
        Fabric(strategy="envddp", accelerator="cpu", num_nodes=2)


#: The reference loop (the classic script at an apex level, or the same loop with torch's AMP by hand), the Fabric
#: script's precision, and the special cases both loops run: gradient accumulation (DDP's no_sync, apex's
#: delay_unscale), clipping, and under a dynamic loss scale an inf batch whose step is skipped on overflow.
CLASSIC = ["examples/classic/train.py", "--opt-level"]
CLASSIC_PAIRS = {
    "fp32": ([*CLASSIC, "O0"], "32-true", ["--accumulate", "2", "--clip", "1.0"]),
    "apex-O1": ([*CLASSIC, "O1"], "apex-O1", ["--accumulate", "2", "--clip", "1.0", "--bad-batch", "3"]),
    "apex-O2": ([*CLASSIC, "O2"], "apex-O2", ["--accumulate", "2", "--clip", "1.0", "--bad-batch", "3"]),
    "apex-O3": ([*CLASSIC, "O3"], "apex-O3", ["--accumulate", "2", "--clip", "0.5"]),
    "native-O1": (
        ["tests/workers/classic_native.py"],
        "native-O1",
        ["--accumulate", "2", "--clip", "1.0", "--bad-batch", "3"],
    ),
}
#: The pairs whose Fabric run stops after one epoch and goes on in a new process from what fabric.save wrote.
RESUMED = {"apex-O1", "apex-O2", "native-O1"}


@needs_cpu_fp16
@pytest.mark.parametrize("pair", list(CLASSIC_PAIRS))
def test_the_fabric_script_ends_in_the_classic_scripts_weights(
    pair: str, torchrun: Torchrun, preloaded: Preloaded, tmp_path: Path
) -> None:
    # The classic loop (DDP, DistributedSampler and amp.scale_loss by hand, with the apex test double on CPU ranks; or
    # torch.autocast and a GradScaler by hand) against examples/fabric/train.py, the same loop under
    # Fabric(strategy="envddp", precision=...), on 2 ranks for 2 epochs. apex O0 is fp32 with a loss scale of 1: the
    # classic O0 run is the reference for "32-true". A resumed Fabric run trains one epoch, saves, and goes on in a new
    # process from what fabric.save wrote (the loss scale, O2's fp32 masters, the epoch; the data in the classic
    # order): its end equals the reference run that never stopped.
    reference, precision, cases = CLASSIC_PAIRS[pair]
    classic, kept = tmp_path / "classic.pt", tmp_path / "fabric.pt"
    script = str(Path(__file__).parents[1] / reference[0])
    check(torchrun.run(script, *reference[1:], *cases, "--checkpoint", str(classic), apex_double=True))
    script, args = str(EXAMPLES / "fabric" / "train.py"), ["--precision", precision, *cases, "--checkpoint", str(kept)]
    stages = [["--epochs", "1"], ["--resume", str(kept)]] if pair in RESUMED else [[]]
    for stage, extra in enumerate(stages):
        preloaded.run(script, *args, *extra, log=tmp_path / f"logs{stage}").check()
    before, after = torch.load(classic, weights_only=False), torch.load(kept, weights_only=False)
    assert after["epoch"] == before["epoch"] == 2  # the epochs done, as apex's ImageNet example counts them
    for model in ("model_a", "model_b"):
        assert before[model].keys() == after[model].keys()
        for name, value in before[model].items():
            assert (after[model][name].float() - value.float()).abs().max().item() == 0.0, f"{model}.{name}"
    if precision.startswith("apex"):
        assert after["amp"]["loss_scalers"] == [before["amp"]["loss_scaler0"]]
    if pair == "native-O1":
        assert after["amp"]["grad_scaler"] == before["scaler"]
    if "--bad-batch" in cases:  # its step (the 2nd of 16) was skipped: the scale halved, and 14 steps ran since
        assert after["amp"]["loss_scalers"] == [{"loss_scale": 2.0**15, "unskipped": 14}]
    if precision == "apex-O2":
        assert [master.dtype for master in after["amp"]["master_weights"]] == [torch.float32] * 6
    torch.manual_seed(0)
    torch.randn(1024, 32)
    initial = torch.nn.Linear(32, 128).weight
    assert (initial - after["model_a"]["layers.0.weight"].float()).abs().max() > 1e-3


@needs_cpu_fp16
def test_the_fabric_script_in_one_process_ends_in_the_classic_scripts_weights(
    torchrun: Torchrun, preloaded: Preloaded, tmp_path: Path
) -> None:
    # One process: the classic script under torchrun --nproc-per-node=1 builds no DistributedSampler (as apex's ImageNet
    # example), and the Fabric script run as plain `python train.py` keeps its DataLoader's own shuffle (envddp swaps
    # in no sampler) and its loader.sampler.set_epoch line: the same order from the same seed. apex O2 (fp32 masters)
    # with accumulation, clipping and a skipped step.
    reference, precision, cases = CLASSIC_PAIRS["apex-O2"]
    classic, kept = tmp_path / "classic.pt", tmp_path / "fabric.pt"
    script = str(Path(__file__).parents[1] / reference[0])
    check(torchrun.run(script, *reference[1:], *cases, "--checkpoint", str(classic), nproc=1, apex_double=True))
    script = str(EXAMPLES / "fabric" / "train.py")
    ran = preloaded.run(
        script, "--precision", precision, *cases, "--checkpoint", str(kept), nproc=1, env=[{}], log=tmp_path
    )
    ran.check()
    before, after = torch.load(classic, weights_only=False), torch.load(kept, weights_only=False)
    for model in ("model_a", "model_b"):
        for name, value in before[model].items():
            assert (after[model][name].float() - value.float()).abs().max().item() == 0.0, f"{model}.{name}"
    assert after["amp"]["loss_scalers"] == [before["amp"]["loss_scaler0"]] == [{"loss_scale": 2.0**15, "unskipped": 30}]


def test_the_readmes_fabric_diff_is_lines_of_the_two_example_files() -> None:
    # The README's front-page diff (a fragment) cannot drift from the files it shows; its comments are the README's.
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Keeping the loop: Lightning Fabric", 1)[1].split("```diff\n", 1)[1].split("```", 1)[0]
    classic = (EXAMPLES / "classic" / "train.py").read_text().splitlines()
    kept = (EXAMPLES / "fabric" / "train.py").read_text().splitlines()
    added = [line[1:].split("  # ")[0] for line in section.splitlines() if line.startswith("+")]
    removed = [line[1:].split("  # ")[0] for line in section.splitlines() if line.startswith("-")]
    assert [line for line in added if line not in kept] == []
    assert [line for line in removed if line not in classic] == []
    assert len(added) <= 12


@needs_cpu_fp16
def test_fabrics_optimizer_handed_to_amp_scale_loss_by_hand_is_refused(apex_double: ModuleType) -> None:
    # A kept line of the classic loop: apex would patch the wrapper's step on an overflow, bypassing the strategy.
    fabric = fabric_for("apex-O1")
    model, optimizer = fabric.setup(*model_and_optimizer())
    loss = model(torch.randn(2, 8)).float().sum()
    with pytest.raises(PrecisionConfigurationError) as raised, apex_double.scale_loss(loss, optimizer):
        pass
    message = str(raised.value)
    assert message.startswith("amp.scale_loss='FabricSGD': it was handed Fabric's optimizer wrapper")
    assert "fabric.backward(loss)" in message
    fabric.backward(loss)  # the package's own amp.scale_loss, on the raw optimizer, still runs
    optimizer.step()


@needs_cpu_fp16
def test_fabrics_optimizer_handed_to_amp_initialize_by_hand_is_refused(apex_double: ModuleType) -> None:
    fabric = fabric_for("apex-O1")
    model, optimizer = fabric.setup(*model_and_optimizer())
    with pytest.raises(PrecisionConfigurationError, match=r"amp\.initialize='FabricSGD'.*made it already"):
        apex_double.initialize(model.module, [optimizer], opt_level="O1")


#: What each launcher exports for one of its ranks, and (rank, local rank, world size, node rank) envddp reads there:
#: the launcher tables of the Trainer's tests (test_launchers.py, test_environment.py), read through Fabric.
LAUNCHED = {
    "torchrun": (TORCHRUN_RANK_0_OF_2, [], (0, 0, 2, 0)),
    "torch.distributed.launch --use-env": (
        {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        [],
        (1, 1, 2, 0),
    ),
    "torch.distributed.launch": (
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        ["--local-rank=1"],
        (1, 1, 2, 0),
    ),
    "srun": (SRUN_RANK_3_OF_4, [], (3, 1, 4, 1)),
    "mpirun": (MPIRUN_RANK_3_OF_4, [], (3, 1, 4, 1)),
}


@pytest.mark.parametrize("launcher", list(LAUNCHED))
def test_fabric_reads_every_launcher_as_the_trainer_does(launcher: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env, argv, (rank, local_rank, world_size, node_rank) = LAUNCHED[launcher]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    fabric = Fabric(strategy="envddp", accelerator="cpu")
    strategy = fabric.strategy
    assert isinstance(strategy, EnvDDPStrategy)
    assert strategy.topology == read_topology(dict(os.environ), sys.argv[1:])
    assert (fabric.global_rank, fabric.local_rank, fabric.world_size, fabric.node_rank) == (
        rank,
        local_rank,
        world_size,
        node_rank,
    )
    assert strategy.distributed_sampler_kwargs == {"num_replicas": world_size, "rank": rank}


def test_a_bad_launcher_variable_is_the_trainers_error_at_fabric(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**TORCHRUN_RANK_0_OF_2, "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(lightning_ddp_amp.LauncherEnvironmentError, match="LOCAL_WORLD_SIZE"):
        Fabric(strategy="envddp", accelerator="cpu")


def test_devices_against_the_launcher_is_checked_at_fabric(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN_RANK_0_OF_2.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(lightning_ddp_amp.TopologyMismatchError, match="drop devices from the Fabric"):
        Fabric(strategy="envddp", accelerator="cpu", devices=3)


class FourRanks(ClusterEnvironment):
    """A scheduler's ClusterEnvironment plugin: rank 2 of 4, two a node."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "10.1.1.1"

    @property
    def main_port(self) -> int:
        return 29555

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return 4

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return 2

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 1

    def local_world_size(self) -> int:
        return 2


def test_a_cluster_environment_plugin_gives_fabric_its_ranks() -> None:
    fabric = Fabric(strategy="envddp", accelerator="cpu", plugins=[FourRanks()])
    assert (fabric.global_rank, fabric.local_rank, fabric.world_size, fabric.node_rank) == (2, 0, 4, 1)
    assert fabric.strategy.topology.master_addr == "10.1.1.1"  # type: ignore[attr-defined]


def test_devices_2_without_a_launcher_starts_two_ranks_at_fabric_launch(tmp_path: Path) -> None:
    # `python train.py` with Fabric(devices=2): fabric.launch() makes this process torchrun's agent for 2 ranks.
    script = str(Path(__file__).parent / "workers" / "fabric_launch.py")
    result = check(finish(start_python(script, "--devices", "2"), 240))
    lines = sorted(
        (json.loads(line) for line in re.findall(r"\{[^{}]*\}", result.stdout)), key=lambda line: line["rank"]
    )
    assert lines == [
        {"rank": 0, "world": 2, "local": 0, "sum": 3.0},
        {"rank": 1, "world": 2, "local": 1, "sum": 3.0},
    ]
    assert "envddp: no launcher variables and 2 devices: starting the ranks as `torchrun" in result.stdout
    assert "started by the script itself, through torchrun (self-launch)" in result.stdout


def squared_mean(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """train_step's loss, small enough that its gradients times apex's first loss scale (2**16) stay within float16."""
    return model(x).float().pow(2).mean() * 1e-3


def fp32_gradients(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of :func:`squared_mean` in plain fp32, on a copy (before amp.initialize patches torch)."""
    plain = copy.deepcopy(model)
    squared_mean(plain, x).backward()
    return [param.grad.detach().clone() for param in plain.parameters()]


def apex_o1_with_fp32_gradients() -> tuple[
    Fabric, torch.nn.Module, torch.optim.Optimizer, torch.Tensor, list[torch.Tensor]
]:
    """Fabric under apex-O1, its model and optimizer set up, a batch, and that batch's :func:`fp32_gradients`."""
    fabric = fabric_for("apex-O1")
    model, optimizer = model_and_optimizer()
    x = torch.randn(4, 8)
    expected = fp32_gradients(model, x)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer, x, expected


def assert_within_fp16(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Each gradient equals its fp32 counterpart within what fp16 activations leave (1% of its largest value)."""
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        apart, largest = (got.float() - want).abs().max().item(), want.abs().max().item()
        assert apart <= 1e-2 * largest, f"gradient {index}: {apart:.3g} apart, where the largest is {largest:.3g}"


@needs_cpu_fp16
def test_an_overflow_of_the_second_loss_halves_its_own_loss_scale_only(
    apex_double: ModuleType,
) -> None:
    fabric = Fabric(strategy="envddp", plugins=[AmpPrecision("O1", "apex", num_losses=2)], accelerator="cpu")
    fabric.launch()
    model, optimizer = fabric.setup(*model_and_optimizer())
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision)
    optimizer.zero_grad()
    fabric.backward(model(torch.randn(4, 8)).float().sum() * 1e30, loss_id=1)  # overflows at any loss scale
    optimizer.step()
    assert plugin.step_skipped(optimizer)
    assert [scaler["loss_scale"] for scaler in plugin.state_dict()["loss_scalers"]] == [2.0**16, 2.0**15]
    assert apex_double.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**16


@needs_cpu_fp16
def test_a_backward_in_no_backward_sync_disabled_leaves_the_gradients_unscaled_as_one_outside_it(
    apex_double: ModuleType,
) -> None:
    # Lightning's idiom `with fabric.no_backward_sync(model, enabled=is_accumulating)`: on the micro-batch that steps,
    # the context is off, and apex must unscale as after any other backward.
    fabric, model, optimizer, x, expected = apex_o1_with_fp32_gradients()
    fabric.backward(squared_mean(model, x))
    assert_within_fp16([param.grad for param in model.parameters()], expected)
    optimizer.zero_grad()
    with fabric.no_backward_sync(model, enabled=False):
        fabric.backward(squared_mean(model, x))
    assert_within_fp16([param.grad for param in model.parameters()], expected)


@needs_cpu_fp16
def test_an_explicit_delay_unscale_keeps_the_gradients_scaled_outside_no_backward_sync(
    apex_double: ModuleType,
) -> None:
    fabric, model, _, x, expected = apex_o1_with_fp32_gradients()
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision)
    scale = plugin.current_loss_scale
    assert scale == 2.0**16
    fabric.backward(squared_mean(model, x), delay_unscale=True)
    assert_within_fp16([param.grad for param in model.parameters()], [grad * scale for grad in expected])


@needs_cpu_fp16
def test_native_o3_setup_models_casts_every_model_and_each_runs_its_forward(no_apex: None) -> None:
    # Each model is converted as setup_models reaches it: converting the second must keep the first's casts.
    fabric = fabric_for("native-O3")
    model_a, model_b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD([*model_a.parameters(), *model_b.parameters()], lr=0.1)
    [set_a, set_b], _ = setup_models(fabric, [model_a, model_b], optimizer)
    assert {param.dtype for param in (*model_a.parameters(), *model_b.parameters())} == {torch.float16}
    assert torch.isfinite(set_a(torch.randn(2, 8))).all()
    assert torch.isfinite(set_b(torch.randn(2, 16))).all()


def test_a_one_rank_group_the_script_started_is_trained_on_without_saying_there_is_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A classic script run by `torchrun --nproc-per-node=1` that kept its dist.init_process_group("gloo") line.
    for name, value in {**launcher_variables(0, free_port(), world_size=1), "TORCHELASTIC_RUN_ID": "job"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(rank_zero, "_SAID", WarningCache())  # said again here, whatever an earlier test said
    torch.distributed.init_process_group("gloo")
    try:
        group = torch.distributed.group.WORLD
        with caplog.at_level(logging.INFO):
            fabric = Fabric(strategy="envddp", accelerator="cpu")
            fabric.launch()
            model, optimizer = fabric.setup(*model_and_optimizer())
            train_step(fabric, model, optimizer)
        assert torch.distributed.group.WORLD is group
        said = [record.getMessage() for record in caplog.records]
        assert [line for line in said if "so no process group" in line] == []
    finally:
        destroy_process_group()
