"""Starting the ranks no launcher started, where Lightning starts processes: the launcher of envddp's two strategies.

``trainer.fit`` (``validate``, ``test``, ``predict``) and ``fabric.launch()`` hand their strategy's launcher the function
to run, as they hand Lightning's ``_SubprocessScriptLauncher`` under ``strategy="ddp"``; building a Trainer or a Fabric
starts nothing. Without launcher variables and with several devices, :class:`StartMissingRanks` makes this process
torchrun's agent for the ranks (:mod:`lightning_ddp_amp.launch.selflaunch`): it never runs the function, and exits
with the ranks' status. Otherwise the function runs here: in a rank that a launcher started, or in the one process
that trains.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import torch
from lightning.fabric.accelerators.accelerator import Accelerator
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_ddp_amp.ddp.reconciler import TopologyReconciler, on_cuda_accelerator
from lightning_ddp_amp.launch import selflaunch
from lightning_ddp_amp.rank_zero import log_once


class _Launching(Protocol):
    """What the launcher reads of its strategy (the Trainer's envddp or Fabric's)."""

    @property
    def accelerator(self) -> Accelerator | None: ...

    @property
    def max_restarts(self) -> int: ...


class _Runs(Protocol):
    """What runs the function in each rank instead of calling it (auto-resume's launcher, which starts nothing)."""

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any | None = None, **kwargs: Any) -> Any: ...


def self_launch_arguments(reconciler: TopologyReconciler, strategy: _Launching) -> list[str] | None:
    """torchrun's arguments for the ranks this process starts itself (:func:`~lightning_ddp_amp.launch.selflaunch.plan`);
    None when a launcher started the ranks, or when one process trains. Starts nothing.

    Under a launcher, ``max_restarts`` is a warning naming the launcher's own option.

    Raises:
        StrategyConfigurationError: This process cannot start ranks (see :func:`selflaunch.plan
            <lightning_ddp_amp.launch.selflaunch.plan>`).
    """
    topology = reconciler.topology
    if topology.launcher != "none" and strategy.max_restarts:
        log_once(
            f"EnvDDPStrategy(max_restarts={strategy.max_restarts}) only applies when envddp starts the ranks"
            f" itself; {topology.launcher} started them, so pass the restarts to it (`torchrun"
            " --max-restarts=N`).",
            warn=True,
        )
    count = reconciler.missing_ranks(strategy.accelerator)
    return selflaunch.plan(count, strategy.max_restarts) if count else None


class StartMissingRanks:
    """The launcher of envddp's strategies, with the interface of Lightning's private ``_Launcher`` (the Trainer's and
    Fabric's) without deriving from it.

    Args:
        reconciler: The strategy's topology, reconciled with the Trainer's or Fabric's flags.
        strategy: The strategy, for its accelerator and ``max_restarts``.
        then: What runs the function in each rank instead of calling it, with the same arguments: auto-resume's
            choice of checkpoint (:class:`~lightning_ddp_amp.trainer.resume.AutoResumeLauncher`); None to call it.
    """

    #: An interactive session, which has no script to run again, gets envddp's own error when ranks must start.
    is_interactive_compatible = True

    def __init__(self, reconciler: TopologyReconciler, strategy: _Launching, then: _Runs | None = None) -> None:
        self._reconciler = reconciler
        self._strategy = strategy
        self._then = then

    @property
    def starts_ranks(self) -> bool:
        """Whether :meth:`launch` starts the ranks from this process, which then only supervises them (known once the
        Trainer's or Fabric's flags are checked)."""
        return self._reconciler.missing_ranks(self._strategy.accelerator) > 0

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any | None = None, **kwargs: Any) -> Any:
        """Start the ranks no launcher started, this process becoming their agent (it never returns then), or run
        ``function`` here.

        Args:
            function: What ``trainer.fit`` (``validate``, ...) or ``fabric.launch()`` runs.
            *args: Its positional arguments.
            trainer: The Trainer whose ``fit`` (``validate``, ...) this is; None under Fabric.
            **kwargs: Its keyword arguments.

        Raises:
            StrategyConfigurationError: This process cannot start ranks (see :func:`self_launch_arguments`).
        """
        arguments = self_launch_arguments(self._reconciler, self._strategy)
        if arguments is not None:
            self._supervise(arguments, trainer)
        if self._reconciler.topology.launcher == "none":
            on_cuda = on_cuda_accelerator(self._strategy.accelerator)
            log_once(
                f"envddp: no launcher variables, so one process trains on {'cuda' if on_cuda else 'cpu'}"
                f" ({self._reconciler.front}(devices=N) starts N ranks; so do torchrun, srun and mpirun)"
            )
        if self._then is not None:
            return self._then.launch(function, *args, trainer=trainer, **kwargs)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """Nothing to kill: in a rank this launcher started no process, and the agent's ranks are torchrun's to stop."""

    def _supervise(self, arguments: list[str], trainer: Any | None) -> NoReturn:
        """Become torchrun's agent for the ranks, and exit with their status (:func:`selflaunch.launch
        <lightning_ddp_amp.launch.selflaunch.launch>`)."""
        if on_cuda_accelerator(self._strategy.accelerator) and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            # The Trainer starts the ranks at fit, which the script cannot move earlier; Fabric at fabric.launch().
            fix = (
                "Call fabric.launch() before touching the GPU."
                if self._reconciler.front == "Fabric"
                else "Leave the GPU to the LightningModule's hooks, which run in the ranks only."
            )
            rank_zero_warn(
                f"CUDA was used before the {self._reconciler.front} started the ranks: this process only supervises"
                f" them now, but it keeps its CUDA context (and any tensors) on the GPU for the whole run. {fix}"
            )
        rank_zero_info(
            f"envddp: no launcher variables and {self._reconciler.missing_ranks(self._strategy.accelerator)} devices:"
            f" starting the ranks as `torchrun {' '.join(arguments)}`"
        )
        if trainer is not None:
            # The Trainer runs its launcher inside its error handling, which would hand this process's exit to the
            # Trainer's callbacks and loggers as a failed run (OnExceptionCheckpoint would save the untrained model
            # where the ranks save theirs). This process trains nothing: they are the ranks' alone.
            trainer.callbacks = []
            trainer.loggers = []
        try:
            selflaunch.launch(arguments)
        except KeyboardInterrupt:
            # Ctrl-C before torchrun took SIGINT over: exit as a shell reports it, not with the Trainer's status 1.
            raise SystemExit(128 + signal.SIGINT) from None
