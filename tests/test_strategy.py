"""EnvDDPStrategy in one process: registration, Trainer flags, arguments, and the CUDA branches (with doubles)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from conftest import free_port, needs_cpu_fp16, worker_env
from lightning.fabric import Fabric
from lightning.fabric.accelerators import CPUAccelerator as FabricCPUAccelerator
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_localSGD
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_amp import (
    EnvDDPStrategy,
    StrategyConfigurationError,
    TopologyMismatchError,
)
from lightning_ddp_amp.ddp.wrapper import DEVIATIONS
from lightning_ddp_amp.fabric import EnvDDPStrategy as FabricEnvDDPStrategy
from lightning_ddp_amp.launch import process_group, selflaunch
from lightning_ddp_amp.launch.topology import Topology

TWO_RANKS = {
    "RANK": "1",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is local rank 1 of 2, as torchrun would start it (no network is touched)."""
    for name, value in TWO_RANKS.items():
        monkeypatch.setenv(name, value)


def trainer(**kwargs: Any) -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **kwargs)


def test_import_registers_both_names() -> None:
    assert StrategyRegistry["envddp"]["strategy"] is EnvDDPStrategy
    entry = StrategyRegistry["envddp_find_unused_parameters_true"]
    assert entry["strategy"] is EnvDDPStrategy
    assert entry["init_params"] == {"find_unused_parameters": True}


def test_find_unused_parameters_alias_reaches_ddp() -> None:
    strategy = trainer(strategy="envddp_find_unused_parameters_true").strategy
    assert isinstance(strategy, EnvDDPStrategy)
    assert strategy.ddp_options == {"find_unused_parameters": True, "gradient_as_bucket_view": True}


def test_gradients_are_bucket_views_by_default() -> None:
    # Faster with the same numerics (benchmarks/); the equivalence tests compare against DDP at its defaults.
    assert EnvDDPStrategy().ddp_options == {"gradient_as_bucket_view": True}
    assert "gradient_as_bucket_view" not in EnvDDPStrategy(gradient_as_bucket_view=False).ddp_options


def test_without_launcher_it_is_one_process_on_the_default_device() -> None:
    t = trainer(strategy="envddp")
    assert (t.world_size, t.global_rank, t.num_devices, t.num_nodes) == (1, 0, 1, 1)
    assert t.strategy.root_device == torch.device("cpu")
    assert not t.strategy.topology.is_distributed


def test_auto_devices_and_nodes_take_the_launchers_values(two_ranks: None) -> None:
    t = trainer(strategy="envddp")
    assert (t.world_size, t.global_rank, t.local_rank, t.num_devices, t.num_nodes) == (2, 1, 1, 2, 1)
    assert t.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_rank_zero_utilities_follow_the_launchers_rank(two_ranks: None) -> None:
    from lightning.pytorch.utilities import rank_zero_only

    t = trainer(strategy="envddp")
    assert rank_zero_only.rank == 1
    assert not t.is_global_zero


def test_explicit_devices_matching_the_launcher_are_accepted(two_ranks: None) -> None:
    assert trainer(strategy="envddp", devices=2).num_devices == 2


def test_explicit_devices_contradicting_the_launcher_name_both(two_ranks: None) -> None:
    with pytest.raises(TopologyMismatchError) as raised:
        trainer(strategy="envddp", devices=1)
    message = str(raised.value)
    assert message.startswith("devices=1: the launcher started 2 process(es) on this node (LOCAL_WORLD_SIZE=2)")
    assert "set devices=2" in message


def test_explicit_num_nodes_contradicting_the_launcher_name_both(two_ranks: None) -> None:
    with pytest.raises(TopologyMismatchError, match=r"^num_nodes=2: the launcher started 1 node\(s\)"):
        trainer(strategy="envddp", num_nodes=2)


