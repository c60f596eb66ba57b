"""envddp among Lightning's own parts: ClusterEnvironment plugins (Kubeflow, custom) and ``parallel_devices``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import WORKERS, check, finish, free_port, launcher_variables, start_python
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.environments import (
    ClusterEnvironment,
    KubeflowEnvironment,
    LightningEnvironment,
    TorchElasticEnvironment,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_ddp_amp import (
    EnvDDPStrategy,
    LauncherEnvironment,
    LauncherEnvironmentError,
    StrategyConfigurationError,
    TopologyMismatchError,
)

#: What torchrun exports to local rank 1 of 2 on a one-node job.
TORCHRUN_RANK_1_OF_2 = {**launcher_variables(1, 29500), "TORCHELASTIC_RUN_ID": "none"}
#: What a Kubeflow PyTorchJob exports to the pod of rank 1 of 2: no LOCAL_* variables, one process per pod.
KUBEFLOW_POD_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}


class SchedulerEnvironment(ClusterEnvironment):
    """A user's environment: rank 5 of 8, 4 processes on each of 2 nodes, its own rendezvous."""

    def __init__(self, rank: int = 5, local_rank: int = 1, node_rank: int = 1, external: bool = True) -> None:
        self._rank, self._local_rank, self._node_rank, self._external = rank, local_rank, node_rank, external

    @property
    def creates_processes_externally(self) -> bool:
        return self._external

    @property
    def main_address(self) -> str:
        return "scheduler-head"

    @property
    def main_port(self) -> int:
        return 40123

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return 8

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._local_rank

    def node_rank(self) -> int:
        return self._node_rank

    def local_world_size(self) -> int:
        return 4


class SilentEnvironment(SchedulerEnvironment):
    """The same environment without ``local_world_size()``: it does not say how many processes share a node."""

    local_world_size = None  # type: ignore[assignment]


