"""LauncherEnvironment: the launcher's topology as a Lightning ClusterEnvironment."""

from __future__ import annotations

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from typing_extensions import override

from lightning_ddp_amp.environment import Topology, detect_launcher


class LauncherEnvironment(ClusterEnvironment):
    """A Lightning ClusterEnvironment that reports a validated :class:`Topology` and never changes it.

    Args:
        topology: What :func:`read_topology` found.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return self.topology.launcher != "none"

    @property
    @override
    def main_address(self) -> str:
        return self.topology.master_addr or "127.0.0.1"

    @property
    @override
    def main_port(self) -> int:
        return self.topology.master_port or 0

    @staticmethod
    @override
    def detect() -> bool:
        return detect_launcher() != "none"

    @override
    def world_size(self) -> int:
        return self.topology.world_size

    @override
    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher decides the world size."""

    @override
    def global_rank(self) -> int:
        return self.topology.rank

    @override
    def set_global_rank(self, rank: int) -> None:
        """Ignored: the launcher decides the rank."""

    @override
    def local_rank(self) -> int:
        return self.topology.local_rank

    @override
    def node_rank(self) -> int:
        return self.topology.node_rank