def test_devices_without_a_launcher_outside_a_script_says_how_to_launch() -> None:
    # Self-launch re-runs the script; `python -c` (like a notebook) has none, so it is an error naming the fix.
    code = "import lightning as L, lightning_ddp_amp; L.Trainer(strategy='envddp', devices=2, accelerator='cpu')"
    result = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "StrategyConfigurationError: devices='N > 1': envddp starts the ranks by running this script again" in (
        result.stderr
    )
    assert "`torchrun --nproc-per-node=N train.py`" in result.stderr


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The torchrun arguments of each self-launch, which exits at once as the agent does once the ranks are done."""
    started: list[list[str]] = []

    def launch(arguments: list[str]) -> None:
        started.append(arguments)
        raise SystemExit(0)

    monkeypatch.setattr(selflaunch, "plan", lambda nproc, max_restarts: [f"--nproc-per-node={nproc}", "train.py"])
    monkeypatch.setattr(selflaunch, "launch", launch)
    return started


def test_building_the_trainer_or_checking_its_flags_starts_nothing_and_fit_starts_the_ranks(
    started: list[list[str]],
) -> None:
    EnvDDPStrategy(accelerator=CPUAccelerator()).check_trainer_flags(devices=2, num_nodes=1)
    assert started == []
    built = trainer(strategy="envddp", devices=2)
    assert started == []
    with pytest.raises(SystemExit):
        built.fit(BoringModel())
    assert started == [["--nproc-per-node=2", "train.py"]]


@pytest.mark.parametrize("first", ["validate", "test", "predict"])
def test_whichever_trainer_call_comes_first_starts_the_ranks(started: list[list[str]], first: str) -> None:
    with pytest.raises(SystemExit):
        getattr(trainer(strategy="envddp", devices=2), first)(BoringModel())
    assert started == [["--nproc-per-node=2", "train.py"]]


def test_the_agent_leaves_the_trainers_callbacks_and_loggers_to_the_ranks(
    started: list[list[str]], tmp_path: Path
) -> None:
    # Lightning hands an exception in fit to them as a failed run; the agent's exit is none, and it trained nothing.
    seen: list[str] = []

    class Watches(L.Callback):
        def on_exception(self, *args: Any) -> None:
            seen.append("on_exception")

    class Logs(CSVLogger):
        def finalize(self, status: str) -> None:
            seen.append(f"finalize {status}")

    callbacks = [Watches(), OnExceptionCheckpoint(tmp_path)]
    built = L.Trainer(strategy="envddp", accelerator="cpu", devices=2, callbacks=callbacks, logger=Logs(tmp_path))
    with pytest.raises(SystemExit) as exited:
        built.fit(BoringModel())
    assert exited.value.code == 0
    assert seen == []
    assert list(tmp_path.glob("*.ckpt")) == []


def test_ctrl_c_before_torchrun_takes_sigint_over_exits_130_as_a_shell_reports_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupted(arguments: list[str]) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(selflaunch, "plan", lambda nproc, max_restarts: ["train.py"])
    monkeypatch.setattr(selflaunch, "launch", interrupted)
    with pytest.raises(SystemExit) as exited:
        trainer(strategy="envddp", devices=2).fit(BoringModel())
    assert exited.value.code == 130  # Lightning's own handling of a KeyboardInterrupt in fit would exit 1


def test_one_device_without_a_launcher_trains_alone() -> None:
    t = trainer(strategy="envddp", devices=1)
    assert (t.world_size, t.num_devices) == (1, 1)


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_max_restarts_must_be_a_whole_number(value: object) -> None:
    with pytest.raises(StrategyConfigurationError, match=rf"^max_restarts={value!r}: it must be a whole number"):
        EnvDDPStrategy(max_restarts=value)  # type: ignore[arg-type]


def test_max_restarts_under_an_external_launcher_says_where_they_belong(
    two_ranks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")  # the warning comes from rank 0 only
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.warns(UserWarning, match=r"max_restarts=2\) only applies when envddp starts the ranks itself"):
        trainer(strategy=EnvDDPStrategy(max_restarts=2))


def test_exact_eval_needs_the_strategy_to_shard() -> None:
    with pytest.raises(StrategyConfigurationError, match=r"^exact_eval=True: Trainer\(use_distributed_sampler=False\)"):
        trainer(strategy=EnvDDPStrategy(exact_eval=True), use_distributed_sampler=False)


def test_sync_batchnorm_on_cpu_ranks_is_an_error_when_the_trainer_is_built(two_ranks: None) -> None:
    with pytest.raises(StrategyConfigurationError, match=r"^sync_batchnorm=True: torch's SyncBatchNorm .* 2 CPU ranks"):
        trainer(strategy="envddp", sync_batchnorm=True)
    trainer(strategy="envddp")  # without it, these ranks train


def test_sync_batchnorm_in_one_cpu_process_trains_on_torchs_fallback_to_batchnorm() -> None:
    class WithBatchNorm(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
            self.trained_with: set[str] = set()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.trained_with.add(type(self.net[1]).__name__)
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = WithBatchNorm()
    t = trainer(strategy="envddp", sync_batchnorm=True, max_steps=2, enable_checkpointing=False)
    t.fit(module, torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=4))
    assert module.trained_with == {"SyncBatchNorm"} and t.global_step == 2


def test_bf16_compression_on_gloo_is_an_error_before_the_process_group_starts(two_ranks: None) -> None:
    strategy = trainer(strategy=EnvDDPStrategy(ddp_comm_hook="bf16")).strategy
    with pytest.raises(StrategyConfigurationError, match=r"^ddp_comm_hook='bf16': .*needs NCCL.*runs gloo"):
        strategy.setup_environment()
    assert not dist.is_initialized()


def test_an_unknown_comm_hook_name_is_an_error_that_lists_the_known_ones() -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        EnvDDPStrategy(ddp_comm_hook="fp8")  # type: ignore[arg-type]
    assert str(raised.value) == (
        "ddp_comm_hook='fp8': it is not a known hook name (known: bf16, fp16). Fix: use one of those names, or pass"
        " the hook function itself"
    )


def test_strategy_instance_gets_the_same_checks(two_ranks: None) -> None:
    with pytest.raises(TopologyMismatchError, match=r"^devices=3"):
        trainer(strategy=EnvDDPStrategy(), devices=3)


def test_only_changed_ddp_options_are_passed_on() -> None:
    # dim: an argument every supported torch's DistributedDataParallel takes (init_sync came with torch 2.4), passed
    # through untouched even at torch's default.
    strategy = EnvDDPStrategy(static_graph=True, bucket_cap_mb=50, gradient_as_bucket_view=False, dim=0)
    assert strategy.ddp_options == {"static_graph": True, "bucket_cap_mb": 50, "dim": 0}


def test_options_set_to_torchs_own_ddp_defaults_are_not_passed_on() -> None:
    torch_defaults = inspect.signature(DistributedDataParallel).parameters
    names = ("find_unused_parameters", "static_graph", "bucket_cap_mb", "broadcast_buffers")
    strategy = EnvDDPStrategy(**{name: torch_defaults[name].default for name in names})
    assert strategy.ddp_options == {"gradient_as_bucket_view": True}


def test_each_deviation_from_torchs_ddp_defaults_differs_from_them_and_says_why() -> None:
    torch_defaults = inspect.signature(DistributedDataParallel).parameters
    assert "gradient_as_bucket_view" in DEVIATIONS
    for name, deviation in DEVIATIONS.items():
        assert deviation.value != torch_defaults[name].default
        assert deviation.reason


def test_post_local_sgd_model_averaging_is_refused_naming_the_fix() -> None:
    with pytest.raises(
        StrategyConfigurationError,
        match=r"^model_averaging_period=4: envddp does not run post-localSGD model averaging",
    ) as raised:
        EnvDDPStrategy(model_averaging_period=4)
    assert "Fix: drop model_averaging_period and the PostLocalSGDState, or use Trainer(strategy='ddp')" in str(
        raised.value
    )


def test_a_post_local_sgd_comm_state_is_refused_when_the_strategy_is_built() -> None:
    state = post_localSGD.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=10)
    with pytest.raises(StrategyConfigurationError, match=r"^ddp_comm_state='PostLocalSGDState': envddp does not run"):
        EnvDDPStrategy(ddp_comm_hook=post_localSGD.post_localSGD_hook, ddp_comm_state=state)


def test_misspelled_ddp_option_is_caught_before_any_launch() -> None:
    with pytest.raises(
        StrategyConfigurationError, match=r"^find_unused_parameter=True: .*did you mean 'find_unused_parameters'"
    ):
        EnvDDPStrategy(find_unused_parameter=True)


@pytest.mark.parametrize("name", ["device_ids", "output_device"])
def test_device_options_are_the_strategys_to_set(name: str) -> None:
    with pytest.raises(StrategyConfigurationError, match=rf"^{name}=.*: the strategy sets it from LOCAL_RANK"):
        EnvDDPStrategy(**{name: [0]})


@pytest.mark.parametrize(
    ("name", "hook"), [("fp16", default_hooks.fp16_compress_hook), ("bf16", default_hooks.bf16_compress_hook)]
)
def test_compression_hooks_can_be_named(name: str, hook: Any) -> None:
    assert EnvDDPStrategy(ddp_comm_hook=name)._ddp_comm_hook is hook


def test_unknown_comm_hook_name_is_an_error() -> None:
    with pytest.raises(StrategyConfigurationError, match=r"^ddp_comm_hook='fp8': .*known: bf16, fp16"):
        EnvDDPStrategy(ddp_comm_hook="fp8")  # type: ignore[arg-type]


def test_timeout_accepts_seconds() -> None:
    assert EnvDDPStrategy(timeout=90)._timeout == timedelta(seconds=90)


def test_timeout_none_means_torchs_default() -> None:
    assert EnvDDPStrategy(timeout=None)._timeout == timedelta(minutes=30)


@pytest.mark.parametrize(
    ("timeout", "words"), [(True, "it is a bool"), (float("inf"), "it is too large"), (1e300, "it is too large")]
)
def test_timeout_that_is_not_a_duration_is_an_error(timeout: Any, words: str) -> None:
    with pytest.raises(StrategyConfigurationError, match=rf"^timeout=.*: {words}"):
        EnvDDPStrategy(timeout=timeout)


@pytest.mark.parametrize("timeout", [0, -5, timedelta(seconds=-1)])
def test_non_positive_timeout_is_an_error(timeout: Any) -> None:
    with pytest.raises(StrategyConfigurationError, match=r"^timeout=.*: it must be positive"):
        EnvDDPStrategy(timeout=timeout)


def test_non_numeric_timeout_is_an_error() -> None:
    with pytest.raises(StrategyConfigurationError, match=r"^timeout='soon'"):
        EnvDDPStrategy(timeout="soon")  # type: ignore[arg-type]


class RecordingCUDAAccelerator(CUDAAccelerator):
    """Test double: a CUDA accelerator that records device pinning instead of calling the driver."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def setup_device(self, device: torch.device) -> None:
        self.calls.append(f"set_device({device})")


