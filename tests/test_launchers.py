"""srun and mpirun: the topology they export, which launcher wins, and an error naming their variable."""

from __future__ import annotations

import pytest

from lightning_ddp_amp import LauncherEnvironmentError, Topology, read_topology
from lightning_ddp_amp.launch.environment import check_rank_variables, detect_launcher

# `srun --nodes=2 --ntasks-per-node=2 python train.py` in a job that asked for 4 nodes of 4 tasks: the task with
# global rank 3, on the second node. The job's variables (SLURM_NTASKS, SLURM_NTASKS_PER_NODE, ...) describe the
# allocation; the step's (SLURM_STEP_*) describe this srun.
SRUN_RANK_3_OF_4 = {
    "SLURM_JOB_ID": "4711234",
    "SLURM_JOB_NAME": "train",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "16",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_TASKS_PER_NODE": "4(x4)",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "gpu[05-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}
# `mpirun -np 4 --map-by ppr:2:node -x MASTER_ADDR=node0 python train.py`: global rank 3, the second process on
# the second node. OMPI_COMM_WORLD_NODE_RANK is a per-node process rank (across all jobs), not the node's index.
MPIRUN_RANK_3_OF_4 = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "MASTER_ADDR": "node0",
}
# The batch script of `sbatch --ntasks=4`, or `salloc -n4`'s shell: SLURM's job variables, but no srun step.
SBATCH_SCRIPT = {
    "SLURM_JOB_ID": "200505",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_NODEID": "0",
    "SLURM_TASKS_PER_NODE": "1(x4)",
    "SLURM_JOB_NODELIST": "gnode[10,20,25,37]",
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


def test_srun_topology_comes_from_the_step_with_rank_zero_on_its_first_host_and_lightnings_port() -> None:
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


@pytest.mark.parametrize("name", ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"])
def test_srun_tasks_per_node_fall_back_through_slurms_variables(name: str) -> None:
    # Without the step's layout, the job's is read; every other candidate says something else (4 per node).
    names = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"]
    env = {k: v for k, v in SRUN_RANK_3_OF_4.items() if k not in names[: names.index(name)]}
    env[name] = "2,2" if name != "SLURM_NTASKS_PER_NODE" else "2"
    topology = read_topology(env, [])
    assert (topology.local_world_size, topology.num_nodes) == (2, 2)


@pytest.mark.parametrize(
    ("nodes", "first"),
    [("gpu[07-09,12],cpu01", "gpu07"), ("rack[1-2]-node[01-04]", "rack1-node01"), ("a01 a02", "a01"), ("n7", "n7")],
)
def test_rank_zero_is_on_the_first_host_of_slurms_node_list(nodes: str, first: str) -> None:
    assert read_topology({**SRUN_RANK_3_OF_4, "SLURM_STEP_NODELIST": nodes}, []).master_addr == first


def test_srun_node_rank_is_derived_without_slurm_nodeid() -> None:
    env = {k: v for k, v in SRUN_RANK_3_OF_4.items() if k != "SLURM_NODEID"}
    assert read_topology(env, []).node_rank == 1


def test_python_in_a_batch_script_or_salloc_shell_is_a_single_process() -> None:
    # SLURM's job variables describe the allocation; only srun starts ranks. Reading SLURM_NTASKS=4 here would make
    # rank 0 wait for three peers that never come.
    assert read_topology(SBATCH_SCRIPT, []) == Topology()


def test_mpirun_topology_with_the_node_from_the_rank() -> None:
    assert read_topology(MPIRUN_RANK_3_OF_4, []) == Topology(
        rank=3,
        local_rank=1,
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
        "OMPI_COMM_WORLD_NODE_RANK": "1",  # this process's rank on the node, not the node's index
    }
    topology = read_topology(env, [])
    assert (topology.master_addr, topology.master_port, topology.node_rank) == ("127.0.0.1", 29500, 0)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({**SRUN_RANK_3_OF_4, **TORCHRUN_RANK_0_OF_2}, "torchrun"),
        ({**MPIRUN_RANK_3_OF_4, **TORCHRUN_RANK_0_OF_2}, "torchrun"),
        ({**SRUN_RANK_3_OF_4, **MPIRUN_RANK_3_OF_4}, "mpirun"),
        ({**SBATCH_SCRIPT, **SRUN_RANK_3_OF_4}, "srun"),
    ],
)
def test_the_launcher_closest_to_the_process_wins(env: dict[str, str], expected: str) -> None:
    # torchrun started by srun; mpirun inside a SLURM job (each rank also carries SLURM's variables).
    assert detect_launcher(env, []) == expected
    assert read_topology(env, []).launcher == expected


