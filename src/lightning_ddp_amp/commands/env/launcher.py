"""The env report's launcher section: who started this process, the topology it reads, and the rendezvous mistakes.

The variables a launcher leaves are shown as they are, so that reports from every rank can be compared; the
decision says what envddp does with them, and the problems are the launch mistakes found before any network call:
a launcher envddp does not read, rank 0's address on loopback across nodes, rank 0's port already taken.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from typing import Any

import torch

from lightning_ddp_amp.errors import LightningDDPAmpError
from lightning_ddp_amp.launch.environment import (
    LAUNCHER_VARIABLES,
    detect_launcher,
    other_launcher,
    read_topology,
    started_by,
)
from lightning_ddp_amp.launch.mpirun import MPIRUN_VARIABLES
from lightning_ddp_amp.launch.slurm import SLURM_NODELISTS, SLURM_TASKS_PER_NODE, SRUN_VARIABLES
from lightning_ddp_amp.launch.topology import Topology

# The environment a launcher leaves, shown as is so that a report can be compared across ranks: every variable
# read_topology reads, and the other launchers' families, so that the report can say why they were ignored.
_SHOWN = (
    *LAUNCHER_VARIABLES,
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "CUDA_VISIBLE_DEVICES",
    *SRUN_VARIABLES,
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
    *SLURM_TASKS_PER_NODE,
    *SLURM_NODELISTS,
)
_SHOWN_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_", "MV2_COMM_WORLD_", "JSM_NAMESPACE_")


def launcher_section(
    env: Mapping[str, str], argv: list[str], problems: list[dict[str, str]]
) -> tuple[dict[str, Any], Topology | None]:
    """The launcher section, and the topology it read (None when the launcher's variables are wrong).

    Args:
        env: The environment to read.
        argv: The training command line to search for ``--local-rank``.
        problems: Where each problem found is added, with its fix.
    """
    variables = {
        name: value for name, value in sorted(env.items()) if name in _SHOWN or name.startswith(_SHOWN_PREFIXES)
    }
    section: dict[str, Any] = {"variables": variables}
    try:
        section["name"] = detect_launcher(env, argv)
        topology = read_topology(env, argv)
    except LightningDDPAmpError as error:
        problems.append(problem_of(error))
        section["error"] = str(error)
        return section, None
    section["decision"] = decision(topology, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    ignored = _ignored_launchers(env, topology.launcher)
    if ignored:
        section["ignored"] = ignored
    foreign = other_launcher(env)
    if topology.launcher == "none" and foreign is not None:
        problems.append(
            {
                "problem": f"a launcher envddp does not read started this process ({foreign}: MPICH, Intel MPI,"
                " MVAPICH or jsrun), so every process would train alone",
                "fix": "launch with torchrun, srun or Open MPI's mpirun, or export RANK, LOCAL_RANK, WORLD_SIZE,"
                " LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process",
            }
        )
    problems.extend(_rendezvous_problems(env, topology))
    section["topology"] = {
        "rank": topology.rank,
        "local_rank": topology.local_rank,
        "world_size": topology.world_size,
        "local_world_size": topology.local_world_size,
        "node_rank": topology.node_rank,
        "num_nodes": topology.num_nodes,
        "master_addr": topology.master_addr,
        "master_port": topology.master_port,
    }
    return section, topology


def problem_of(error: LightningDDPAmpError) -> dict[str, str]:
    """A refusal of the package as one of the report's problems: what is wrong, and its fix."""
    return {"problem": f"{error.field}={error.value!r}: {error.problem}", "fix": error.fix}


def decision(topology: Topology, gpus: int) -> str:
    """Who started the ranks, or that envddp would start them, or a single process: what envddp does here."""
    ranks = f"{topology.world_size} rank(s) on {topology.num_nodes} node(s)"
    if topology.launcher == "none" and gpus > 1:
        return (
            f'self-launch: no launcher variables and {gpus} GPUs, so Trainer(strategy="envddp") starts {gpus} ranks'
            " itself through torchrun (devices=1 trains alone)"
        )
    if topology.launcher == "none":
        return (
            "single process: no launcher variables, so one process trains on the default device;"
            ' Trainer(strategy="envddp", devices=N) with N > 1 would start N ranks itself through torchrun'
        )
    return f"{ranks}, {started_by(topology.launcher)}"


def _rendezvous_problems(env: Mapping[str, str], topology: Topology) -> list[dict[str, str]]:
    """The classic multi-node mistakes: rank 0's address on loopback, or its port already taken on its node."""
    found = []
    address, port = topology.master_addr, topology.master_port
    if topology.num_nodes > 1 and address is not None and _is_loopback(address):
        found.append(
            {
                "problem": f"MASTER_ADDR={address!r} with {topology.num_nodes} nodes: a loopback address is every"
                " node's own, so the other nodes' ranks would look for rank 0 on themselves and the job can only hang",
                "fix": "set MASTER_ADDR to the hostname or IP address of rank 0's node, the same on every node"
                " (torchrun --master-addr=node0)",
            }
        )
    # Under torchrun the agent already holds the port for its store: only a rank 0 that opens it itself is checked.
    opens_the_store = topology.node_rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if port is not None and topology.world_size > 1 and opens_the_store and _port_taken(port):
        found.append(
            {
                "problem": f"MASTER_PORT={port}: another process on this node (rank 0's) already listens on it, so"
                " rank 0 cannot open the job's store there",
                "fix": f"pick a free port (MASTER_PORT, or torchrun --master-port), or stop the process holding {port}"
                f" (`ss -ltnp 'sport = :{port}'`)",
            }
        )
    return found


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address.lower() in ("localhost", "localhost.localdomain", "ip6-localhost")


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def _ignored_launchers(env: Mapping[str, str], used: str) -> list[str]:
    """Other launchers' variables in this environment, and why they were not read."""
    found = []
    if used in ("torchrun", "environment", "torch.distributed.launch") and any(n in env for n in MPIRUN_VARIABLES):
        found.append("mpirun (OMPI_COMM_WORLD_*): torchrun's variables win")
    if used != "srun" and all(name in env for name in SRUN_VARIABLES):
        found.append(f"srun (SLURM_PROCID, SLURM_STEP_NUM_TASKS): {used}'s variables win")
    elif used != "srun" and "SLURM_NTASKS" in env:
        found.append(
            "SLURM's job variables (SLURM_NTASKS without srun's SLURM_STEP_NUM_TASKS): the batch script or salloc's"
            " shell, not a task srun started; start one task per rank with `srun`"
        )
    return found
