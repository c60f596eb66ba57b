"""Lightning ClusterEnvironments and envddp's Topology, both ways.

:class:`LauncherEnvironment` reports the topology envddp read from the launcher's variables;
:func:`environment_topology` reads the topology of any other environment a user hands to the Trainer
(``plugins=[KubeflowEnvironment()]``) or to the strategy (``EnvDDPStrategy(cluster_environment=...)``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from lightning.fabric.plugins.environments import (
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
from lightning_ddp_amp.launch.environment import detect_launcher
from lightning_ddp_amp.launch.topology import Topology

#: What Lightning's Trainer picks by itself when it is given no ClusterEnvironment. Each stands for a launcher envddp
#: handles itself, so envddp's own validated reading of the variables (``read_topology``) takes its place.
LIGHTNING_DEFAULTS = (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment, LightningEnvironment)


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

    def local_world_size(self) -> int:
        """Processes per node; :func:`environment_topology` asks any environment that has this method."""
        return self.topology.local_world_size


def is_lightning_default(environment: ClusterEnvironment) -> bool:
    """Whether ``environment`` is exactly one of Lightning's own, which its Trainer picks when given none.

    Subclasses are the user's own and are honoured through their methods.
    """
    return type(environment) in LIGHTNING_DEFAULTS


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
    if isinstance(environment, LauncherEnvironment):
        return environment.topology
    name = type(environment).__name__
    world_size = _ask_int(name, "world_size()", environment.world_size, minimum=1)
    rank = _ask_int(name, "global_rank()", environment.global_rank, minimum=0, below=(world_size, "world_size()"))
    local_world_size = _local_world_size(environment, name, world_size)
    if world_size % local_world_size:
        raise LauncherEnvironmentError(
            f"{name}.world_size()",
            world_size,
            f"it is not a whole number of nodes of {local_world_size} processes",
            "start the same number of processes on every node",
        )
    local_rank = _ask_int(
        name, "local_rank()", environment.local_rank, minimum=0, below=(local_world_size, "processes per node")
    )
    num_nodes = world_size // local_world_size
    node_rank = _ask_int(name, "node_rank()", environment.node_rank, minimum=0, below=(num_nodes, "nodes"))
    if rank != node_rank * local_world_size + local_rank:
        raise LauncherEnvironmentError(
            f"{name}.global_rank()",
            rank,
            f"DDP lays ranks out node by node, so node {node_rank}'s local rank {local_rank} of {local_world_size}"
            f" is rank {node_rank * local_world_size + local_rank}",
            f"make {name} number the ranks node by node (global rank = node rank * processes per node + local rank)",
        )
    if world_size == 1:
        return Topology(launcher=name)
    if not environment.creates_processes_externally:
        raise StrategyConfigurationError(
            "cluster_environment",
            name,
            f"it expects the strategy to start the {world_size} processes, but envddp only joins processes that a"
            " launcher started",
            f"start every process with the launcher {name} belongs to (its creates_processes_externally is then"
            " True), or drop the plugin and let envddp start the ranks (`Trainer(devices=N)`)",
        )
    address = _ask(name, "main_address", lambda: environment.main_address)
    if not isinstance(address, str) or not address.strip():
        raise LauncherEnvironmentError(
            f"{name}.main_address", address, "it is not a host name", "set it to the host of rank 0 (MASTER_ADDR)"
        )
    port = _ask_int(name, "main_port", lambda: environment.main_port, minimum=1, below=(65536, "the highest port + 1"))
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=address.strip(),
        master_port=port,
        launcher=name,
    )


def _local_world_size(environment: ClusterEnvironment, name: str, world_size: int) -> int:
    tells = getattr(environment, "local_world_size", None)
    if callable(tells):
        return _ask_int(name, "local_world_size()", tells, minimum=1)
    if isinstance(environment, KubeflowEnvironment):
        return 1
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is not None:
        if not raw.strip().isdigit() or int(raw) < 1:
            raise LauncherEnvironmentError(
                "LOCAL_WORLD_SIZE", raw, "it is not a number of processes", "export the processes per node, e.g. 4"
            )
        return int(raw)
    if world_size == 1:
        return 1
    raise StrategyConfigurationError(
        "cluster_environment",
        name,
        f"it reports {world_size} processes but not how many run on each node, and LOCAL_WORLD_SIZE is not set",
        f"give {name} a local_world_size() method returning the processes per node, or export LOCAL_WORLD_SIZE",
    )


def _ask(name: str, what: str, read: Callable[[], object]) -> object:
    try:
        return read()
    except (KeyError, ValueError, TypeError) as error:
        missing = f" ({error.args[0]} is not set)" if isinstance(error, KeyError) and error.args else ""
        raise LauncherEnvironmentError(
            f"{name}.{what}",
            None,
            f"reading it failed with {type(error).__name__}: {error}",
            f"export the variables {name} reads in every process{missing}",
        ) from error


def _ask_int(
    name: str, what: str, read: Callable[[], object], *, minimum: int, below: tuple[int, str] | None = None
) -> int:
    field = f"{name}.{what}"
    fix = f"check what {name} reads in this process"
    value = whole_number(LauncherEnvironmentError, field, _ask(name, what, read), "it is not an integer", fix)
    if value < minimum:
        raise LauncherEnvironmentError(field, value, f"it must be at least {minimum}", fix)
    if below is not None and value >= below[0]:
        raise LauncherEnvironmentError(field, value, f"it must be below {below[0]} ({below[1]})", fix)
    return value
