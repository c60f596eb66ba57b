"""EnvDDPStrategy for Lightning Fabric: the classic torchrun + DDP + apex recipe in a loop the script keeps.

The recipe, and where each of its lines happens under ``Fabric(strategy="envddp", precision="apex-O1")``::

    rank, local_rank, world_size = RANK, LOCAL_RANK, WORLD_SIZE   # Fabric(...): read_topology()
    torch.cuda.set_device(local_rank)                             # fabric.launch(): pin the device
    dist.init_process_group("nccl"); dist.barrier()               # fabric.launch(): join_or_start
    model.cuda()                                                  # fabric.setup: Fabric moves the model
    model, optimizer = amp.initialize(model, optimizer)           # fabric.setup: setup_module_and_optimizers
    model = DDP(model, device_ids=[local_rank])                   # fabric.setup: setup_module, last
    DataLoader(sampler=DistributedSampler(...))                   # fabric.setup_dataloaders
    with amp.scale_loss(loss, optimizer) as s: s.backward()       # fabric.backward(loss)

Topology, devices, the process group and the DDP options are the Trainer strategy's
(:mod:`lightning_ddp_amp.ddp.reconciler`, :mod:`lightning_ddp_amp.launch.process_group`,
:mod:`lightning_ddp_amp.ddp.wrapper`); only Fabric's hooks are answered here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric import Fabric
from lightning.fabric.accelerators.accelerator import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies.ddp import DDPStrategy
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.ddp.launcher import StartMissingRanks
from lightning_ddp_amp.ddp.reconciler import ReconciledTopology, TopologyReconciler, join_process_group
from lightning_ddp_amp.ddp.wrapper import DDPOptions, check_precision_plugin, holds_gradients
from lightning_ddp_amp.errors import PrecisionConfigurationError, StrategyConfigurationError
from lightning_ddp_amp.fabric.data import accept_set_epoch, keep_script_epoch
from lightning_ddp_amp.fabric.precision import SETUP_MODELS, AmpPrecision
from lightning_ddp_amp.launch import selflaunch
from lightning_ddp_amp.launch.process_group import resolve_timeout


class EnvDDPStrategy(ReconciledTopology, DDPStrategy):
    """Fabric's DistributedDataParallel with the topology read from the launcher's environment.

    ``Fabric(strategy="envddp")`` under ``torchrun`` (``torch.distributed.launch``, ``srun``, ``mpirun``, or a
    ClusterEnvironment plugin): ``devices`` and ``num_nodes`` come from the launcher and ``fabric.launch()`` starts
    nothing. Without a launcher, ``fabric.launch()`` starts ``devices=N`` ranks through torchrun, re-running the
    script, as ``Trainer(strategy="envddp")`` does; with one device the script trains as one process, unwrapped.

    Under apex (``precision="apex-O*"``) ``fabric.setup(model, optimizer)`` calls ``amp.initialize`` before the DDP
    wrap; several models sharing an optimizer go through :func:`setup_models`.

    Args:
        accelerator: The accelerator; normally chosen by Fabric.
        parallel_devices: One device per local rank, as in Fabric's ``ddp``; default: the launcher's.
        cluster_environment: A Lightning ``ClusterEnvironment`` to read the ranks from instead of the launcher's
            variables; the same as passing it in Fabric's ``plugins``.
        checkpoint_io: How checkpoints are written; normally chosen by Fabric.
        precision: The precision plugin; normally ``Fabric(precision=...)``'s.
        process_group_backend: ``"nccl"`` or ``"gloo"``; default NCCL on CUDA, gloo on CPU.
        timeout: How long collectives, and the wait for all peers at start-up, may take. A ``timedelta`` or seconds.
        find_unused_parameters: Passed to ``DistributedDataParallel``, as on the Trainer's envddp.
        static_graph: Passed to ``DistributedDataParallel``.
        gradient_as_bucket_view: Passed to ``DistributedDataParallel``; default True except under apex amp.
        bucket_cap_mb: Passed to ``DistributedDataParallel``.
        broadcast_buffers: Passed to ``DistributedDataParallel``.
        ddp_impl: ``"torch"`` or ``"apex"`` (``apex.parallel.DistributedDataParallel``).
        max_restarts: When ``fabric.launch()`` starts the ranks itself, how many times torchrun may restart them.
        **ddp_kwargs: Any other ``DistributedDataParallel`` argument, passed through untouched.

    Raises:
        LauncherEnvironmentError: A launcher variable is missing, malformed or out of range.
        StrategyConfigurationError: An argument is invalid.
    """

    strategy_name = "envddp"
    #: The precision plugin connects (apex: ``amp.initialize``) before the DDP wrap; AmpPrecision asks for this.
    connects_precision_before_wrap = True

    def __init__(
        self,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        find_unused_parameters: bool | None = None,
        static_graph: bool | None = None,
        gradient_as_bucket_view: bool | None = None,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool | None = None,
        ddp_impl: Literal["torch", "apex"] = "torch",
        max_restarts: int = 0,
        **ddp_kwargs: Any,
    ) -> None:
        self._reconciler = TopologyReconciler(front="Fabric")
        self.max_restarts = selflaunch.check_max_restarts(max_restarts)
        named = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "bucket_cap_mb": bucket_cap_mb,
            "broadcast_buffers": broadcast_buffers,
        }
        self._ddp = DDPOptions(ddp_impl, named, ddp_kwargs, None, comm_hook=False)
        self.timeout = resolve_timeout(timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=self.timeout,
        )
        self._backward_sync_control = _BackwardSync(self._ddp, lambda: self.precision)  # type: ignore[assignment]
        if accelerator is not None:
            self._reconciler.use_launcher_unless_given()

    def check_fabric_flags(self, devices: list[int] | str | int, num_nodes: int) -> None:
        """Check Fabric's ``devices`` and ``num_nodes`` against the launcher, and the DDP options against the
        precision plugin; called when Fabric is built (see :meth:`lightning_ddp_amp.EnvDDPStrategy.check_trainer_flags`).

        Raises:
            TopologyMismatchError: An explicit value contradicts the launcher.
            StrategyConfigurationError: A DDP option the precision plugin cannot train with.
        """
        check_precision_plugin(self.precision, self._ddp, None, None)
        self._reconciler.check(self.accelerator, devices, num_nodes, True, False)

    @override
    def _configure_launcher(self) -> None:
        # fabric.launch() starts the ranks no launcher started, as the Trainer's fit does.
        self._launcher = StartMissingRanks(self._reconciler, self)  # type: ignore[assignment]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:  # type: ignore[override]
        """None in one process: Fabric then keeps the script's sampler (and so its shuffle from the script's seed), as
        the Trainer's envddp and Fabric's single-device strategy do."""
        if not self.topology.is_distributed:
            return None
        return {"num_replicas": self.topology.world_size, "rank": self.topology.rank}

    @override
    def process_dataloader(self, dataloader: DataLoader[Any]) -> DataLoader[Any]:
        """``fabric.setup_dataloaders``: the distributed sampler Fabric put in keeps the epoch the script sets, so a
        resumed run shuffles as the classic resume; in one process the script's own sampler takes ``set_epoch``
        (:mod:`lightning_ddp_amp.fabric.data`)."""
        keep_script_epoch(dataloader)
        if not self.topology.is_distributed:
            accept_set_epoch(dataloader)
        return dataloader

    @override
    def _setup_distributed(self) -> None:
        self._set_world_ranks()
        backend_given = self._process_group_backend is not None
        backend = self._get_process_group_backend()
        if join_process_group(self.topology, backend, backend_given, self.timeout, self.root_device):
            self._process_group_backend = backend
            self.barrier()

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], *scheduler: Any
    ) -> tuple[Any, ...]:
        """``fabric.setup(model, optimizer)``: the precision plugin (``amp.initialize``) sees the model and the raw
        optimizers, then the model is wrapped in DDP. ``scheduler`` is there on the Lightning releases that pass one.

        Raises:
            StrategyConfigurationError: A second model among the optimizers (``fabric.setup(model_a, model_b,
                optimizer)``).
        """
        for given in optimizers:
            if isinstance(given, Module):
                names = ", ".join(type(item).__name__ for item in (module, *optimizers))
                raise StrategyConfigurationError(
                    "fabric.setup",
                    f"({names})",
                    f"Fabric sets up one model per call and takes every argument after it for an optimizer, so"
                    f" {type(given).__name__} would be treated as an optimizer",
                    f"set up several models that share an optimizer in one call: {SETUP_MODELS}",
                )
        self.connect_precision([module], optimizers, "fabric.setup(model, optimizer)")
        module = self.setup_module(module)
        self.wrapped_precision()
        return (module, [self.setup_optimizer(optimizer) for optimizer in optimizers], *scheduler)

    def connect_precision(self, models: Sequence[Module], optimizers: Sequence[Optimizer], call: str) -> None:
        """Hand the models, on their device, and their raw optimizers to the precision plugin before any DDP wrap:
        where the recipe calls ``amp.initialize``."""
        if isinstance(self.precision, AmpPrecision):
            self.precision.connect(models, optimizers, call)
            for optimizer in optimizers:
                _lightning.keep_fabric_zero_grad(optimizer)
            _lightning.optimizers_to_device(list(optimizers), self.root_device)

    def wrapped_precision(self) -> None:
        """Tell the precision plugin that the models it connected are wrapped (every rank holds rank 0's weights):
        apex O2 takes them into its fp32 masters, as the recipe's first backward after the wrap does."""
        if isinstance(self.precision, AmpPrecision):
            self.precision.models_wrapped()

    @override
    def setup_module(self, module: Module) -> Module:  # type: ignore[override]
        """Wrap the model in DDP (torch's, or apex's with ``ddp_impl="apex"``); one rank trains it unwrapped.

        Raises:
            PrecisionConfigurationError: Under apex, a model that did not go through ``amp.initialize`` with its
                optimizer (``fabric.setup_module(model)`` before ``fabric.setup_optimizers``).
        """
        plugin = self.precision
        if isinstance(plugin, AmpPrecision) and plugin.initializes_with_optimizers and not plugin.connected(module):
            raise PrecisionConfigurationError(
                "fabric.setup_module",
                type(module).__name__,
                f"under precision {plugin.flag!r} amp.initialize needs the model together with its optimizer, before"
                " the DDP wrap that setup_module would do now (apex takes the optimizer in one amp.initialize only)",
                f"build the optimizer first, then fabric.setup(model, optimizer); for several models, {SETUP_MODELS}",
            )
        if not self.topology.is_distributed:
            return module
        self._ddp_kwargs = self._ddp.to_kwargs(holds_gradients(plugin))
        if self._ddp.apex is not None:
            return self._ddp.apex.wrap(module, self._ddp_kwargs)  # type: ignore[no-any-return]
        return super().setup_module(module)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Refuse, under apex, an optimizer that did not go through ``amp.initialize``.

        Raises:
            PrecisionConfigurationError: ``fabric.setup_optimizers(optimizer)`` after the models were set up alone.
        """
        plugin = self.precision
        if isinstance(plugin, AmpPrecision) and plugin.initializes_with_optimizers and not plugin.connected(optimizer):
            raise PrecisionConfigurationError(
                "fabric.setup_optimizers",
                type(optimizer).__name__,
                f"under precision {plugin.flag!r} the optimizer must go through amp.initialize together with"
                " its models, before their DDP wrap",
                f"pass it with its model: fabric.setup(model, optimizer), or {SETUP_MODELS}",
            )
        return super().setup_optimizer(optimizer)

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """``fabric.backward(loss)``; the arguments only AmpPrecision takes (``loss_id``, ``optimizers``,
        ``delay_unscale``) are refused under another precision plugin, which would hand them to ``Tensor.backward``.

        Raises:
            PrecisionConfigurationError: ``loss_id``, ``optimizers`` or ``delay_unscale`` without AmpPrecision.
        """
        given = [name for name in ("loss_id", "optimizers", "delay_unscale") if name in kwargs]
        if given and not isinstance(self.precision, AmpPrecision):
            precision = getattr(self.precision, "precision", type(self.precision).__name__)
            raise PrecisionConfigurationError(
                given[0],
                kwargs[given[0]],
                f"fabric.backward(loss, {', '.join(f'{name}=...' for name in given)}) under precision {precision!r}:"
                f" only AmpPrecision takes {' and '.join(given)} (a loss scaler per loss), and Lightning's"
                f" {type(self.precision).__name__} would pass them to Tensor.backward, which has no such argument",
                "call fabric.backward(loss) under Lightning's precisions, or use"
                ' Fabric(strategy="envddp", plugins=[AmpPrecision(opt_level, backend, num_losses=2)]) for a loss'
                " scaler per loss",
            )
        super().backward(tensor, module, *args, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """``fabric.clip_gradients(model, optimizer, max_norm=...)`` on the parameters the optimizer steps (apex
        O2's fp32 masters). Under a dynamic loss scale a non-finite norm is an overflow whose step the scaler skips,
        so it is returned (inf or nan), not raised."""
        if isinstance(self.precision, AmpPrecision) and self.precision.may_skip_steps:
            error_if_nonfinite = False
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        if self._ddp.apex is not None and self._ddp.apex.wraps(module):
            module = module.module  # type: ignore[assignment]
        return super().get_module_state_dict(module)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if self._ddp.apex is not None and self._ddp.apex.wraps(module):
            module = module.module  # type: ignore[assignment]
        super().load_module_state_dict(module, state_dict, strict)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DDP with the topology read from the launcher's environment"
        )
        strategy_registry.register(
            f"{cls.strategy_name}_find_unused_parameters_true",
            cls,
            description="envddp with `find_unused_parameters=True`",
            find_unused_parameters=True,
        )


class _BackwardSync:
    """``fabric.no_backward_sync(model)``: DDP's ``no_sync`` (torch's or apex's; nothing for an unwrapped model), during
    which AmpPrecision's backward keeps apex's gradients scaled (``delay_unscale``), as apex's accumulation recipe does.
    """

    def __init__(self, ddp: DDPOptions, precision: Callable[[], object]) -> None:
        self._ddp = ddp
        self._precision = precision

    @contextlib.contextmanager
    def no_backward_sync(self, module: Module, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        plugin = self._precision()
        with contextlib.ExitStack() as stack:
            if self._ddp.apex is not None and self._ddp.apex.wraps(module):
                stack.enter_context(self._ddp.apex.no_sync(module))
            elif isinstance(module, DistributedDataParallel):
                stack.enter_context(module.no_sync())
            if isinstance(plugin, AmpPrecision):
                stack.enter_context(plugin.accumulating())
            yield


def setup_models(fabric: Fabric, models: Sequence[Module], *optimizers: Optimizer) -> tuple[Any, ...]:
    """Set up several models that share their optimizer(s): the recipe's
    ``[model_a, model_b], optimizer = amp.initialize([model_a, model_b], optimizer)`` before each DDP wrap.

    ``[model_a, model_b], optimizer = setup_models(fabric, [model_a, model_b], optimizer)``. Every model is moved to
    the device, then handed with the raw optimizers to the precision plugin (one ``amp.initialize``), then set up
    with ``fabric.setup_module`` (the DDP wrap), and the optimizers with ``fabric.setup_optimizers``. Under another
    strategy it is those two Fabric calls.

    Args:
        fabric: The script's Fabric, launched.
        models: The models, not yet set up.
        *optimizers: Their optimizers, not yet set up.

    Returns:
        The list of set-up models, then each set-up optimizer.

    Raises:
        StrategyConfigurationError: ``models`` is not a non-empty sequence of modules, or no optimizer is given.
    """
    models = list(models) if isinstance(models, (list, tuple)) else [models]  # type: ignore[list-item]
    if not models or not all(isinstance(model, Module) for model in models):
        raise StrategyConfigurationError(
            "models",
            [type(model).__name__ for model in models],
            "setup_models takes a list of torch.nn.Module, then the optimizers",
            "call setup_models(fabric, [model_a, model_b], optimizer)",
        )
    if not optimizers:
        raise StrategyConfigurationError(
            "optimizers",
            "none",
            "setup_models sets up models with the optimizer they share; without one, there is nothing to share",
            "pass the optimizer: setup_models(fabric, [model_a, model_b], optimizer), or fabric.setup_module(model)"
            " for a model that trains without one",
        )
    strategy = fabric.strategy
    if isinstance(strategy, EnvDDPStrategy):
        for model in models:
            fabric.to_device(strategy.precision.convert_module(model))
        strategy.connect_precision(models, optimizers, "setup_models(fabric, models, optimizer)")
    wrapped = [fabric.setup_module(model) for model in models]
    if isinstance(strategy, EnvDDPStrategy):
        strategy.wrapped_precision()
    set_up = fabric.setup_optimizers(*optimizers)
    return (wrapped, *(set_up if isinstance(set_up, tuple) else (set_up,)))
