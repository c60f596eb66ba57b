"""srun and mpirun: the topology they export, which launcher wins, and an error naming their variable."""

from __future__ import annotations

import pytest

from lightning_ddp_amp import LauncherEnvironmentError, Topology, read_topology
from lightning_ddp_amp.environment import check_rank_variables, detect_launcher

# `srun --nodes=2 --ntasks-per-node=2 python train.py`: the task with global rank 3, on the second node.
SRUN_RANK_3_OF_4 = {
    "SLURM_JOB_ID": "4711234",
    "SLURM_JOB_NAME": "train",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}
# `mpirun -np 4 --map-by ppr:2:node -x MASTER_ADDR=node0 python train.py`: global rank 2.
MPIRUN_RANK_2_OF_4 = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "MASTER_ADDR": "node0",
}
TORCHRUN_RANK_0_OF_2 = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "job",
}


def test_srun_topology_with_rank_zero_on_the_first_host_and_lightnings_port() -> None:
    assert read_topology(SRUN_RANK_3_OF_4, []) == Topology(
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=1,
        master_addr="gpu07",
        master_port=15000 + 1234,
        launcher="srun",
    )


def test_srun_honours_master_address_and_port_when_set() -> None:
    topology = read_topology({**SRUN_RANK_3_OF_4, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "23456"}, [])
    assert (topology.master_addr, topology.master_port) == ("10.1.1.1", 23456)


@pytest.mark.parametrize("name", ["SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])
def test_srun_tasks_per_node_come_from_any_of_slurms_variables(name: str) -> None:
    env = {k: v for k, v in SRUN_RANK_3_OF_4.items() if "TASKS_PER_NODE" not in k}
    env[name] = "2" if name == "SLURM_NTASKS_PER_NODE" else "2,2"
    assert read_topology(env, []).local_world_size == 2


def test_srun_node_rank_is_derived_without_slurm_nodeid() -> None:
    env = {k: v for k, v in SRUN_RANK_3_OF_4.items() if k != "SLURM_NODEID"}
    assert read_topology(env, []).node_rank == 1


def test_interactive_slurm_allocation_is_a_single_process() -> None:
    # `salloc` then `python train.py`: SLURM's variables describe the allocation, not this process (Lightning's rule).
    assert read_topology({**SRUN_RANK_3_OF_4, "SLURM_JOB_NAME": "interactive"}, []) == Topology()


def test_mpirun_topology() -> None:
    assert read_topology(MPIRUN_RANK_2_OF_4, []) == Topology(
        rank=2,
        local_rank=0,
        world_size=4,
        local_world_size=2,
        node_rank=1,
        master_addr="node0",
        master_port=29500,
        launcher="mpirun",
    )


def test_mpirun_on_one_node_meets_on_the_loopback() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    topology = read_topology(env, [])
    assert (topology.master_addr, topology.master_port, topology.node_rank) == ("127.0.0.1", 29500, 0)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({**SRUN_RANK_3_OF_4, **TORCHRUN_RANK_0_OF_2}, "torchrun"),
        ({**MPIRUN_RANK_2_OF_4, **TORCHRUN_RANK_0_OF_2}, "torchrun"),
        ({**MPIRUN_RANK_2_OF_4, **SRUN_RANK_3_OF_4}, "srun"),
    ],
)
def test_torchruns_variables_win_then_sruns(env: dict[str, str], expected: str) -> None:
    assert detect_launcher(env, []) == expected
    assert read_topology(env, []).launcher == expected


def test_torchrun_started_by_srun_on_every_node_reads_torchruns_ranks() -> None:
    topology = read_topology({**SRUN_RANK_3_OF_4, **TORCHRUN_RANK_0_OF_2}, [])
    assert (topology.rank, topology.world_size, topology.master_addr) == (0, 2, "10.0.0.5")