#: What process_group sets for NCCL runs; a test must not leave it to the subprocesses of later tests.
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def confine_nccl_error_handling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start without the variable and, at teardown, restore it as it was, even though the code under test sets it.

    monkeypatch undoes only its own changes, and deleting an absent variable is none: setting it first records
    "absent", so the value process_group sets is removed at teardown too.
    """
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "")
    monkeypatch.delenv(NCCL_ERROR_HANDLING)


def make_cuda_double(monkeypatch: pytest.MonkeyPatch) -> tuple[EnvDDPStrategy, list[str]]:
    """The ``cuda_double`` fixture's strategy, with every patch made through ``monkeypatch``."""
    confine_nccl_error_handling(monkeypatch)
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # The binding torch 2.3 and later make (device_id=...); test_torch_features.py covers a torch without it.
    monkeypatch.setattr(process_group, "BINDS_DEVICE", True)

    def tcp_store(host: str, port: int, world_size: int, **kwargs: Any) -> str:
        calls.append(f"TCPStore({host}:{port}, world_size={world_size}, is_master={kwargs['is_master']})")
        return "store"

    def init_process_group(backend: str, **kwargs: Any) -> None:
        calls.append(
            f"init_process_group({backend}, device_id={kwargs['device_id']}, rank={kwargs['rank']},"
            f" store={kwargs['store']})"
        )

    class PrefixStoreDouble:
        def __init__(self, prefix: str, store: str) -> None:
            self.name = f"{prefix} over {store}"

        def add(self, key: str, amount: int) -> int:
            calls.append(f"add({key}, {amount})")
            return amount

        def set(self, key: str, value: str) -> None:
            pass

        def wait(self, keys: list[str], timeout: Any) -> None:
            pass  # every rank has joined

        def __str__(self) -> str:
            return self.name

    # Doubles of torch.distributed's store and group: no peer exists in this test.
    monkeypatch.setattr(dist, "TCPStore", tcp_store)
    monkeypatch.setattr(dist, "PrefixStore", PrefixStoreDouble)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    return EnvDDPStrategy(accelerator=RecordingCUDAAccelerator(calls)), calls


