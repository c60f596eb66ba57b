"""Where this process sits in the job: :class:`Topology`, as every launcher's reader returns it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job.

    Args:
        rank: Global rank, 0 ≤ rank < world_size.
        local_rank: Rank on this node, 0 ≤ local_rank < local_world_size.
        world_size: Number of processes in the job.
        local_world_size: Number of processes on each node.
        node_rank: Index of this node, 0 ≤ node_rank < num_nodes.
        master_addr: Address of rank 0's rendezvous store (None for a single process).
        master_port: Port of rank 0's rendezvous store (None for a single process).
        launcher: What started the process: ``"torchrun"``, ``"self-launch"`` (torchrun, started by the strategy
            from a plain ``python train.py``), ``"torch.distributed.launch"``, ``"srun"``, ``"mpirun"``,
            ``"environment"`` (torchrun's variables set by hand or another tool), ``"none"``, or the class name of
            the Lightning ``ClusterEnvironment`` the topology was read from (``"KubeflowEnvironment"``).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "none"

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def is_distributed(self) -> bool:
        """Whether there are peers to talk to; a world of one needs no process group."""
        return self.world_size > 1
