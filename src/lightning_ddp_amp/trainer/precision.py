"""AmpPrecision: apex amp and native torch AMP in one Lightning precision plugin.

``Trainer(strategy="envddp", precision="apex-O1")`` gives the apex recipe::

    model, optimizer = amp.initialize([model_a, model_b], optimizer, opt_level="O1")  # before DDP
    model = DDP(model)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

``precision="amp-O1"`` does the same with apex when it is importable and with torch.amp otherwise, and
``precision="native-O1"`` with torch.amp even where apex is installed; the table in
:mod:`lightning_ddp_amp.amp.native_backend` says what each level means natively.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import Unpack, override

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.amp.backend import AmpBackend, Placement, backend_names, choose_backend
from lightning_ddp_amp.amp.checkpoint_weights import put_fp32_masters
from lightning_ddp_amp.amp.crossing import describe_crossing, grad_scaler_state
from lightning_ddp_amp.amp.loss_optimizers import LossOptimizers
from lightning_ddp_amp.amp.settings import AmpOptions, AmpSettings, check_choice, check_half_steps, settings_of
from lightning_ddp_amp.errors import PrecisionConfigurationError
from lightning_ddp_amp.precision_strings import OptLevel, resolve_flag
from lightning_ddp_amp.trainer.amp_models import amp_modules, check_models
from lightning_ddp_amp.trainer.skip_aware_scheduler import skip_aware

BACKENDS = ("auto", *backend_names())


class AmpPrecision(Precision):
    """Mixed precision with NVIDIA apex amp or native torch AMP, in the apex recipe's order.

    Args:
        opt_level: apex's optimization level, ``"O0"`` … ``"O3"``.
        backend: ``"apex"`` (NVIDIA apex required), ``"native"`` (torch.amp) or ``"auto"`` (apex when it can be
            imported, else native).
        models: Attribute names (dotted paths allowed) of the LightningModule's sub-modules to hand to
            ``amp.initialize``, e.g. ``["model_a", "model_b"]``. The LightningModule can instead define
            ``configure_amp_models()`` returning the modules. Default: the LightningModule itself.
        **options: ``amp.initialize``'s other options (``keep_batchnorm_fp32``, ``loss_scale``, ``num_losses``,
            ``min_loss_scale``, ``max_loss_scale``, ``cast_model_outputs``) and the native backend's ``dtype``:
            :class:`~lightning_ddp_amp.amp.settings.AmpOptions`. With ``num_losses=2``, pass ``loss_id`` to
            ``manual_backward``.

    Raises:
        PrecisionConfigurationError: An argument is invalid or the combination cannot run.
        ApexUnavailableError: ``backend="apex"`` and apex amp cannot be imported.
    """

    def __init__(
        self,
        opt_level: OptLevel = AmpSettings.opt_level,
        backend: Literal["auto", "apex", "native"] = "auto",
        models: Sequence[str] | None = None,
        **options: Unpack[AmpOptions],
    ) -> None:
        check_choice("backend", backend, BACKENDS)
        self.models = check_models(models)
        #: The AMP options, checked, as the backends read them.
        self.settings = settings_of(opt_level, options)
        self._requested_backend = backend
        self.backend, self._backend_class, self._passed_over = choose_backend(backend, self.settings)
        self.precision = self._backend_class.lightning_precision(self.settings)  # type: ignore[assignment]
        self._built: AmpBackend | None = None
        self._device_type: str | None = None
        self._optimizers = LossOptimizers("self.manual_backward")
        self._model: Module | None = None
        self._skipped: dict[int, bool] = {}
        self._stepping = False

    def __repr__(self) -> str:
        return f"AmpPrecision(backend={self.backend!r}, opt_level={self.opt_level!r})"

    @property
    def opt_level(self) -> OptLevel:
        """apex's optimization level, ``"O0"`` … ``"O3"``."""
        return self.settings.opt_level

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer steps fp32 master copies of half-precision model weights (apex O2).

        apex's ``zero_grad`` then detaches each model gradient in place, which EnvDDPStrategy takes into account.
        """
        return self._backend_class.master_weights(self.settings)

    @property
    def model_dtype(self) -> torch.dtype | None:
        """The dtype the selected modules' weights, and so their gradients, are cast to; None when they stay fp32."""
        return self._backend_class.model_dtype(self.settings)

    @property
    def amp_backend(self) -> AmpBackend:
        """The backend the hooks hand over to (:mod:`~lightning_ddp_amp.amp.backend`): apex's or torch.amp's.

        Built on first use, after the Trainer has told the device (``check_trainer_setup``); a plugin used alone
        guesses it.
        """
        if self._built is None:
            device = self._device_type or ("cuda" if torch.cuda.is_available() else "cpu")
            self._built = self._backend_class.from_settings(self.settings, device)
        return self._built

    def check_trainer_setup(self, strategy: Strategy, accelerator: Accelerator) -> None:
        """Check that the Trainer can run this plugin; called when the Trainer is built.

        ``backend="auto"`` (``precision="amp-O*"``) chooses again, now that the strategy and the device are known:
        apex where apex can run with them, else torch.amp. Its choice is one line on rank 0, printed here, where
        the ranks train (a self-launch's agent never gets this far).

        Raises:
            ApexUnavailableError: ``backend="apex"`` on an accelerator other than CUDA.
            PrecisionConfigurationError: ``backend="apex"`` with a strategy that wraps the model in DDP before the
                precision plugin sees it.
        """
        self._device_type = _device_type(accelerator)
        placement = Placement(
            self._device_type,
            getattr(strategy, "strategy_name", type(strategy).__name__),
            # Asked of the strategy, not of its class: a strategy says that it connects the precision plugin first.
            not isinstance(strategy, SingleDeviceStrategy)
            and not getattr(strategy, "connects_precision_before_wrap", False),
        )
        if self._requested_backend == "auto" and self._built is None:
            self.backend, self._backend_class, self._passed_over = choose_backend("auto", self.settings, placement)
            self.precision = self._backend_class.lightning_precision(self.settings)  # type: ignore[assignment]
        else:
            self._backend_class.check_placement(self.settings, placement)
        if self._passed_over:
            rank_zero_info(
                f"AmpPrecision: {'; '.join(self._passed_over)}, so opt_level {self.opt_level} runs on"
                f" {self._backend_class.describe(self.settings)}"
            )
        # Lightning's model summary knows no "16-mixed" and warns, naming a precision the user never asked for; the fp32
        # bits it then sizes the model in are what O1's weights (and O2's masters) are.
        warnings.filterwarnings(
            "ignore", message=rf"Precision {re.escape(str(self.precision))} is not supported by the model summary"
        )

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        if not optimizers or _trainer_fn(model) not in (None, TrainerFn.FITTING):
            # Evaluation (Lightning still passes the last fit's optimizers): amp.initialize is for training. The model
            # runs as the last fit in this process left it, as the recipe evaluated its amp-initialized model.
            self.amp_backend.evaluate(model)
            return model, optimizers, lr_schedulers
        self._check_half_steps(model, optimizers)
        self._optimizers = LossOptimizers("self.manual_backward")
        self._optimizers.add(optimizers)  # before amp.initialize, which may swap O2's parameters for masters
        self.amp_backend.connect(model, self._selected(model), optimizers)
        self._model = model
        if self.amp_backend.may_skip_steps:
            lr_schedulers = [skip_aware(config, self.step_skipped) for config in lr_schedulers]
        return model, optimizers, lr_schedulers

    def models_wrapped(self) -> None:
        """The connected models are wrapped in DDP (every rank holds rank 0's weights): apex O2 takes them into its
        fp32 masters, as the recipe's first backward after the wrap does; envddp calls this."""
        if self._built is not None:
            self._built.models_wrapped()

    def _check_half_steps(self, model: Module, optimizers: list[Optimizer]) -> None:
        """Refuse an ``eps`` that rounds to 0 where the optimizer steps half-precision weights (:func:`check_half_steps
        <lightning_ddp_amp.amp.settings.check_half_steps>`), when ``fit`` starts: the optimizers do not exist when the
        Trainer is built."""
        if self.master_weights or not isinstance(model, LightningModule):
            return
        where = f"opt_level {self.opt_level}"
        check_half_steps(self.model_dtype, self.amp_modules(model), optimizers, where, 'opt_level="O2"')

    def amp_modules(self, lightning_module: LightningModule) -> list[Module]:
        """The modules handed to ``amp.initialize``: ``models``, ``configure_amp_models()``, or the module itself
        (:func:`~lightning_ddp_amp.trainer.amp_models.amp_modules`).

        Raises:
            PrecisionConfigurationError: a name does not lead to a module, both sources are given, or
                ``configure_amp_models()`` returns something other than modules.
        """
        return amp_modules(lightning_module, self.models)

    def _selected(self, model: Module) -> list[Module]:
        # A model that is not the LightningModule (a DDP wrapper, or a plain module outside a Trainer) is taken whole.
        return self.amp_modules(model) if isinstance(model, LightningModule) else [model]

    @property
    def current_loss_scale(self) -> float | None:
        """The scale the next backward multiplies the loss by (the first loss scaler's); None without loss scaling.

        It costs no device sync: both backends keep it on the host.
        """
        return self.amp_backend.current_loss_scale()

    def step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the last step of ``optimizer`` was skipped because its gradients overflowed."""
        return self._skipped.get(id(optimizer), False)

    @override
    def convert_module(self, module: Module) -> Module:
        self.amp_backend.convert_module(module, self._selected(module))
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        return self.amp_backend.convert_input(data)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with self.amp_backend.forward_context():
            yield

    @override
    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: LightningModule,
        optimizer: Any,
        *args: Any,
        loss_id: int = 0,
        optimizers: Optimizer | Sequence[Optimizer] | None = None,
        delay_unscale: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """Backward on the scaled loss: inside ``amp.scale_loss`` for apex, through the ``GradScaler`` natively.

        Under manual optimization ``manual_backward(loss, loss_id=1, ...)`` passes the keyword arguments here.

        Args:
            tensor: The loss.
            model: The LightningModule.
            optimizer: The optimizer being stepped; None under manual optimization.
            *args: Passed on to ``LightningModule.backward``.
            loss_id: Which loss scaler scales this loss (``num_losses=2`` gives a second loss its own).
            optimizers: The optimizers this loss is scaled for, as the classic ``amp.scale_loss(loss, optimizers)``
                named them. Default: ``optimizer``; under manual optimization the one optimizer whose parameters
                the loss reaches (:mod:`~lightning_ddp_amp.amp.loss_optimizers`).
            delay_unscale: True keeps apex from unscaling (gradient accumulation). Default: unscale only in
                the backward of the micro-batch that steps.
            **kwargs: Passed on to ``LightningModule.backward``.

        Raises:
            PrecisionConfigurationError: ``loss_id`` is not the number of one of the ``num_losses`` scalers, or
                the loss reaches the parameters of several optimizers and ``optimizers`` does not name them.
        """
        self.settings.check_loss_id(loss_id)
        if optimizers is None and optimizer is not None:
            optimizers = optimizer  # automatic optimization: the optimizer being stepped
        chosen = self._optimizers.choose(tensor, optimizers, loss_id)
        if delay_unscale is None:
            # Automatic optimization runs the final micro-batch's backward inside optimizer_step; earlier
            # micro-batches of an accumulation window keep their gradients scaled, as apex recommends.
            delay_unscale = model.automatic_optimization and not self._stepping

        def run_backward(scaled: Tensor) -> None:
            model.backward(scaled, *args, **kwargs)

        self.amp_backend.backward(tensor, chosen, run_backward, loss_id, bool(delay_unscale))

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure here, then ``step()`` without it: apex rejects closures, GradScaler needs it so.

        Without loss scaling (O0, O3, bfloat16) the closure goes to ``step()`` as usual, so LBFGS works there.
        """
        if not self.amp_backend.scales_loss:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise PrecisionConfigurationError(
                "optimizer",
                "LBFGS",
                "LBFGS re-evaluates its closure inside step(), which loss scaling cannot follow",
                'use another optimizer, or a level without loss scaling (opt_level="O0"/"O3", dtype="bfloat16")',
            )
        self._stepping = True
        try:
            closure_result = closure()
        finally:
            self._stepping = False
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: there was no backward, so there is nothing to unscale or step.
            _lightning.after_closure(self, model, optimizer)
            return None
        self.amp_backend.unscale(optimizer)
        _lightning.after_closure(self, model, optimizer)
        result, self._skipped[id(optimizer)] = self.amp_backend.step(optimizer, **kwargs)
        return result

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:  # type: ignore[override]
        return self.amp_backend.main_params(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {"backend": self.backend, "opt_level": self.opt_level, **self.amp_backend.state_dict()}
        if self._built is not None and self.amp_backend.master_weight_pairs():
            # on_save_checkpoint makes apex O2's masters the checkpoint's weights, for whatever precision comes next.
            state["fp32_weights"] = True
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the loss scale(s), and apex O2's fp32 master weights; apex after ``amp.initialize``, as it requires.

        A checkpoint written by the other backend carries over its loss scale, so a run can move between apex
        and native AMP.
        """
        if not {"backend", "loss_scalers"} <= state_dict.keys():
            raise PrecisionConfigurationError(
                "checkpoint",
                sorted(state_dict),
                "its AmpPrecision state lacks 'backend' and 'loss_scalers': it was not written by AmpPrecision",
                "resume from a checkpoint written with AmpPrecision, or start without ckpt_path",
            )
        self.amp_backend.load_state_dict(state_dict)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Write the checkpoint so that a run can go on under any other precision, Lightning's own included.

        * apex O2 trains fp32 masters of fp16 weights; the checkpoint's weights (``state_dict``) become those
          masters, so that ``32-true``, ``16-mixed``, ``bf16-mixed``, ``amp-O*`` or ``load_from_checkpoint`` read
          the weights apex trained, not their fp16 copies (an apex O2 resume still restores its masters exactly).
        * a dynamic loss scale is also written as the GradScaler state Lightning's ``16-mixed`` reads (under
          ``"MixedPrecision"``); AmpPrecision itself reads its own entry.
        """
        state = checkpoint.get(type(self).__qualname__)
        if self._built is None or not isinstance(state, dict):
            return
        if self._model is not None and "state_dict" in checkpoint:
            self.put_fp32_masters(checkpoint["state_dict"], self._model)
        scalers = state.get("loss_scalers") or []
        if state.get("grad_scaler"):  # torch's AMP wrote it itself
            checkpoint.setdefault("MixedPrecision", state["grad_scaler"])
        elif scalers and self.amp_backend.may_skip_steps:
            checkpoint.setdefault("MixedPrecision", grad_scaler_state(scalers[0]))

    def put_fp32_masters(self, state: dict[str, Tensor], module: Module) -> None:
        """Replace, in ``module``'s ``state``, apex O2's fp16 weights by the fp32 masters the optimizer steps
        (:func:`~lightning_ddp_amp.amp.checkpoint_weights.put_fp32_masters`)."""
        put_fp32_masters(state, module, self.amp_backend.master_weight_pairs())

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        message = (
            None
            if self.backend == "apex"
            else describe_crossing(checkpoint, repr(self), self.amp_backend.scales_loss, reads_scale=True)
        )
        if message is not None:
            rank_zero_info(message)
        state = checkpoint.get(type(self).__qualname__)
        if isinstance(state, dict) and state.get("rebuild_masters") and self.amp_backend.master_weight_pairs():
            rank_zero_info(
                f"{self!r}: the checkpoint was converted from a classic apex O2 one, which holds only the fp16"
                " weights: the fp32 master weights are rebuilt from them, as apex's own resume does"
            )

    @override
    def teardown(self) -> None:
        if self._built is not None:
            self._built.teardown()


def resolve_precision_flag(precision: object, plugins: Any) -> tuple[object, Any]:
    """``Trainer(precision="apex-O1")`` / ``"amp-O1"`` / ``"native-O1"`` as an :class:`AmpPrecision` in ``plugins``
    (:func:`~lightning_ddp_amp.precision_strings.resolve_flag`)."""
    return resolve_flag(precision, plugins, AmpPrecision, Precision, _lightning.precision_values())


def _trainer_fn(model: Module) -> TrainerFn | None:
    """What the model's Trainer was asked to run (fit, validate, test, predict); None without a Trainer."""
    try:
        trainer = model.trainer if isinstance(model, LightningModule) else None
    except RuntimeError:  # a LightningModule not attached to a Trainer
        return None
    return None if trainer is None else trainer.state.fn


def _device_type(accelerator: Accelerator) -> str:
    if isinstance(accelerator, CUDAAccelerator):
        return "cuda"
    if isinstance(accelerator, MPSAccelerator):
        return "mps"
    return "cpu"