def set_env(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def trainer(**kwargs: Any) -> L.Trainer:
    kwargs.setdefault("accelerator", "cpu")
    return L.Trainer(logger=False, enable_progress_bar=False, **kwargs)


#: The three ways a user hands over an environment.
PASSING: dict[str, Callable[[ClusterEnvironment], L.Trainer]] = {
    "plugins-with-envddp-string": lambda env: trainer(strategy="envddp", plugins=[env]),
    "plugins-with-strategy-instance": lambda env: trainer(strategy=EnvDDPStrategy(), plugins=[env]),
    "strategy-argument": lambda env: trainer(strategy=EnvDDPStrategy(cluster_environment=env)),
}


@pytest.mark.parametrize("passing", PASSING.values(), ids=PASSING.keys())
def test_a_cluster_environment_decides_ranks_and_rendezvous_over_the_launchers_variables(
    monkeypatch: pytest.MonkeyPatch, passing: Callable[[ClusterEnvironment], L.Trainer]
) -> None:
    set_env(monkeypatch, TORCHRUN_RANK_1_OF_2)
    environment = SchedulerEnvironment()
    t = passing(environment)
    assert t.strategy.cluster_environment is environment
    topology = t.strategy.topology
    assert (topology.rank, topology.local_rank, topology.world_size, topology.local_world_size) == (5, 1, 8, 4)
    assert (topology.node_rank, topology.master_addr, topology.master_port) == (1, "scheduler-head", 40123)
    assert topology.launcher == "SchedulerEnvironment"
    assert (t.global_rank, t.local_rank, t.node_rank, t.world_size, t.num_nodes, t.num_devices) == (5, 1, 1, 8, 2, 4)


@pytest.mark.parametrize("passing", PASSING.values(), ids=PASSING.keys())
def test_the_kubeflow_plugin_reads_one_process_per_pod(
    monkeypatch: pytest.MonkeyPatch, passing: Callable[[ClusterEnvironment], L.Trainer]
) -> None:
    set_env(monkeypatch, KUBEFLOW_POD_1_OF_2)
    t = passing(KubeflowEnvironment())
    topology = t.strategy.topology
    assert (topology.rank, topology.local_rank, topology.world_size, topology.local_world_size) == (1, 0, 2, 1)
    assert (topology.node_rank, topology.master_addr, topology.master_port) == (1, "job-master-0", 23456)
    assert (t.global_rank, t.world_size, t.num_nodes, t.num_devices) == (1, 2, 2, 1)
    assert t.strategy.root_device == torch.device("cpu")


def test_without_the_plugin_a_kubeflow_pod_is_told_which_variables_are_missing_and_what_to_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_env(monkeypatch, KUBEFLOW_POD_1_OF_2)
    with pytest.raises(LauncherEnvironmentError) as raised:
        trainer(strategy="envddp")
    message = str(raised.value)
    assert message.startswith("LOCAL_RANK=None: neither LOCAL_RANK nor LOCAL_WORLD_SIZE is set")
    assert "RANK=1 and WORLD_SIZE=2" in message
    assert 'Fix: with one process per node or pod (a Kubeflow PyTorchJob), pass `Trainer(strategy="envddp",' in message
    assert "plugins=[KubeflowEnvironment()])`" in message
    assert "torchrun --nproc-per-node=N" in message


def test_lightnings_own_choice_of_environment_is_replaced_by_envddps_validated_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With no plugin, the Trainer hands over TorchElasticEnvironment (torchrun) or LightningEnvironment.
    set_env(monkeypatch, TORCHRUN_RANK_1_OF_2)
    t = trainer(strategy="envddp")
    assert isinstance(t.strategy.cluster_environment, LauncherEnvironment)
    assert t.strategy.topology.launcher == "torchrun"
    monkeypatch.setenv("RANK", "2")
    for default in (TorchElasticEnvironment(), LightningEnvironment()):
        with pytest.raises(LauncherEnvironmentError, match=r"^RANK='2': it must be below WORLD_SIZE=2"):
            trainer(strategy="envddp", plugins=[default])


def test_a_subclass_of_a_lightning_environment_is_the_users_own(monkeypatch: pytest.MonkeyPatch) -> None:
    class SecondPod(KubeflowEnvironment):
        def global_rank(self) -> int:
            return 0

        def node_rank(self) -> int:
            return 0

    set_env(monkeypatch, KUBEFLOW_POD_1_OF_2)
    assert trainer(strategy="envddp", plugins=[SecondPod()]).strategy.topology.rank == 0


def test_a_kubeflow_pod_missing_a_variable_is_told_which(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {k: v for k, v in KUBEFLOW_POD_1_OF_2.items() if k != "MASTER_PORT"})
    with pytest.raises(LauncherEnvironmentError) as raised:
        trainer(strategy="envddp", plugins=[KubeflowEnvironment()])
    assert str(raised.value) == (
        "KubeflowEnvironment.main_port=None: reading it failed with KeyError: 'MASTER_PORT'. Fix: export the"
        " variables KubeflowEnvironment reads in every process (MASTER_PORT is not set)"
    )


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        (
            SchedulerEnvironment(rank=9),
            "SchedulerEnvironment.global_rank()=9: it must be below 8 (world_size()). Fix: check what"
            " SchedulerEnvironment reads in this process",
        ),
        (
            SchedulerEnvironment(local_rank=4),
            "SchedulerEnvironment.local_rank()=4: it must be below 4 (processes per node)",
        ),
        (
            SchedulerEnvironment(rank=2),
            "SchedulerEnvironment.global_rank()=2: DDP lays ranks out node by node, so node 1's local rank 1 of 4"
            " is rank 5. Fix: make SchedulerEnvironment number the ranks node by node",
        ),
    ],
    ids=["rank-beyond-world", "local-rank-beyond-node", "ranks-not-by-node"],
)
def test_values_an_environment_reports_are_checked(environment: ClusterEnvironment, message: str) -> None:
    with pytest.raises(LauncherEnvironmentError) as raised:
        trainer(strategy="envddp", plugins=[environment])
    assert str(raised.value).startswith(message)


def test_an_environment_that_does_not_say_how_many_processes_share_a_node_is_refused() -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        EnvDDPStrategy(cluster_environment=SilentEnvironment())
    assert str(raised.value) == (
        "cluster_environment='SilentEnvironment': it reports 8 processes but not how many run on each node, and"
        " LOCAL_WORLD_SIZE is not set. Fix: give SilentEnvironment a local_world_size() method returning the"
        " processes per node, or export LOCAL_WORLD_SIZE"
    )


