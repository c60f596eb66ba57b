"""Reading the topology ``srun`` leaves: its task variables, SLURM's compressed tasks-per-node and node lists.

``srun`` exports SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS, the tasks per node, SLURM_NODEID and the node
list. Rank 0's address defaults to the first node of the list and its port to Lightning's and torch's SLURM
default, 15000 + the job id's last four digits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from lightning_ddp_amp.errors import LauncherEnvironmentError
from lightning_ddp_amp.launch.topology import Topology
from lightning_ddp_amp.launch.variables import check_whole_nodes, read_int, read_master, required_int

#: srun's own variables: present in the tasks srun starts, absent from the batch script and from `salloc`'s shell.
SRUN_VARIABLES = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
# The step's real layout first; SLURM_NTASKS_PER_NODE is what the job asked for, inherited from sbatch.
SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
#: What Lightning and torch use when MASTER_PORT is not set: SLURM 15000 + the job id's last four digits.
SLURM_BASE_PORT = 15000

_SRUN_HINT = "launch with `srun --ntasks-per-node=N python train.py`, which sets every SLURM variable for you"
# Named when one of srun's variables is missing: those of its variables that are set.
_SRUN_FAMILY = (*SRUN_VARIABLES, "SLURM_LOCALID")
_FIRST_OF_RANGE = re.compile(r"\[([^\]\-,]+)[^\]]*\]")
_SLURM_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def read_srun(env: Mapping[str, str]) -> Topology:
    """The topology of a task ``srun`` started.

    Raises:
        LauncherEnvironmentError: A variable is missing, not an integer, or out of range, or the nodes run different
            numbers of tasks.
    """
    world_size = _required(env, "SLURM_STEP_NUM_TASKS", minimum=1)
    rank = _required(env, "SLURM_PROCID", minimum=0, below=(world_size, "SLURM_STEP_NUM_TASKS"))
    local_world_size, per_node_name = _tasks_per_node(env)
    check_whole_nodes(
        world_size,
        ("SLURM_STEP_NUM_TASKS", per_node_name),
        local_world_size,
        "run the same number of tasks on every node (`srun --ntasks-per-node=N`)",
    )
    local_rank = _required(env, "SLURM_LOCALID", minimum=0, below=(local_world_size, per_node_name))
    num_nodes = world_size // local_world_size
    node_rank = read_int(env, "SLURM_NODEID", minimum=0, below=(num_nodes, "the number of nodes"), hint=_SRUN_HINT)
    nodes = next((name for name in SLURM_NODELISTS if env.get(name, "").strip()), None)
    job_id = env.get("SLURM_JOB_ID", "").strip()
    master_addr, master_port = read_master(
        env,
        required=world_size > 1,
        default_addr=first_host(env[nodes]) if nodes else None,
        default_port=SLURM_BASE_PORT + int(job_id[-4:]) if job_id[-4:].isdigit() else None,
        hint=_SRUN_HINT,
    )
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=rank // local_world_size if node_rank is None else node_rank,
        master_addr=master_addr,
        master_port=master_port,
        launcher="srun",
    )


def first_host(nodes: str) -> str:
    """The host of rank 0: the first of SLURM's compressed node list.

    ``"gpu[07-09,12],cpu01"`` -> ``"gpu07"``; ``"rack[1-2]-node[01-04]"`` -> ``"rack1-node01"`` (zero padding kept).
    """
    depth, end = 0, len(nodes)
    for index, char in enumerate(nodes):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth == 0 and char in ", ":
            end = index
            break
    return _FIRST_OF_RANGE.sub(r"\1", nodes[:end].strip())


def _required(env: Mapping[str, str], name: str, *, minimum: int, below: tuple[int, str] | None = None) -> int:
    return required_int(env, name, _SRUN_HINT, minimum=minimum, below=below, family=_SRUN_FAMILY)


def _tasks_per_node(env: Mapping[str, str]) -> tuple[int, str]:
    """Tasks per node from the first of SLURM's variables that is set; every node must run as many."""
    for name in SLURM_TASKS_PER_NODE:
        raw = env.get(name)
        if raw is None:
            continue
        counts = _expand_counts(name, raw)
        if len(set(counts)) > 1:
            raise LauncherEnvironmentError(
                name,
                raw,
                "the nodes run different numbers of tasks, but DDP ranks are laid out as whole nodes",
                "run the same number of tasks on every node (`srun --ntasks-per-node=N`)",
            )
        return counts[0], name
    raise LauncherEnvironmentError(
        "SLURM_STEP_TASKS_PER_NODE",
        None,
        "neither it nor SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE is set",
        _SRUN_HINT,
    )


def _expand_counts(name: str, raw: str) -> list[int]:
    # SLURM writes per-node counts compressed: "2(x3),1" means 2, 2, 2, 1.
    counts: list[int] = []
    for part in raw.split(","):
        match = _SLURM_COUNT.fullmatch(part.strip())
        if match is None or int(match[1]) < 1:
            raise LauncherEnvironmentError(
                name, raw, "it is not SLURM's list of tasks per node (e.g. '4' or '4(x2)')", _SRUN_HINT
            )
        counts += [int(match[1])] * int(match[2] or 1)
    return counts