@pytest.fixture
def cuda_double(monkeypatch: pytest.MonkeyPatch, two_ranks: None) -> tuple[EnvDDPStrategy, list[str]]:
    """Local rank 1 of 2 on a machine whose two GPUs are doubles; init_process_group records its arguments."""
    return make_cuda_double(monkeypatch)


def test_cuda_rank_is_pinned_to_its_gpu_before_nccl_starts(cuda_double: tuple[EnvDDPStrategy, list[str]]) -> None:
    strategy, calls = cuda_double
    strategy.setup_environment()
    assert calls == [
        "set_device(cuda:1)",
        "TCPStore(127.0.0.1:29500, world_size=2, is_master=False)",
        "add(joined, 1)",
        "init_process_group(nccl, device_id=cuda:1, rank=1, store=lightning_ddp_amp/attempt_0 over store)",
    ]


def test_the_process_group_and_its_store_get_the_strategys_timeout(
    two_ranks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not torch's 30 minutes: a peer that hangs mid-training would hold every other rank, and the job, that long.
    make_cuda_double(monkeypatch)
    timeouts: dict[str, Any] = {}

    def tcp_store(host: str, port: int, world_size: int, **kwargs: Any) -> str:
        timeouts["store"] = kwargs.get("timeout")
        return "store"

    def init_process_group(backend: str, **kwargs: Any) -> None:
        timeouts["group"] = kwargs.get("timeout")

    monkeypatch.setattr(dist, "TCPStore", tcp_store)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    EnvDDPStrategy(accelerator=RecordingCUDAAccelerator([]), timeout=90).setup_environment()
    assert timeouts == {"store": timedelta(seconds=90), "group": timedelta(seconds=90)}


@pytest.mark.parametrize("before", [None, "0"])
def test_nccl_error_handling_variable_does_not_outlive_the_test(
    monkeypatch: pytest.MonkeyPatch, two_ranks: None, before: str | None
) -> None:
    if before is None:
        monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
    else:
        monkeypatch.setenv(NCCL_ERROR_HANDLING, before)
    with pytest.MonkeyPatch.context() as test_patches:
        strategy, _ = make_cuda_double(test_patches)
        strategy.setup_environment()
        assert os.environ[NCCL_ERROR_HANDLING] == "1"  # process_group sets it for NCCL runs, as intended
    assert os.environ.get(NCCL_ERROR_HANDLING) == before


def test_a_restarted_attempt_meets_on_a_store_namespace_of_its_own(
    cuda_double: tuple[EnvDDPStrategy, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    strategy, calls = cuda_double
    strategy.setup_environment()
    assert calls[-1].endswith("store=lightning_ddp_amp/attempt_2 over store)")


def test_cuda_ddp_uses_the_local_gpu(cuda_double: tuple[EnvDDPStrategy, list[str]]) -> None:
    strategy, _ = cuda_double
    assert strategy.root_device == torch.device("cuda", 1)
    assert strategy.determine_ddp_device_ids() == [1]


def test_backend_can_be_overridden(cuda_double: tuple[EnvDDPStrategy, list[str]]) -> None:
    _, calls = cuda_double
    strategy = EnvDDPStrategy(accelerator=RecordingCUDAAccelerator(calls), process_group_backend="gloo")
    strategy.setup_environment()
    assert calls[-1].startswith("init_process_group(gloo,")


# --- a process group the script started itself -----------------------------------------------------------------


@pytest.fixture
def script_group(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A one-rank group started as a classic script starts it, before the Trainer (``indirect`` param: the backend);
    ended after the test."""
    dist.init_process_group(getattr(request, "param", "gloo"), store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    yield group
    process_group.destroy_process_group()


THE_SCRIPTS_GROUP = r"the process group the script started \(its dist\.init_process_group\)"
DELETE_THE_LINE = (
    r"delete the script's dist\.init_process_group\(\.\.\.\) line \(envddp starts the group from the launcher's"
    r" variables\)"
)


def test_a_script_group_that_numbers_the_rank_otherwise_is_an_error(two_ranks: None, script_group: Any) -> None:
    strategy = trainer(strategy=EnvDDPStrategy()).strategy
    with pytest.raises(
        TopologyMismatchError,
        match=rf"^rank=0: {THE_SCRIPTS_GROUP} numbers this process 0, but it is rank 1 of 2, launched by environment\."
        rf" Fix: {DELETE_THE_LINE}$",
    ):
        strategy.setup_environment()
    assert dist.group.WORLD is script_group


def test_a_script_group_of_another_size_is_an_error(
    two_ranks: None, script_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    strategy = trainer(strategy=EnvDDPStrategy()).strategy
    with pytest.raises(
        TopologyMismatchError,
        match=rf"^world_size=1: {THE_SCRIPTS_GROUP} has 1 rank\(s\), but the job has 2, launched by environment\. Fix: {DELETE_THE_LINE}$",
    ):
        strategy.setup_environment()


def test_a_script_group_without_a_launcher_says_to_start_one_before_deleting_the_line(
    script_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A script that started a group of 2 on its own variables: deleting the line alone would train 2 lone processes.
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(
        TopologyMismatchError,
        match=rf"^world_size=2: {THE_SCRIPTS_GROUP} has 2 rank\(s\), but the job has 1, started without a launcher"
        r" \(no RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for envddp to read\)\. Fix: start the script with torchrun"
        rf" \(or srun, mpirun\), which sets them, and {DELETE_THE_LINE}$",
    ):
        process_group.check_script_group(Topology(), "gloo", torch.device("cpu"), backend_given=False)


def test_a_script_group_on_another_backend_than_the_one_given_is_an_error(script_group: Any) -> None:
    strategy = trainer(strategy=EnvDDPStrategy(process_group_backend="nccl")).strategy
    with pytest.raises(
        StrategyConfigurationError,
        match=rf"^process_group_backend='nccl': {THE_SCRIPTS_GROUP} runs gloo for cpu tensors\. Fix: pass"
        rf" process_group_backend='gloo' to train on the script's group, or {DELETE_THE_LINE}$",
    ):
        strategy.setup_environment()


@pytest.mark.parametrize("script_group", ["cuda:gloo"], indirect=True)
def test_a_script_group_without_a_backend_for_the_device_is_an_error(script_group: Any) -> None:
    strategy = trainer(strategy=EnvDDPStrategy()).strategy
    with pytest.raises(
        StrategyConfigurationError,
        match=rf"^backend='cuda:gloo': {THE_SCRIPTS_GROUP} has no backend for cpu tensors, where envddp would use"
        rf" gloo\. Fix: {DELETE_THE_LINE}, or start it with backend='gloo'$",
    ):
        strategy.setup_environment()


@pytest.mark.parametrize("script_group", ["cuda:gloo"], indirect=True)
def test_a_given_backend_the_script_group_lacks_for_the_device_is_an_error(script_group: Any) -> None:
    strategy = trainer(strategy=EnvDDPStrategy(process_group_backend="gloo")).strategy
    with pytest.raises(
        StrategyConfigurationError,
        match=rf"^process_group_backend='gloo': {THE_SCRIPTS_GROUP} has no backend for cpu tensors\."
        rf" Fix: {DELETE_THE_LINE}$",
    ):
        strategy.setup_environment()


def test_a_script_group_on_another_backend_than_envddps_choice_is_an_error(script_group: Any) -> None:
    # On CUDA envddp would start NCCL; the script's group runs gloo for CUDA tensors too.
    with pytest.raises(
        StrategyConfigurationError,
        match=rf"^backend='cpu:gloo,cuda:gloo': {THE_SCRIPTS_GROUP} runs gloo for cuda tensors, where envddp would"
        rf" use nccl\. Fix: {DELETE_THE_LINE}; or, to train on gloo, pass"
        rf" EnvDDPStrategy\(process_group_backend='gloo'\)$",
    ):
        process_group.check_script_group(Topology(), "nccl", torch.device("cuda", 0), backend_given=False)


@pytest.mark.parametrize("backend", [None, "gloo"])
def test_a_script_group_that_matches_is_trained_on_and_left_to_the_script(
    script_group: Any, backend: str | None
) -> None:
    model = BoringModel()
    fit = trainer(strategy=EnvDDPStrategy(process_group_backend=backend), max_steps=1, enable_checkpointing=False)
    fit.fit(model)
    assert fit.global_step == 1
    assert dist.group.WORLD is script_group


def test_only_a_group_envddp_did_not_start_counts_as_the_scripts() -> None:
    alone = Topology(world_size=1, master_addr="127.0.0.1", master_port=free_port(), launcher="torchrun")
    process_group.init_process_group(alone, "gloo", timedelta(seconds=30), torch.device("cpu"))
    try:
        assert not process_group.started_by_script()
    finally:
        process_group.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert process_group.started_by_script()
    finally:
        process_group.destroy_process_group()
    assert not process_group.started_by_script()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_auto_resume_setting_reads_back_as_given(enabled: bool) -> None:
    assert EnvDDPStrategy(auto_resume=enabled).auto_resume is enabled


# --- reduce: what Lightning's sync_dist logging gets back --------------------------------------------------------

REDUCE_OPS = ["mean", "avg", "sum", "max", "min"]
REDUCE_INPUTS = {
    "int64": torch.tensor([19, 18]),
    "int32": torch.tensor([7, -3], dtype=torch.int32),
    "float32": torch.tensor([1.5, -2.25]),
    "bfloat16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
}


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("name", list(REDUCE_INPUTS))
def test_reduce_keeps_floats_in_their_dtype_and_averages_integers_in_the_default_one(
    script_group: Any, op: str, name: str
) -> None:
    value = REDUCE_INPUTS[name]
    reduced = EnvDDPStrategy().reduce(value.clone(), reduce_op=op)
    integer_mean = not value.is_floating_point() and op in ("mean", "avg")
    # Never float64: apex O1 refuses to divide a float32 sum by it, and MPS has none.
    assert reduced.dtype == (torch.get_default_dtype() if integer_mean else value.dtype)
    assert torch.equal(reduced, value.to(reduced.dtype))  # one rank: every op returns the value itself


def test_an_integer_mean_leaves_its_input_unchanged(script_group: Any) -> None:
    value = torch.tensor([3, 4])
    EnvDDPStrategy().reduce(value)
    assert torch.equal(value, torch.tensor([3, 4]))


@needs_cpu_fp16
def test_lightnings_epoch_mean_divides_by_a_reduced_count_under_apex_o1(script_group: Any, apex_double: Any) -> None:
    # Lightning's epoch mean: the reduced float32 sum of the logged values over the reduced integer sample count.
    model = torch.nn.Linear(2, 2)
    apex_double.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    count = EnvDDPStrategy().reduce(torch.tensor(4), reduce_op="mean")
    mean = torch.tensor(6.0) / count
    assert (mean.dtype, mean.item()) == (torch.float32, 1.5)
    with pytest.raises(NotImplementedError, match="Do not know how to handle these types to promote"):
        torch.tensor(6.0) / torch.tensor(4.0, dtype=torch.float64)  # what a float64 count met under apex O1


# --- an envddp instance handed to the Trainer or to Fabric -------------------------------------------------------


def test_the_trainers_envddp_built_with_its_accelerator_builds_a_trainer_on_that_accelerator() -> None:
    accelerator = CPUAccelerator()
    t = L.Trainer(strategy=EnvDDPStrategy(accelerator=accelerator), logger=False, enable_progress_bar=False)
    assert t.accelerator is accelerator
    assert (t.num_devices, t.strategy.root_device) == (1, torch.device("cpu"))


def test_fabrics_envddp_built_with_fabrics_accelerator_builds_and_trains_one_process() -> None:
    accelerator = FabricCPUAccelerator()
    fabric = Fabric(strategy=FabricEnvDDPStrategy(accelerator=accelerator))
    assert fabric.accelerator is accelerator
    fabric.launch()
    module = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    before = module.weight.detach().clone()
    fabric.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    assert (fabric.world_size, model.device) == (1, torch.device("cpu"))
    assert not torch.equal(module.weight, before)


def test_fabrics_envddp_built_with_its_accelerator_takes_the_launchers_devices(two_ranks: None) -> None:
    fabric = Fabric(strategy=FabricEnvDDPStrategy(accelerator=FabricCPUAccelerator()))
    assert (fabric.world_size, fabric.global_rank, fabric.strategy.root_device) == (2, 1, torch.device("cpu"))
    assert fabric.strategy.parallel_devices == [torch.device("cpu")] * 2


def test_a_strategy_whose_fabric_is_refused_keeps_its_accelerator() -> None:
    accelerator = FabricCPUAccelerator()
    strategy = FabricEnvDDPStrategy(accelerator=accelerator)
    with pytest.raises(ValueError, match="cluster_environment set through both strategy class and plugins"):
        Fabric(strategy=strategy, plugins=[LightningEnvironment()])
    assert strategy.accelerator is accelerator


def test_the_trainers_envddp_handed_to_fabric_is_refused_naming_fabrics_import() -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        Fabric(strategy=EnvDDPStrategy(), accelerator="cpu")  # type: ignore[arg-type]
    assert str(raised.value) == (
        "strategy='lightning_ddp_amp.EnvDDPStrategy(...)': it is the Trainer's envddp, built on the Trainer's strategy"
        " classes, which Fabric cannot run. Fix: use Fabric's: `from lightning_ddp_amp.fabric import EnvDDPStrategy`,"
        ' or Fabric(strategy="envddp")'
    )


def test_fabrics_envddp_handed_to_the_trainer_is_refused_naming_the_trainers_import() -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        trainer(strategy=FabricEnvDDPStrategy())
    assert str(raised.value) == (
        "strategy='lightning_ddp_amp.fabric.EnvDDPStrategy(...)': it is Fabric's envddp, built on Fabric's strategy"
        " classes, which the Trainer cannot run. Fix: use the Trainer's: `from lightning_ddp_amp import"
        ' EnvDDPStrategy`, or Trainer(strategy="envddp")'
    )