@pytest.mark.parametrize(
    ("base", "change", "field", "words"),
    [
        (SRUN_RANK_3_OF_4, {"SLURM_PROCID": "4"}, "SLURM_PROCID", "must be below SLURM_NTASKS=4"),
        (SRUN_RANK_3_OF_4, {"SLURM_PROCID": None}, "SLURM_PROCID", "it is not set"),
        (SRUN_RANK_3_OF_4, {"SLURM_LOCALID": "2"}, "SLURM_LOCALID", "must be below SLURM_STEP_TASKS_PER_NODE=2"),
        (SRUN_RANK_3_OF_4, {"SLURM_NTASKS": "four"}, "SLURM_NTASKS", "not an integer"),
        (
            SRUN_RANK_3_OF_4,
            {"SLURM_STEP_TASKS_PER_NODE": "3,1"},
            "SLURM_STEP_TASKS_PER_NODE",
            "different numbers of tasks",
        ),
        (SRUN_RANK_3_OF_4, {"SLURM_STEP_TASKS_PER_NODE": "2(x"}, "SLURM_STEP_TASKS_PER_NODE", "not SLURM's list"),
        (SRUN_RANK_3_OF_4, {"SLURM_STEP_TASKS_PER_NODE": "3"}, "SLURM_STEP_TASKS_PER_NODE", "whole number of nodes"),
        (SRUN_RANK_3_OF_4, {"SLURM_NODEID": "2"}, "SLURM_NODEID", "below the number of nodes=2"),
        (
            SRUN_RANK_3_OF_4,
            {"SLURM_JOB_NODELIST": None, "SLURM_STEP_NODELIST": None, "MASTER_PORT": "1234"},
            "MASTER_ADDR",
            "not set",
        ),
        (SRUN_RANK_3_OF_4, {"SLURM_JOB_ID": None}, "MASTER_PORT", "not set"),
        (MPIRUN_RANK_2_OF_4, {"OMPI_COMM_WORLD_RANK": "-1"}, "OMPI_COMM_WORLD_RANK", "at least 0"),
        (MPIRUN_RANK_2_OF_4, {"OMPI_COMM_WORLD_LOCAL_RANK": None}, "OMPI_COMM_WORLD_LOCAL_RANK", "not set"),
        (
            MPIRUN_RANK_2_OF_4,
            {"OMPI_COMM_WORLD_LOCAL_SIZE": "3"},
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "whole number of nodes",
        ),
        (MPIRUN_RANK_2_OF_4, {"MASTER_ADDR": None}, "MASTER_ADDR", "not set"),
    ],
)
def test_bad_srun_or_mpirun_environment_names_the_variable(
    base: dict[str, str], change: dict[str, str | None], field: str, words: str
) -> None:
    env = {**base, **change}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(LauncherEnvironmentError) as raised:
        read_topology(env, [])
    assert raised.value.field == field
    assert words in str(raised.value)
    assert "Fix: " in str(raised.value)


def test_mpirun_across_nodes_says_how_to_pass_the_address() -> None:
    env = {k: v for k, v in MPIRUN_RANK_2_OF_4.items() if k != "MASTER_ADDR"}
    with pytest.raises(LauncherEnvironmentError, match=r"mpirun -x MASTER_ADDR=<host of rank 0>"):
        read_topology(env, [])


def test_malformed_slurm_procid_is_explained_before_lightning_parses_it() -> None:
    # Lightning's import parses SLURM_PROCID with a bare int(), as it does RANK.
    with pytest.raises(LauncherEnvironmentError, match=r"SLURM_PROCID='x': it is not an integer"):
        check_rank_variables({"SLURM_PROCID": "x"})


def test_lightning_cluster_environment_detects_srun_and_mpirun(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_ddp_amp import LauncherEnvironment

    assert not LauncherEnvironment.detect()
    for name, value in MPIRUN_RANK_2_OF_4.items():
        monkeypatch.setenv(name, value)
    assert LauncherEnvironment.detect()
