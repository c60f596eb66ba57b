"""What the Trainer says about the run, reconciled with what the launcher started.

The Trainer hands a strategy its cluster environment (``plugins=[...]`` or its own pick), its devices
(``parallel_devices``), and, through the hook around its construction, the raw ``devices``, ``num_nodes`` and
``use_distributed_sampler`` (:meth:`EnvDDPStrategy.check_trainer_flags
<lightning_ddp_amp.EnvDDPStrategy.check_trainer_flags>`). The launcher has already decided the ranks, the nodes and
the processes per node. :class:`TopologyReconciler` keeps what each side said, picks the device of every local
rank, refuses a Trainer argument that contradicts the launcher, and counts the ranks no launcher started
(:meth:`TopologyReconciler.missing_ranks`, which :mod:`lightning_ddp_amp.ddp.launcher` starts). ``EnvDDPStrategy``
keeps Lightning's interface (its ``cluster_environment``, ``parallel_devices`` and ``num_nodes`` properties) and
hands each to this module.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.accelerators.accelerator import Accelerator
from lightning.fabric.accelerators.cuda import CUDAAccelerator as FabricCUDAAccelerator
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.errors import StrategyConfigurationError, TopologyMismatchError
from lightning_ddp_amp.launch.cluster_environment import LauncherEnvironment, environment_topology, is_lightning_default
from lightning_ddp_amp.launch.devices import select_devices
from lightning_ddp_amp.launch.environment import read_topology, started_by
from lightning_ddp_amp.launch.process_group import group_line, join_or_start, started_by_script
from lightning_ddp_amp.launch.topology import Topology
from lightning_ddp_amp.rank_zero import log_once


class TopologyReconciler:
    """The cluster environment, the devices and the Trainer's flags of one strategy, reconciled with the launcher.

    Attributes:
        requested: The devices an explicit ``Trainer(devices=...)`` or ``parallel_devices`` names, one per local
            rank; None when left to envddp (``"auto"``). Known once :meth:`check` has run.
        shard_dataloaders: ``Trainer(use_distributed_sampler=...)``: whether envddp shards the DataLoaders; None
            until the Trainer says.
        front: ``"Trainer"`` or ``"Fabric"``: whose arguments the messages name.
    """

    def __init__(self, front: str = "Trainer") -> None:
        self.front = front
        self.requested: list[torch.device] | None = None
        self.shard_dataloaders: bool | None = None
        self._environment: ClusterEnvironment | None = None
        self._topology: Topology | None = None
        self._given_devices: list[torch.device] | None = None
        self._devices: list[torch.device] | None = None
        self._cuda_indices: list[int] | None = None

    @property
    def environment(self) -> ClusterEnvironment | None:
        """The ClusterEnvironment the ranks come from; None until one is given or the launcher is read."""
        return self._environment

    @property
    def topology(self) -> Topology:
        """What the launcher, or the cluster environment given, set up (validated); read from the launcher's
        variables when no environment was given.

        Raises:
            LauncherEnvironmentError: A launcher variable is wrong.
        """
        self.use_launcher_unless_given()
        assert self._topology is not None
        return self._topology

    def use_launcher_unless_given(self) -> None:
        """Read the launcher's variables, unless an environment was given: used outside a Trainer, nothing hands
        one over.

        Raises:
            LauncherEnvironmentError: A launcher variable is wrong.
        """
        if self._environment is None:
            self.set_environment(LauncherEnvironment(read_topology()))

    def set_environment(self, environment: ClusterEnvironment | None) -> None:
        """Read the topology from ``environment``; the Trainer passes a user's plugin or its own choice.

        Lightning's own environments, which the Trainer picks when given none (``is_lightning_default``), read the
        variables of launchers envddp reads itself: the launcher's variables are read and validated instead
        (:func:`read_topology`). Any other environment is honoured through its methods (:func:`environment_topology`).
        None (what ``DDPStrategy.__init__`` passes by default) leaves the choice open.

        Raises:
            LauncherEnvironmentError: A launcher variable, or a value the environment reports, is wrong.
            StrategyConfigurationError: The environment cannot be honoured (see :func:`environment_topology`).
        """
        if environment is None:
            return
        if is_lightning_default(environment):
            environment = LauncherEnvironment(read_topology())
        self._topology = environment_topology(environment)
        self._environment = environment
        self._devices = None

    def devices(self, accelerator: Accelerator | None) -> list[torch.device] | None:
        """One device per local rank, chosen from the topology once the accelerator is known (the devices given,
        until then)."""
        if self._devices is None and accelerator is not None:
            on_cuda = on_cuda_accelerator(accelerator)
            self._devices = select_devices(
                "cuda" if on_cuda else "cpu",
                self.topology,
                torch.cuda.device_count() if on_cuda else 0,
                self._cuda_indices,
            )
        return self._devices if self._devices is not None else self._given_devices

    def set_devices(self, parallel_devices: list[torch.device] | None) -> None:
        """One device per local rank, as ``Trainer(devices=[...])``; checked against the launcher's processes per
        node by :meth:`check`. None (Lightning's default) keeps the choice to envddp."""
        if parallel_devices is None:
            return
        given = [torch.device(device) for device in parallel_devices]
        # An index-less "cuda" stands for the local rank's GPU, as it does in the recipe.
        self._given_devices = [
            torch.device("cuda", rank) if device.type == "cuda" and device.index is None else device
            for rank, device in enumerate(given)
        ]
        self._cuda_indices = [device.index for device in self._given_devices if device.type == "cuda"] or None
        self._devices = None

    def check(
        self,
        accelerator: Accelerator | None,
        devices: list[int] | str | int,
        num_nodes: int,
        use_distributed_sampler: bool,
        exact_eval: bool,
    ) -> None:
        """Check the Trainer's ``devices``, ``num_nodes`` and ``use_distributed_sampler`` against the launcher.

        ``devices="auto"`` and ``num_nodes=1`` (the Trainer's defaults) mean "whatever the launcher started".
        On CUDA an explicit list of GPU indices maps local ranks to GPUs, as in Lightning's ``ddp``; so does
        ``EnvDDPStrategy(parallel_devices=...)``.

        Raises:
            TopologyMismatchError: an explicit value (or ``parallel_devices``) contradicts the launcher, or
                ``devices`` contradicts ``parallel_devices``.
            StrategyConfigurationError: ``exact_eval`` with ``use_distributed_sampler=False``.
        """
        self.shard_dataloaders = use_distributed_sampler
        if exact_eval and not use_distributed_sampler:
            raise StrategyConfigurationError(
                "exact_eval",
                True,
                "Trainer(use_distributed_sampler=False) leaves sharding to you, so the strategy cannot make the"
                " evaluation shards exact",
                "drop use_distributed_sampler=False, or drop exact_eval and shard the eval sets yourself",
            )
        topology = self.topology
        if num_nodes != 1 and num_nodes != topology.num_nodes:
            raise TopologyMismatchError(
                "num_nodes",
                num_nodes,
                f"the launcher started {topology.num_nodes} node(s) (WORLD_SIZE={topology.world_size},"
                f" LOCAL_WORLD_SIZE={topology.local_world_size})",
                f"drop num_nodes from the {self.front} (envddp reads it from the launcher) or set num_nodes="
                f"{topology.num_nodes}",
            )
        requested = _requested_devices(accelerator, devices)
        field: str = "devices"
        value: Any = devices
        if self._given_devices is not None:
            if requested is not None and requested != self._given_devices:
                raise TopologyMismatchError(
                    "devices",
                    devices,
                    f"EnvDDPStrategy(parallel_devices={self._given_devices}) names other devices",
                    f"name the devices once: drop devices from the {self.front}, or parallel_devices from the strategy",
                )
            requested, field, value = self._given_devices, "parallel_devices", self._given_devices
        self.requested = requested
        if topology.launcher != "none" and requested is not None and len(requested) != topology.local_world_size:
            raise TopologyMismatchError(
                field,
                value,
                f"the launcher started {topology.local_world_size} process(es) on this node"
                f" (LOCAL_WORLD_SIZE={topology.local_world_size})",
                f"drop devices from the {self.front} (envddp reads it from the launcher) or set devices="
                f"{topology.local_world_size}"
                if field == "devices"
                else "drop parallel_devices from the strategy (envddp picks one device per local rank) or list"
                f" {topology.local_world_size}, one per local rank",
            )
        if requested is not None and on_cuda_accelerator(accelerator):
            self._cuda_indices = [device.index for device in requested]
            self._devices = None

    def route_sampler_injection(self, trainer: Any) -> None:
        """Keep Lightning's own sampler injection for predictions only: envddp shards the other DataLoaders itself
        (``EnvDDPStrategy.process_dataloader``), as ``use_distributed_sampler`` says."""
        if self.shard_dataloaders is None:
            self.shard_dataloaders = _lightning.sampler_injection(trainer)
        predicting = trainer.state.fn == TrainerFn.PREDICTING
        _lightning.set_sampler_injection(trainer, self.shard_dataloaders and predicting)

    def missing_ranks(self, accelerator: Accelerator | None) -> int:
        """How many ranks this process starts itself (:mod:`lightning_ddp_amp.ddp.launcher`): one per device the
        Trainer asks for when no launcher started this process, and more than one; else 0.

        ``devices="auto"`` means every visible GPU on CUDA, one process on the CPU (as in Lightning).
        """
        if self.topology.launcher != "none":
            return 0
        on_cuda = on_cuda_accelerator(accelerator)
        requested = self.requested
        count = len(requested) if requested is not None else torch.cuda.device_count() if on_cuda else 1
        return count if count > 1 else 0


def join_process_group(
    topology: Topology, backend: str, backend_given: bool, timeout: timedelta, device: torch.device
) -> bool:
    """Join or start the process group this rank trains in (:func:`~lightning_ddp_amp.launch.process_group.join_or_start`)
    and say how on rank 0, for the Trainer's and Fabric's envddp alike.

    Returns:
        Whether there is a group; False when this process trains alone (said once, unless no launcher started it:
        then the strategy's launcher said it).
    """
    how = join_or_start(topology, backend, backend_given, timeout, device)
    if how is None:
        if not started_by_script() and topology.launcher != "none":
            log_once(f"envddp: 1 rank, {started_by(topology.launcher)}, so no process group")
        return False
    rank_zero_info(group_line(topology, backend, how))
    return True


def on_cuda_accelerator(accelerator: object) -> bool:
    """Whether ``accelerator`` is the Trainer's or Fabric's CUDA accelerator (two classes of one name)."""
    return isinstance(accelerator, (CUDAAccelerator, FabricCUDAAccelerator))


def _requested_devices(accelerator: Accelerator | None, devices: list[int] | str | int) -> list[torch.device] | None:
    """The devices an explicit ``Trainer(devices=...)`` names; None for ``"auto"``."""
    if devices == "auto":
        return None
    assert accelerator is not None
    kind = type(accelerator)
    parallel_devices: list[torch.device] = kind.get_parallel_devices(kind.parse_devices(devices))
    return parallel_devices


def check_layer_sync(layer_sync: object | None, accelerator: Accelerator | None, ranks: int) -> None:
    """Refuse ``Trainer(sync_batchnorm=True)`` where torch's SyncBatchNorm cannot run: on CPU ranks.

    Raises:
        StrategyConfigurationError: ``sync_batchnorm=True`` with several ranks on the CPU.
    """
    if layer_sync is not None and ranks > 1 and isinstance(accelerator, CPUAccelerator):
        raise StrategyConfigurationError(
            "sync_batchnorm",
            True,
            f"torch's SyncBatchNorm synchronizes only GPU tensors (CUDA, XPU, HPU): on {ranks} CPU ranks the first"
            " training step would fail with 'SyncBatchNorm expected input tensor to be on GPU'",
            "drop Trainer(sync_batchnorm=True) on the CPU (each rank keeps its own BatchNorm statistics), or train on"
            " GPUs",
        )


class ReconciledTopology:
    """The ``cluster_environment``, ``num_nodes`` and ``parallel_devices`` of Lightning's strategies (the Trainer's and
    Fabric's), answered by a :class:`TopologyReconciler` at ``self._reconciler``: envddp's two strategies derive from
    this first, so Lightning's own code reads and sets them through it."""

    _reconciler: TopologyReconciler

    @property
    def topology(self) -> Topology:
        """What the launcher, or the cluster environment given, set up (validated)."""
        return self._reconciler.topology

    @property
    def cluster_environment(self) -> ClusterEnvironment | None:
        """Where the ranks come from: the ClusterEnvironment given (``EnvDDPStrategy(cluster_environment=...)`` or
        the Trainer's or Fabric's ``plugins``), else a :class:`~lightning_ddp_amp.LauncherEnvironment` over the
        launcher's variables.

        None until one of them is known: that is how Lightning knows to hand over its plugin.
        """
        return self._reconciler.environment

    @cluster_environment.setter
    def cluster_environment(self, environment: ClusterEnvironment | None) -> None:
        """Read the topology from ``environment`` (:meth:`TopologyReconciler.set_environment`); None leaves the
        choice open.

        Raises:
            LauncherEnvironmentError: A launcher variable, or a value the environment reports, is wrong.
            StrategyConfigurationError: The environment cannot be honoured (see
                :func:`~lightning_ddp_amp.launch.cluster_environment.environment_topology`).
        """
        self._reconciler.set_environment(environment)

    @property
    def num_nodes(self) -> int:
        """The launcher's number of nodes."""
        return self.topology.num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        """Ignored: the launcher decides the number of nodes (checked against the Trainer's or Fabric's
        ``num_nodes`` by :meth:`TopologyReconciler.check`)."""

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """One device per local rank, chosen from the topology once the accelerator is known (the devices given,
        until then)."""
        return self._reconciler.devices(getattr(self, "accelerator", None))

    @parallel_devices.setter
    def parallel_devices(self, parallel_devices: list[torch.device] | None) -> None:
        """One device per local rank, as ``devices=[...]``; checked against the launcher's processes per node by
        :meth:`TopologyReconciler.check`. None (Lightning's default) keeps the choice to the strategy."""
        self._reconciler.set_devices(parallel_devices)