def test_without_local_world_size_the_launchers_local_world_size_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert EnvDDPStrategy(cluster_environment=SilentEnvironment()).topology.local_world_size == 4


def test_an_environment_that_expects_lightning_to_start_the_processes_is_refused() -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        trainer(strategy="envddp", plugins=[SchedulerEnvironment(external=False)])
    assert str(raised.value).startswith(
        "cluster_environment='SchedulerEnvironment': it expects the strategy to start the 8 processes, but envddp"
        " only joins processes that a launcher started. Fix: "
    )


def test_a_plugin_beside_a_strategy_built_with_its_accelerator_is_refused_not_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Built with its accelerator, the strategy can run without a Trainer, so it has read the launcher already.
    set_env(monkeypatch, TORCHRUN_RANK_1_OF_2)
    strategy = EnvDDPStrategy(accelerator=CPUAccelerator())
    with pytest.raises(
        MisconfigurationException, match="cluster_environment set through both strategy class and plugins"
    ):
        L.Trainer(strategy=strategy, plugins=[SchedulerEnvironment()], logger=False)


def test_parallel_devices_are_accepted_as_lightnings_ddp_accepts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TORCHRUN_RANK_1_OF_2)
    t = L.Trainer(strategy=EnvDDPStrategy(parallel_devices=[torch.device("cpu")] * 2), logger=False)
    assert isinstance(t.accelerator, CPUAccelerator)  # chosen from the devices' type, as for Lightning's ddp
    assert (t.num_devices, t.strategy.root_device) == (2, torch.device("cpu"))


def test_parallel_devices_map_local_ranks_to_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TORCHRUN_RANK_1_OF_2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    gpus = [torch.device("cuda", 2), torch.device("cuda", 3)]
    strategy = EnvDDPStrategy(accelerator=CUDAAccelerator(), parallel_devices=gpus)
    assert strategy.root_device == torch.device("cuda", 3)


def test_parallel_devices_must_number_the_processes_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TORCHRUN_RANK_1_OF_2)
    with pytest.raises(TopologyMismatchError) as raised:
        trainer(strategy=EnvDDPStrategy(parallel_devices=[torch.device("cpu")] * 3))
    assert str(raised.value).startswith(
        "parallel_devices=[device(type='cpu'), device(type='cpu'), device(type='cpu')]: the launcher started 2"
        " process(es) on this node (LOCAL_WORLD_SIZE=2). Fix: drop parallel_devices from the strategy"
    )


def test_parallel_devices_and_trainer_devices_must_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TORCHRUN_RANK_1_OF_2)
    with pytest.raises(TopologyMismatchError) as raised:
        trainer(strategy=EnvDDPStrategy(parallel_devices=[torch.device("cpu")] * 2), devices=1)
    assert str(raised.value) == (
        "devices=1: EnvDDPStrategy(parallel_devices=[device(type='cpu'), device(type='cpu')]) names other devices."
        " Fix: name the devices once: drop devices from the Trainer, or parallel_devices from the strategy"
    )


@pytest.mark.multiprocess
def test_a_two_pod_kubeflow_job_trains_with_the_plugin(tmp_path: Path) -> None:
    # Two processes started by hand with what a PyTorchJob exports to its pods: no LOCAL_* variables at all.
    port = free_port()
    pods = [
        start_python(
            str(WORKERS / "train_kubeflow.py"),
            "--out",
            str(tmp_path),
            env={"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        )
        for rank in range(2)
    ]
    for pod in pods:
        check(finish(pod, timeout=180))
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {
            "global_rank": rank,
            "world_size": 2,
            "num_nodes": 2,
            "local_rank": 0,
            "local_world_size": 1,
            "node_rank": rank,
            "launcher": "KubeflowEnvironment",
            "environment": "KubeflowEnvironment",
            "steps": 4,  # 64 samples, 32 per rank, batches of 8
        }
    first, second = (torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
