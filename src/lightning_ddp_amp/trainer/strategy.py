"""EnvDDPStrategy: the classic torchrun + DistributedDataParallel recipe as a Lightning strategy.

The recipe, and where each of its lines happens here::

    rank, local_rank, world_size = RANK, LOCAL_RANK, WORLD_SIZE   # cluster_environment: read_topology()
    torch.cuda.set_device(local_rank)                             # setup_environment: pin the device
    dist.init_process_group("nccl"); dist.barrier()               # setup_distributed
    model.cuda(); optimizer = SGD(model.parameters())             # setup: device, then optimizers
    model, optimizer = amp.initialize(model, optimizer)           # setup: precision plugin, before DDP
    model = DDP(model, device_ids=[local_rank])                   # setup: DDP wrap, last
    DataLoader(sampler=DistributedSampler(...)); set_epoch(e)     # process_dataloader
    if rank == 0: save / log                                      # Lightning's rank-zero utilities
    dist.destroy_process_group()                                  # at interpreter exit
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Callable, Generator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.amp.crossing import crossing_into
from lightning_ddp_amp.ddp.launcher import StartMissingRanks, self_launch_arguments
from lightning_ddp_amp.ddp.reconciler import (
    ReconciledTopology,
    TopologyReconciler,
    check_layer_sync,
    join_process_group,
)
from lightning_ddp_amp.ddp.wrapper import (
    DDPOptions,
    check_comm_hook_backend,
    check_precision_plugin,
    explain_unused_parameters,
    holds_gradients,
    register_comm_hook,
    resolve_comm_hook,
)
from lightning_ddp_amp.launch import selflaunch
from lightning_ddp_amp.launch.process_group import (
    broadcast_module_states,
    explain_peer_failure,
    mean_of_integers,
    resolve_timeout,
    started_by_script,
)
from lightning_ddp_amp.rank_zero import log_once
from lightning_ddp_amp.trainer.position import (
    align_resumed_epoch,
    check_resumed_positions,
    explain_loader_state_mismatch,
)
from lightning_ddp_amp.trainer.precision import AmpPrecision
from lightning_ddp_amp.trainer.resume import (
    AtomicCheckpointIO,
    AutoResume,
    ResumePoint,
    check_checkpoint,
    check_step_schedulers,
    record_world_size,
    unreadable_checkpoint,
)
from lightning_ddp_amp.trainer.sharding import Sharding, shard_dataloader, warn_unshuffled_training_shards


class EnvDDPStrategy(ReconciledTopology, DDPStrategy):
    """DistributedDataParallel with the topology read from the launcher's environment.

    Launch with ``torchrun`` (or ``python -m torch.distributed.launch``, ``srun``, ``mpirun``) and pass
    ``Trainer(strategy="envddp")``; ``devices`` and ``num_nodes`` come from the launcher. Without launcher
    variables the same script trains as one process on the default device, with no process group, unless the
    Trainer asks for several devices (``devices=N``, or ``"auto"`` on a machine with several GPUs): then ``fit``
    starts the N ranks through torchrun from the strategy's launcher, re-running the script with the same arguments
    (:mod:`lightning_ddp_amp.ddp.launcher`). A process group the script started itself (a classic script's
    ``dist.init_process_group`` before the Trainer) is trained on once its rank, world size and backend are found to
    be the launcher's and envddp's; the script ends it, as it started it.

    Args:
        accelerator: The accelerator; normally chosen by the Trainer.
        parallel_devices: One device per local rank, as in Lightning's ``ddp``; their number must be the launcher's
            processes per node (LOCAL_WORLD_SIZE). On CUDA they map local ranks to GPUs, as ``Trainer(devices=[2,
            3])`` does; without a launcher, several devices start that many ranks. Default: ``cuda:LOCAL_RANK``
            (``cuda:0`` when each process sees one GPU), or the CPU.
        cluster_environment: A Lightning ``ClusterEnvironment`` to read the ranks, world size and rendezvous
            address from instead of the launcher's variables, e.g. ``KubeflowEnvironment()``; the same as passing it
            in the Trainer's ``plugins``. The processes per node come from its ``local_world_size()`` if it has one,
            1 for ``KubeflowEnvironment`` (one process per pod), else LOCAL_WORLD_SIZE.
        checkpoint_io: How checkpoints are written; normally chosen by the Trainer.
        precision_plugin: The precision plugin; normally chosen by the Trainer.
        process_group_backend: ``"nccl"`` or ``"gloo"``; default NCCL on CUDA, gloo on CPU.
        timeout: How long collectives, and the wait for all peers at start-up, may take before they fail.
            A ``timedelta`` or seconds. A process group the script started keeps the timeout the script gave it.
        find_unused_parameters: Passed to ``DistributedDataParallel``; None (here and in the next four) keeps
            the default, which is torch's except where :data:`~lightning_ddp_amp.ddp.wrapper.DEVIATIONS` says why not.
        static_graph: Passed to ``DistributedDataParallel``.
        gradient_as_bucket_view: Passed to ``DistributedDataParallel``. Default: True, unlike torch's, except under
            apex amp, which holds the model's gradients itself (:data:`~lightning_ddp_amp.ddp.wrapper.DEVIATIONS`):
            there False, and under apex O2 True is an error.
        bucket_cap_mb: Passed to ``DistributedDataParallel``.
        broadcast_buffers: Passed to ``DistributedDataParallel``.
        ddp_comm_hook: A DDP communication hook, or ``"fp16"`` / ``"bf16"`` for gradient compression.
        ddp_comm_state: The state handed to ``ddp_comm_hook``; None for the process group.
        ddp_comm_wrapper: Wraps ``ddp_comm_hook``, e.g. ``default_hooks.fp16_compress_wrapper``.
        max_restarts: When the strategy starts the ranks itself, how many times torchrun may restart them after a
            failure (``torchrun --max-restarts``); with ``auto_resume`` each restart resumes from the newest
            checkpoint. Under an external launcher, pass ``--max-restarts`` to it instead.
        auto_resume: Survive crashes and preemption (see :mod:`lightning_ddp_amp.trainer.resume`): every fit starts from
            the newest checkpoint of the ``ModelCheckpoint`` directory, and SIGTERM saves one before exiting.
        ddp_impl: ``"torch"`` (``torch.nn.parallel.DistributedDataParallel``) or ``"apex"``
            (``apex.parallel.DistributedDataParallel``, as apex-era scripts used; ``**ddp_kwargs`` then go to it).
        split_batches: The DataLoaders' ``batch_size`` is the global batch, divided evenly across ranks; one
            process trains the same global batches as several (see :mod:`lightning_ddp_amp.trainer.sharding`).
        exact_eval: Shard validation and test sets without padding duplicates, so every sample is evaluated once
            and epoch-level metrics equal a single-process run. Log eval metrics per epoch (Lightning's default
            for validation) when this is on: ranks may run one batch more or less than each other.
        **ddp_kwargs: Any other ``DistributedDataParallel`` argument, passed through untouched.

    Raises:
        LauncherEnvironmentError: A launcher variable, or a value the cluster environment reports, is missing,
            malformed or out of range (when the Trainer is built: a ClusterEnvironment plugin may still replace the
            launcher's variables).
        StrategyConfigurationError: An argument is invalid, or the process group the script started runs another
            backend than ``process_group_backend`` (default: envddp's choice for the device).
        TopologyMismatchError: The process group the script started has another rank or world size than the
            launcher's (when the process group is set up).
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
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        find_unused_parameters: bool | None = None,
        static_graph: bool | None = None,
        gradient_as_bucket_view: bool | None = None,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool | None = None,
        ddp_comm_hook: Literal["fp16", "bf16"] | Callable[..., Any] | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        split_batches: bool = False,
        exact_eval: bool = False,
        ddp_impl: Literal["torch", "apex"] = "torch",
        auto_resume: bool = False,
        max_restarts: int = 0,
        **ddp_kwargs: Any,
    ) -> None:
        # Filled by the cluster_environment and parallel_devices setters, which DDPStrategy.__init__ calls.
        self._reconciler = TopologyReconciler()
        self.max_restarts = selflaunch.check_max_restarts(max_restarts)
        named = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "bucket_cap_mb": bucket_cap_mb,
            "broadcast_buffers": broadcast_buffers,
        }
        self._ddp = DDPOptions(ddp_impl, named, ddp_kwargs, ddp_comm_state, comm_hook=bool(ddp_comm_hook))
        self.timeout = resolve_timeout(timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=resolve_comm_hook(ddp_comm_hook),
            ddp_comm_wrapper=ddp_comm_wrapper,
            process_group_backend=process_group_backend,
            timeout=self.timeout,
        )
        self.split_batches = split_batches
        self.exact_eval = exact_eval
        self._resume = AutoResume(auto_resume)
        self._group_ready = False  # setup_distributed has run for this strategy
        # The checkpoint the current fit continues from, until its training DataLoaders have their positions.
        self._resuming: ResumePoint | None = None
        if accelerator is not None:
            # Built with its accelerator, the strategy may run without a Trainer, so it reads the launcher now; a
            # Trainer's ClusterEnvironment plugin then meets Lightning's "set through both strategy and plugins".
            self._reconciler.use_launcher_unless_given()

    def check_trainer_flags(
        self, devices: list[int] | str | int, num_nodes: int, use_distributed_sampler: bool = True
    ) -> None:
        """Check the Trainer's ``devices``, ``num_nodes`` and ``use_distributed_sampler`` against this strategy.

        ``devices="auto"`` and ``num_nodes=1`` (the Trainer's defaults) mean "whatever the launcher started".
        On CUDA an explicit list of GPU indices maps local ranks to GPUs, as in Lightning's ``ddp``; so does
        ``EnvDDPStrategy(parallel_devices=...)``. It starts nothing: the launcher does, when ``fit`` begins.

        Raises:
            TopologyMismatchError: an explicit value (or ``parallel_devices``) contradicts the launcher, or
                ``devices`` contradicts ``parallel_devices``.
            StrategyConfigurationError: ``exact_eval`` with ``use_distributed_sampler=False``, ``sync_batchnorm=True``
                on CPU ranks, a DDP option the precision plugin cannot train with (:func:`~lightning_ddp_amp.ddp.wrapper.check_precision_plugin`),
                or ranks this process cannot start (:func:`~lightning_ddp_amp.ddp.launcher.self_launch_arguments`).
        """
        check_precision_plugin(self.precision_plugin, self._ddp, self._ddp_comm_hook, self._ddp_comm_wrapper)
        self._reconciler.check(self.accelerator, devices, num_nodes, use_distributed_sampler, self.exact_eval)
        ranks = max(self.topology.world_size, len(self._reconciler.requested or []))
        check_layer_sync(self._layer_sync, self.accelerator, ranks)
        self_launch_arguments(self._reconciler, self)  # refuses now the ranks this process could not start at fit

    @override
    def _configure_launcher(self) -> None:
        # fit hands the launcher its function, as it hands Lightning's; each rank runs it from auto_resume's checkpoint.
        self._launcher = StartMissingRanks(self._reconciler, self, then=self._resume.launcher())  # type: ignore[assignment]

    @override
    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        if self._group_ready:
            return  # an earlier fit, validate or test with this strategy set it up
        backend_given = self._process_group_backend is not None
        backend = self._get_process_group_backend()
        if self.topology.is_distributed or started_by_script():
            self._process_group_backend = backend
        if self.topology.is_distributed:
            check_comm_hook_backend(self._ddp_comm_hook, self._ddp_comm_wrapper, backend)
        if not join_process_group(self.topology, backend, backend_given, self.timeout, self.root_device):
            return
        self._resume.setup_distributed()
        self.barrier("envddp: process group ready")
        self._group_ready = True

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        # 1. SyncBatchNorm conversion (Trainer(sync_batchnorm=True)), before anything holds the layers.
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        # 2. The precision plugin's dtype conversion, then the recipe's `model.cuda()`.
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # 3. The DataLoaders are sharded by process_dataloader; Lightning only shards predictions.
        self._reconciler.route_sampler_injection(trainer)
        if fitting:
            # 4. Optimizers over the bare module's parameters, as the recipe builds them before amp and DDP.
            self.setup_optimizers(trainer)
        # 5. The precision plugin sees the model and the raw optimizers: where the recipe calls amp.initialize.
        self.setup_precision_plugin()
        if fitting:
            _lightning.optimizers_to_device(self.optimizers, self.root_device)
        if not self.topology.is_distributed:
            return
        if not fitting:
            # No DDP wrapper outside fit: start every rank from rank 0's weights, as DDP's constructor would.
            broadcast_module_states(self.model)
            return
        # 6. DDP wraps last, around whatever the precision plugin returned.
        self.configure_ddp()
        # 7. Every rank holds rank 0's weights: apex O2 takes them into its fp32 masters (the recipe's first backward).
        if isinstance(self.precision_plugin, AmpPrecision):
            self.precision_plugin.models_wrapped()

    @property
    def ddp_options(self) -> dict[str, Any]:
        """What DDP gets: the options changed from torch's defaults, and envddp's (``DEVIATIONS``) for its plugin."""
        return self._ddp.to_kwargs(holds_gradients(self.precision_plugin))

    @override
    def configure_ddp(self) -> None:
        assert self.model is not None
        self._ddp_kwargs = self.ddp_options
        if holds_gradients(self.precision_plugin):
            for name, reason in self._ddp.kept_under_apex().items():
                log_once(f"envddp: {name} stays off under {self.precision_plugin}: {reason}")
        self.model = self._setup_model(self.model)
        self._register_ddp_hooks()

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        if self._ddp.apex is not None:
            # Lightning treats self.model as a plain Module everywhere it matters, apex's wrapper included.
            return self._ddp.apex.wrap(model, self._ddp_kwargs)  # type: ignore[no-any-return]
        return super()._setup_model(model)

    @override
    def _register_ddp_hooks(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            register_comm_hook(self.model, self._ddp_comm_hook, self._ddp_comm_wrapper, self._ddp_comm_state)

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        apex = self._ddp.apex
        with apex.no_sync(self.model) if apex and apex.wraps(self.model) else super().block_backward_sync():
            yield

    @override
    def process_dataloader(self, dataloader: object) -> object:
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        sharding = Sharding(
            num_replicas=self.topology.world_size,
            rank=self.topology.rank,
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
            shard=bool(self._reconciler.shard_dataloaders),
            split_batches=self.split_batches,
            exact_eval=self.exact_eval,
            progress=lambda: (trainer.current_epoch, *_lightning.epoch_progress(trainer)),
            resuming=self._resuming,
        )
        return shard_dataloader(dataloader, trainer.state.stage, sharding)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None
        self._resume.on_train_start(self.lightning_module.trainer)
        # Before the first batch: a mid-epoch position the training DataLoaders did not get is refused.
        trainer = self.lightning_module.trainer
        resuming, self._resuming = self._resuming, None
        check_resumed_positions(trainer.train_dataloader, resuming, self.topology.world_size)
        # A resumed epoch counts its batches in this run's world size; a schedule it would outrun stops it here.
        start = align_resumed_epoch(trainer)
        if resuming is not None and start is not None:
            check_step_schedulers(trainer, resuming, self.topology.world_size, start)
        # The recipe's DistributedSampler shuffled; a training DataLoader left at shuffle=False does not.
        warn_unshuffled_training_shards(trainer.train_dataloader)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        assert self.lightning_module is not None
        self._resume.on_train_batch_start(self.lightning_module.trainer, batch_idx)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._resume.stop()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        explain_unused_parameters(exception, self._ddp_kwargs)
        explain_peer_failure(exception, self.timeout)
        explain_loader_state_mismatch(exception, self._resuming)

    @override
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """Reduce ``tensor`` across ranks; a mean of an integer tensor keeps its fraction (:func:`mean_of_integers
        <lightning_ddp_amp.launch.process_group.mean_of_integers>`: ``exact_eval``'s uneven shards need it)."""
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if mean and isinstance(tensor, Tensor) and not tensor.is_floating_point() and dist.is_initialized():
            return mean_of_integers(tensor, group)
        return super().reduce(tensor, group, reduce_op)

    @property
    def auto_resume(self) -> bool:
        """``EnvDDPStrategy(auto_resume=...)``: whether each fit resumes from the newest checkpoint."""
        return self._resume.enabled

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint ``auto_resume`` continued the current fit from; None for a fresh start."""
        return self._resume.resumed_from

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Lightning's checkpoint format, written atomically (:class:`~lightning_ddp_amp.trainer.resume.AtomicCheckpointIO`)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # Which samples a mid-epoch position names depends on the number of ranks, also for DataLoaders that record
        # no layout of their own (check_resumed_positions).
        record_world_size(checkpoint, self.topology.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as error:
            raise unreadable_checkpoint(checkpoint_path, error) from error
        check_checkpoint(checkpoint, checkpoint_path)
        if not isinstance(self.precision_plugin, AmpPrecision):  # AmpPrecision says it in on_load_checkpoint
            crossing = crossing_into(checkpoint, self.precision_plugin)
            if crossing is not None:
                rank_zero_info(crossing)
        auto_resumed = self.resumed_from is not None and Path(checkpoint_path) == self.resumed_from
        self._resuming = ResumePoint.read(checkpoint, checkpoint_path, auto_resumed)
        return checkpoint

    @override
    def teardown(self) -> None:
        if self._ddp.apex is not None and self._ddp.apex.wraps(self.model):
            self.model = self.lightning_module
        self._resume.stop()
        self._resuming = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _lightning.StrategyRegistryType) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DDP with the topology read from the launcher's environment"
        )
        strategy_registry.register(
            f"{cls.strategy_name}_find_unused_parameters_true",
            cls,
            description="envddp with `find_unused_parameters=True`",
            find_unused_parameters=True,
        )