def test_torchrun_started_by_srun_on_every_node_reads_torchruns_ranks() -> None:
    topology = read_topology({**SRUN_RANK_3_OF_4, **TORCHRUN_RANK_0_OF_2}, [])
    assert (topology.rank, topology.world_size, topology.master_addr) == (0, 2, "10.0.0.5")


@pytest.mark.parametrize(
    ("base", "change", "field", "words"),
    [
        (SRUN_RANK_3_OF_4, {"SLURM_PROCID": "4"}, "SLURM_PROCID", "must be below SLURM_STEP_NUM_TASKS=4"),
        (SRUN_RANK_3_OF_4, {"SLURM_LOCALID": None}, "SLURM_LOCALID", "it is not set, although SLURM_PROCID, SLURM"),
        (SRUN_RANK_3_OF_4, {"SLURM_LOCALID": "2"}, "SLURM_LOCALID", "must be below SLURM_STEP_TASKS_PER_NODE=2"),
        (SRUN_RANK_3_OF_4, {"SLURM_STEP_NUM_TASKS": "four"}, "SLURM_STEP_NUM_TASKS", "not an integer"),
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
        (MPIRUN_RANK_3_OF_4, {"OMPI_COMM_WORLD_RANK": "-1"}, "OMPI_COMM_WORLD_RANK", "at least 0"),
        (MPIRUN_RANK_3_OF_4, {"OMPI_COMM_WORLD_LOCAL_RANK": None}, "OMPI_COMM_WORLD_LOCAL_RANK", "not set"),
        (MPIRUN_RANK_3_OF_4, {"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK", "below OMPI_COMM_W"),
        (
            MPIRUN_RANK_3_OF_4,
            {"OMPI_COMM_WORLD_LOCAL_SIZE": "3"},
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "whole number of nodes",
        ),
        (MPIRUN_RANK_3_OF_4, {"MASTER_ADDR": None}, "MASTER_ADDR", "not set"),
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


def test_srun_without_any_tasks_per_node_variable_names_them() -> None:
    env = {k: v for k, v in SRUN_RANK_3_OF_4.items() if "TASKS_PER_NODE" not in k}
    with pytest.raises(LauncherEnvironmentError) as raised:
        read_topology(env, [])
    assert str(raised.value).startswith(
        "SLURM_STEP_TASKS_PER_NODE=None: neither it nor SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE is set. Fix: "
    )


def test_mpirun_across_nodes_says_how_to_pass_the_address() -> None:
    env = {k: v for k, v in MPIRUN_RANK_3_OF_4.items() if k != "MASTER_ADDR"}
    with pytest.raises(LauncherEnvironmentError, match=r"mpirun -x MASTER_ADDR=<host of rank 0>"):
        read_topology(env, [])


def test_malformed_slurm_procid_is_explained_before_lightning_parses_it() -> None:
    # Lightning's import parses SLURM_PROCID with a bare int(), as it does RANK.
    with pytest.raises(LauncherEnvironmentError, match=r"SLURM_PROCID='x': it is not an integer"):
        check_rank_variables({"SLURM_PROCID": "x"})


def test_lightning_cluster_environment_detects_srun_and_mpirun(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_ddp_amp import LauncherEnvironment

    assert not LauncherEnvironment.detect()
    for name, value in MPIRUN_RANK_3_OF_4.items():
        monkeypatch.setenv(name, value)
    assert LauncherEnvironment.detect()
