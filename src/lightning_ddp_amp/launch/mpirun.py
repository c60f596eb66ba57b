"""Reading the topology Open MPI's ``mpirun`` leaves: OMPI_COMM_WORLD_RANK, _LOCAL_RANK, _SIZE and _LOCAL_SIZE.

mpirun exports no rendezvous address: one node meets on the loopback, several need MASTER_ADDR passed to every rank
(``mpirun -x MASTER_ADDR``).
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_ddp_amp.launch.slurm import SRUN_VARIABLES
from lightning_ddp_amp.launch.topology import Topology
from lightning_ddp_amp.launch.variables import check_whole_nodes, read_master, required_int

#: Open MPI's variables, read when none of torchrun's are set.
MPIRUN_VARIABLES = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)
#: torch's rendezvous port when MASTER_PORT is not set.
DEFAULT_MASTER_PORT = 29500

_MPIRUN_HINT = "launch with `mpirun -np N -x MASTER_ADDR -x MASTER_PORT python train.py`"
# Named when one of mpirun's variables is missing: those that are set, srun's among them (mpirun in a SLURM job).
_MPIRUN_FAMILY = (*SRUN_VARIABLES, "SLURM_LOCALID", *MPIRUN_VARIABLES)


def read_mpirun(env: Mapping[str, str]) -> Topology:
    """The topology of a process Open MPI's ``mpirun`` started.

    Raises:
        LauncherEnvironmentError: A variable is missing, not an integer, or out of range, or several nodes have no
            MASTER_ADDR.
    """
    world_size = _required(env, "OMPI_COMM_WORLD_SIZE", minimum=1)
    rank = _required(env, "OMPI_COMM_WORLD_RANK", minimum=0, below=(world_size, "OMPI_COMM_WORLD_SIZE"))
    local_world_size = _required(env, "OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1)
    check_whole_nodes(
        world_size,
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        local_world_size,
        "run the same number of processes on every node (`mpirun --map-by ppr:N:node`)",
    )
    local_rank = _required(
        env, "OMPI_COMM_WORLD_LOCAL_RANK", minimum=0, below=(local_world_size, "OMPI_COMM_WORLD_LOCAL_SIZE")
    )
    num_nodes = world_size // local_world_size
    # Not OMPI_COMM_WORLD_NODE_RANK: Open MPI defines it as the process's rank on its node across all jobs, not
    # the node's index. Ranks are laid out by node (`--map-by ppr:N:node`), so the node is rank // per-node count.
    master_addr, master_port = read_master(
        env,
        required=world_size > 1,
        default_addr="127.0.0.1" if num_nodes == 1 else None,
        default_port=DEFAULT_MASTER_PORT,
        hint="pass it to every rank: `mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> ...`",
    )
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=rank // local_world_size,
        master_addr=master_addr,
        master_port=master_port,
        launcher="mpirun",
    )


def _required(env: Mapping[str, str], name: str, *, minimum: int, below: tuple[int, str] | None = None) -> int:
    return required_int(env, name, _MPIRUN_HINT, minimum=minimum, below=below, family=_MPIRUN_FAMILY)
