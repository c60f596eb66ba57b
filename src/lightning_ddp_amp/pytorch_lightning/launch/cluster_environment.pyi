# Generated from ../../launch/cluster_environment.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""Lightning ClusterEnvironments and envddp's Topology, both ways.

:class:`LauncherEnvironment` reports the topology envddp read from the launcher's variables;
:func:`environment_topology` reads the topology of any other environment a user hands to the Trainer
(``plugins=[KubeflowEnvironment()]``) or to the strategy (``EnvDDPStrategy(cluster_environment=...)``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from lightning_fabric.plugins.environments import (
    ClusterEnvironment,
    KubeflowEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from typing_extensions import override

from lightning_ddp_amp.errors import LauncherEnvironmentError, StrategyConfigurationError, whole_number
from lightning_ddp_amp.launch.environment import Topology, detect_launcher

#: What Lightning's Trainer picks by itself when it is given no ClusterEnvironment. Each stands for a launcher envddp
#: handles itself, so envddp's own validated reading of the variables (``read_topology``) takes its place.
LIGHTNING_DEFAULTS = (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment, LightningEnvironment)


class LauncherEnvironment(ClusterEnvironment):
    """A Lightning ClusterEnvironment that reports a validated :class:`Topology` and never changes it.

    Args:
        topology: What :func:`read_topology` found.
    """

    def __init__(self, topology: Topology) -> None:
        ...

    @property
    @override
    def creates_processes_externally(self) -> bool:
        ...

    @property
    @override
    def main_address(self) -> str:
        ...

    @property
    @override
    def main_port(self) -> int:
        ...

    @staticmethod
    @override
    def detect() -> bool:
        ...

    @override
    def world_size(self) -> int:
        ...

    @override
    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher decides the world size."""

    @override
    def global_rank(self) -> int:
        ...

    @override
    def set_global_rank(self, rank: int) -> None:
        """Ignored: the launcher decides the rank."""

    @override
    def local_rank(self) -> int:
        ...

    @override
    def node_rank(self) -> int:
        ...

    def local_world_size(self) -> int:
        """Processes per node; :func:`environment_topology` asks any environment that has this method."""
        ...


def is_lightning_default(environment: ClusterEnvironment) -> bool:
    """Whether ``environment`` is exactly one of Lightning's own, which its Trainer picks when given none.

    Subclasses are the user's own and are honoured through their methods.
    """
    ...


def environment_topology(environment: ClusterEnvironment) -> Topology:
    """The topology ``environment`` reports: its ranks, world size and rendezvous address, checked.

    The processes per node come from the environment's ``local_world_size()`` when it has one; else 1 for
    Lightning's :class:`KubeflowEnvironment` (a PyTorchJob runs one process per pod); else LOCAL_WORLD_SIZE; else
    1 for a world of one.

    Raises:
        StrategyConfigurationError: The environment cannot tell the processes per node, or expects Lightning to
            start the processes.
        LauncherEnvironmentError: A value it reports cannot be read, or is out of range.
    """
    ...


def _local_world_size(environment: ClusterEnvironment, name: str, world_size: int) -> int:
    ...


def _ask(name: str, what: str, read: Callable[[], object]) -> object:
    ...


def _ask_int(
    name: str, what: str, read: Callable[[], object], *, minimum: int, below: tuple[int, str] | None = None
) -> int:
    ...
