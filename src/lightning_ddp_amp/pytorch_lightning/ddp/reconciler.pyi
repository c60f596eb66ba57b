# Generated from ../../ddp/reconciler.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""What the Trainer says about the run, reconciled with what the launcher started.

The Trainer hands a strategy its cluster environment (``plugins=[...]`` or its own pick), its devices
(``parallel_devices``), and, through the hook around its construction, the raw ``devices``, ``num_nodes`` and
``use_distributed_sampler`` (:meth:`EnvDDPStrategy.check_trainer_flags
<lightning_ddp_amp.pytorch_lightning.EnvDDPStrategy.check_trainer_flags>`). The launcher has already decided the ranks, the nodes and
the processes per node. :class:`TopologyReconciler` keeps what each side said, picks the device of every local
rank, refuses a Trainer argument that contradicts the launcher, and starts the ranks no launcher started
(:meth:`TopologyReconciler.start_missing_ranks`). ``EnvDDPStrategy`` keeps Lightning's interface (its
``cluster_environment``, ``parallel_devices`` and ``num_nodes`` properties) and hands each to this module.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning_fabric.accelerators.accelerator import Accelerator
from lightning_fabric.accelerators.cuda import CUDAAccelerator as FabricCUDAAccelerator
from lightning_fabric.plugins import ClusterEnvironment
from pytorch_lightning.accelerators import CPUAccelerator, CUDAAccelerator
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.errors import StrategyConfigurationError, TopologyMismatchError
from lightning_ddp_amp.launch import selflaunch
from lightning_ddp_amp.pytorch_lightning.launch.cluster_environment import LauncherEnvironment, environment_topology, is_lightning_default
from lightning_ddp_amp.launch.devices import select_devices
from lightning_ddp_amp.launch.environment import Topology, read_topology, started_by
from lightning_ddp_amp.launch.process_group import group_line, join_or_start, started_by_script
from lightning_ddp_amp.pytorch_lightning.rank_zero import log_once


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
        ...

    @property
    def environment(self) -> ClusterEnvironment | None:
        """The ClusterEnvironment the ranks come from; None until one is given or the launcher is read."""
        ...

    @property
    def topology(self) -> Topology:
        """What the launcher, or the cluster environment given, set up (validated); read from the launcher's
        variables when no environment was given.

        Raises:
            LauncherEnvironmentError: A launcher variable is wrong.
        """
        ...

    def use_launcher_unless_given(self) -> None:
        """Read the launcher's variables, unless an environment was given: used outside a Trainer, nothing hands
        one over.

        Raises:
            LauncherEnvironmentError: A launcher variable is wrong.
        """
        ...

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
        ...

    def devices(self, accelerator: Accelerator | None) -> list[torch.device] | None:
        """One device per local rank, chosen from the topology once the accelerator is known (the devices given,
        until then)."""
        ...

    def set_devices(self, parallel_devices: list[torch.device] | None) -> None:
        """One device per local rank, as ``Trainer(devices=[...])``; checked against the launcher's processes per
        node by :meth:`check`. None (Lightning's default) keeps the choice to envddp."""
        ...

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
        ...

    def route_sampler_injection(self, trainer: Any) -> None:
        """Keep Lightning's own sampler injection for predictions only: envddp shards the other DataLoaders itself
        (``EnvDDPStrategy.process_dataloader``), as ``use_distributed_sampler`` says."""
        ...

    def start_missing_ranks(self, accelerator: Accelerator | None, max_restarts: int) -> None:
        """No launcher started this process: start one rank per device through torchrun, or train alone.

        The ranks start when the Trainer is built rather than in a Lightning launcher when ``fit`` begins: this
        process becomes torchrun's agent, which supervises and restarts the ranks and never trains (a Lightning
        launcher runs ``fit`` in the calling process), and the script up to this point runs once more in the agent,
        so the earlier the better. ``devices="auto"`` means every visible GPU on CUDA, one process on the CPU (as in
        Lightning). Under a launcher it only logs who started the ranks.

        Raises:
            StrategyConfigurationError: This process cannot start ranks (see :func:`selflaunch.plan`).
        """
        ...


def join_process_group(
    topology: Topology, backend: str, backend_given: bool, timeout: timedelta, device: torch.device
) -> bool:
    """Join or start the process group this rank trains in (:func:`~lightning_ddp_amp.launch.process_group.join_or_start`)
    and say how on rank 0, for the Trainer's and Fabric's envddp alike.

    Returns:
        Whether there is a group; False when this process trains alone (said once, unless no launcher started it:
        then ``start_missing_ranks`` said it).
    """
    ...


def on_cuda_accelerator(accelerator: object) -> bool:
    """Whether ``accelerator`` is the Trainer's or Fabric's CUDA accelerator (two classes of one name)."""
    ...


def _requested_devices(accelerator: Accelerator | None, devices: list[int] | str | int) -> list[torch.device] | None:
    """The devices an explicit ``Trainer(devices=...)`` names; None for ``"auto"``."""
    ...


def check_layer_sync(layer_sync: object | None, accelerator: Accelerator | None, ranks: int) -> None:
    """Refuse ``Trainer(sync_batchnorm=True)`` where torch's SyncBatchNorm cannot run: on CPU ranks.

    Raises:
        StrategyConfigurationError: ``sync_batchnorm=True`` with several ranks on the CPU.
    """
    ...


class ReconciledTopology:
    """The ``cluster_environment``, ``num_nodes`` and ``parallel_devices`` of Lightning's strategies (the Trainer's and
    Fabric's), answered by a :class:`TopologyReconciler` at ``self._reconciler``: envddp's two strategies derive from
    this first, so Lightning's own code reads and sets them through it."""

    _reconciler: TopologyReconciler

    @property
    def topology(self) -> Topology:
        """What the launcher, or the cluster environment given, set up (validated)."""
        ...

    @property
    def cluster_environment(self) -> ClusterEnvironment | None:
        """Where the ranks come from: the ClusterEnvironment given (``EnvDDPStrategy(cluster_environment=...)`` or
        the Trainer's or Fabric's ``plugins``), else a :class:`~lightning_ddp_amp.pytorch_lightning.LauncherEnvironment` over the
        launcher's variables.

        None until one of them is known: that is how Lightning knows to hand over its plugin.
        """
        ...

    @cluster_environment.setter
    def cluster_environment(self, environment: ClusterEnvironment | None) -> None:
        """Read the topology from ``environment`` (:meth:`TopologyReconciler.set_environment`); None leaves the
        choice open.

        Raises:
            LauncherEnvironmentError: A launcher variable, or a value the environment reports, is wrong.
            StrategyConfigurationError: The environment cannot be honoured (see
                :func:`~lightning_ddp_amp.pytorch_lightning.launch.cluster_environment.environment_topology`).
        """
        ...

    @property
    def num_nodes(self) -> int:
        """The launcher's number of nodes."""
        ...

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        """Ignored: the launcher decides the number of nodes (checked against the Trainer's or Fabric's
        ``num_nodes`` by :meth:`TopologyReconciler.check`)."""

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """One device per local rank, chosen from the topology once the accelerator is known (the devices given,
        until then)."""
        ...

    @parallel_devices.setter
    def parallel_devices(self, parallel_devices: list[torch.device] | None) -> None:
        """One device per local rank, as ``devices=[...]``; checked against the launcher's processes per node by
        :meth:`TopologyReconciler.check`. None (Lightning's default) keeps the choice to the strategy."""
        ...
