"""AmpPrecision: apex amp and native torch AMP in one Lightning precision plugin.

``Trainer(strategy="envddp", precision="apex-O1")`` gives the apex recipe::

    model, optimizer = amp.initialize([model_a, model_b], optimizer, opt_level="O1")  # before DDP
    model = DDP(model)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

``precision="amp-O1"`` does the same with apex when it is importable and with torch.amp otherwise; the table in
:mod:`lightning_ddp_amp.native_amp` says what each level means natively.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_ddp_amp.apex_amp import ApexAmp, find_amp, load_apex_module, supports_device
from lightning_ddp_amp.errors import ApexUnavailableError, PrecisionConfigurationError
from lightning_ddp_amp.native_amp import NativeAmp, cast_floats, describe, lightning_precision
from lightning_ddp_amp.strategy import EnvDDPStrategy

OPT_LEVELS = ("O0", "O1", "O2", "O3")
BACKENDS = ("auto", "apex", "native")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}

#: The precision strings this package adds to ``Trainer(precision=...)``.
PRECISION_FLAG = re.compile(r"^(apex|amp)-(O[0-3])$")


class AmpPrecision(Precision):
    """Mixed precision with NVIDIA apex amp or native torch AMP, in the apex recipe's order.

    Args:
        opt_level: apex's optimization level, ``"O0"`` … ``"O3"``.
        backend: ``"apex"`` (NVIDIA apex required), ``"native"`` (torch.amp) or ``"auto"`` (apex when it can be
            imported, else native).
        models: Attribute names (dotted paths allowed) of the LightningModule's sub-modules to hand to
            ``amp.initialize``, e.g. ``["model_a", "model_b"]``. The LightningModule can instead define
            ``configure_amp_models()`` returning the modules. Default: the LightningModule itself.
        keep_batchnorm_fp32: As in ``amp.initialize`` (O2 / O3 only).
        loss_scale: ``"dynamic"`` or a fixed scale; default: the level's (dynamic for O1 / O2).
        num_losses: Number of losses with their own loss scale; pass ``loss_id`` to ``manual_backward``.
        min_loss_scale: Floor of a dynamic loss scale.
        max_loss_scale: Ceiling of a dynamic loss scale.
        cast_model_outputs: dtype the selected modules' floating outputs are cast to, e.g. ``"float32"``.
        dtype: Native backend only: ``"float16"`` or ``"bfloat16"`` (no loss scaling).

    Raises:
        PrecisionConfigurationError: An argument is invalid or the combination cannot run.
        ApexUnavailableError: ``backend="apex"`` and apex amp cannot be imported.
    """

    def __init__(
        self,
        opt_level: Literal["O0", "O1", "O2", "O3"] = "O1",
        backend: Literal["auto", "apex", "native"] = "auto",
        models: Sequence[str] | None = None,
        keep_batchnorm_fp32: bool | None = None,
        loss_scale: float | Literal["dynamic"] | None = None,
        num_losses: int = 1,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
        cast_model_outputs: str | torch.dtype | None = None,
        dtype: Literal["float16", "bfloat16"] = "float16",
    ) -> None:
        _check_choice("opt_level", opt_level, OPT_LEVELS)
        _check_choice("backend", backend, BACKENDS)
        _check_choice("dtype", dtype, tuple(DTYPES))
        self.opt_level = opt_level
        self.models = _check_models(models)
        self.keep_batchnorm_fp32 = keep_batchnorm_fp32
        self.loss_scale = _check_loss_scale(loss_scale)
        self.num_losses = _check_positive_int("num_losses", num_losses)
        self.min_loss_scale, self.max_loss_scale = _check_scale_bounds(min_loss_scale, max_loss_scale)
        self.cast_model_outputs = _to_dtype("cast_model_outputs", cast_model_outputs)
        self.dtype = DTYPES[dtype]
        if keep_batchnorm_fp32 is not None and opt_level in ("O0", "O1"):
            raise PrecisionConfigurationError(
                "keep_batchnorm_fp32",
                keep_batchnorm_fp32,
                f"it only applies to opt_level O2 and O3 (opt_level={opt_level!r} keeps batchnorm in fp32 anyway)",
                "leave keep_batchnorm_fp32 unset",
            )
        self.backend = self._resolve_backend(backend)
        self._apex: ApexAmp | None = None
        self._native: NativeAmp | None = None
        self._device_type: str | None = None
        if self.backend == "apex":
            amp = load_apex_module("apex.amp", "backend", backend)
            self._apex = ApexAmp(amp, opt_level, self._apex_options())
            self.precision = {"O0": "32-true", "O3": "16-true"}.get(opt_level, "16-mixed")  # type: ignore[assignment]
        else:
            self._check_native()
            self.precision = lightning_precision(opt_level, self.dtype)  # type: ignore[assignment]
            if backend == "auto":
                reason = "apex amp has no bfloat16" if dtype == "bfloat16" else "NVIDIA apex amp is not importable"
                rank_zero_info(
                    f"AmpPrecision: {reason}, so opt_level {opt_level} runs on torch.amp: {describe(opt_level, self.dtype)}"
                )
        self._optimizers: list[Optimizer] = []
        self._skipped: dict[int, bool] = {}
        self._stepping = False
        self._cast_batch_for_apex = False

    def __repr__(self) -> str:
        return f"AmpPrecision(backend={self.backend!r}, opt_level={self.opt_level!r})"

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer steps fp32 master copies of half-precision model weights (apex O2).

        apex's ``zero_grad`` then detaches each model gradient in place, which EnvDDPStrategy takes into account.
        """
        return self._apex is not None and self._apex.keeps_master_weights

    @property
    def model_dtype(self) -> torch.dtype | None:
        """The dtype the selected modules' weights, and so their gradients, are cast to; None when they stay fp32."""
        if self._apex is not None:
            return torch.float16 if self.opt_level in ("O2", "O3") else None
        return self.dtype if self.opt_level == "O3" else None

    def _resolve_backend(self, backend: str) -> str:
        if backend != "auto":
            return backend
        # apex computes in float16 only, so bfloat16 always runs natively.
        if self.dtype == torch.bfloat16 or find_amp() is None:
            return "native"
        return "apex"

    def _apex_options(self) -> dict[str, Any]:
        if self.dtype != torch.float16:
            raise PrecisionConfigurationError(
                "dtype", "bfloat16", "apex amp computes in float16 only", 'use backend="native" for bfloat16'
            )
        options = {
            "keep_batchnorm_fp32": self.keep_batchnorm_fp32,
            "loss_scale": self.loss_scale,
            "num_losses": self.num_losses,
            "min_loss_scale": self.min_loss_scale,
            "max_loss_scale": self.max_loss_scale,
            "cast_model_outputs": self.cast_model_outputs,
        }
        return {name: value for name, value in options.items() if value is not None}

    def _check_native(self) -> None:
        level, bf16 = self.opt_level, self.dtype == torch.bfloat16
        if self.loss_scale is not None and (level == "O3" or bf16):
            reason = "bfloat16 needs no loss scaling" if bf16 else "native O3 (pure half precision) has no loss scaler"
            raise PrecisionConfigurationError(
                "loss_scale", self.loss_scale, f"{reason} on the native backend", "leave loss_scale unset"
            )
        if level == "O2" and self.keep_batchnorm_fp32 is False:
            raise PrecisionConfigurationError(
                "keep_batchnorm_fp32",
                False,
                "native O2 (autocast) always runs batchnorm in fp32",
                'leave it unset, or use opt_level="O3" for a model entirely in half precision',
            )
        if level == "O3" and self.keep_batchnorm_fp32:
            raise PrecisionConfigurationError(
                "keep_batchnorm_fp32",
                True,
                "native O3 casts the whole model, batchnorm included",
                'use opt_level="O2" (autocast keeps batchnorm in fp32), or backend="apex"',
            )

    @property
    def native(self) -> NativeAmp:
        """The torch.amp backend, built once the device is known (when the Trainer is built)."""
        if self._native is None:
            device = self._device_type or ("cuda" if torch.cuda.is_available() else "cpu")
            self._native = NativeAmp(
                self.opt_level, self.dtype, device, self.loss_scale, self.min_loss_scale, self.max_loss_scale
            )
        return self._native

    def check_trainer_setup(self, strategy: Strategy, accelerator: Accelerator) -> None:
        """Check that the Trainer can run this plugin; called when the Trainer is built.

        Raises:
            ApexUnavailableError: apex amp on an accelerator other than CUDA.
            PrecisionConfigurationError: apex amp with a strategy that wraps the model in DDP before the
                precision plugin sees it.
        """
        self._device_type = _device_type(accelerator)
        if self._apex is None:
            return
        if not supports_device(self._apex.amp, self._device_type):
            raise ApexUnavailableError(
                "accelerator",
                self._device_type,
                "apex amp needs CUDA: its loss scaler and kernels run on the GPU",
                'train on a GPU (accelerator="cuda"), or use the native backend (precision="amp-O1", which runs'
                " on the CPU too)",
            )
        if not isinstance(strategy, (EnvDDPStrategy, SingleDeviceStrategy)):
            raise PrecisionConfigurationError(
                "strategy",
                getattr(strategy, "strategy_name", type(strategy).__name__),
                "this strategy wraps the model in DistributedDataParallel before the precision plugin sees it, but"
                " apex requires amp.initialize before the wrap",
                'use strategy="envddp", which calls amp.initialize first, as the recipe did',
            )

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        if not optimizers:
            # Evaluation only: apex is initialized for training; the model runs as the last fit left it.
            return model, optimizers, lr_schedulers
        if self._apex is not None:
            if not isinstance(model, LightningModule):
                raise PrecisionConfigurationError(
                    "strategy",
                    type(model).__name__,
                    "the model reached the precision plugin already wrapped; amp.initialize must come before the"
                    " DDP wrap",
                    'use strategy="envddp"',
                )
            selected = self.amp_modules(model)
            self._apex.initialize(selected, optimizers)
            # apex O2/O3 patch the forward of the modules they cast; Lightning calls training_step, not the
            # LightningModule's forward, so when the module itself is selected the batch is cast here instead.
            self._cast_batch_for_apex = selected == [model] and self.opt_level in ("O2", "O3")
        self._optimizers = list(optimizers)
        if self._may_skip_steps:
            lr_schedulers = [self._skip_aware(config) for config in lr_schedulers]
        return model, optimizers, lr_schedulers

    def amp_modules(self, lightning_module: LightningModule) -> list[Module]:
        """The modules handed to ``amp.initialize``: ``models``, ``configure_amp_models()``, or the module itself.

        Raises:
            PrecisionConfigurationError: a name does not lead to a module, both sources are given, or
                ``configure_amp_models()`` returns something other than modules.
        """
        configure = getattr(lightning_module, "configure_amp_models", None)
        if self.models is not None:
            if configure is not None:
                raise PrecisionConfigurationError(
                    "models",
                    list(self.models),
                    f"{type(lightning_module).__name__} also defines configure_amp_models()",
                    "choose one: drop AmpPrecision(models=...) or the configure_amp_models() method",
                )
            return [_submodule(lightning_module, name) for name in self.models]
        if configure is None:
            return [lightning_module]
        returned = configure()
        modules = [returned] if isinstance(returned, Module) else list(returned)
        if not modules or not all(isinstance(m, Module) for m in modules):
            raise PrecisionConfigurationError(
                "configure_amp_models()",
                [type(m).__name__ for m in modules],
                "it must return a non-empty sequence of torch.nn.Module",
                "return the sub-modules whose forward you call, e.g. [self.model_a, self.model_b]",
            )
        return modules

    @property
    def _scales_loss(self) -> bool:
        return self._apex is not None or self.native.scaler is not None

    @property
    def _may_skip_steps(self) -> bool:
        """Whether a dynamic loss scaler can skip a step on overflow."""
        if self._apex is None:
            return self.native.scaler is not None
        return self.loss_scale == "dynamic" or (self.loss_scale is None and self.opt_level in ("O1", "O2"))

    def _skip_aware(self, config: LRSchedulerConfig) -> LRSchedulerConfig:
        if config.interval != "step" or not hasattr(config.scheduler, "optimizer"):
            return config
        guarded = SkipAwareScheduler(config.scheduler, self.step_skipped)
        return dataclasses.replace(config, scheduler=guarded)  # type: ignore[arg-type]

    def step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the last step of ``optimizer`` was skipped because its gradients overflowed."""
        return self._skipped.get(id(optimizer), False)

    @override
    def convert_module(self, module: Module) -> Module:
        # apex casts in amp.initialize; natively the selected modules are cast here, as apex would cast them.
        if self._apex is None:
            selected = self.amp_modules(module) if isinstance(module, LightningModule) else [module]
            self.native.prepare(module, selected, self.cast_model_outputs)
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        if self._apex is None:
            return self.native.convert_input(data)
        return cast_floats(data, torch.float16) if self._cast_batch_for_apex else data

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        context = self._apex.forward_context() if self._apex is not None else self.native.forward_context()
        with context:
            yield

    @override
    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Backward on the scaled loss: inside ``amp.scale_loss`` for apex, through the ``GradScaler`` natively.

        Under manual optimization, ``manual_backward(loss, loss_id=1)`` picks the loss scaler of a second loss
        (``num_losses=2``), ``optimizers=[opt_g]`` names the optimizers whose parameters this loss reaches (default:
        all), and ``delay_unscale=True`` keeps apex from unscaling (gradient accumulation).
        """
        loss_id = kwargs.pop("loss_id", 0)
        delay_unscale = kwargs.pop("delay_unscale", None)
        chosen = kwargs.pop("optimizers", None)
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < self.num_losses:
            raise PrecisionConfigurationError(
                "loss_id",
                loss_id,
                f"AmpPrecision has num_losses={self.num_losses} loss scaler(s), numbered from 0",
                "use a smaller loss_id, or raise AmpPrecision(num_losses=...)",
            )

        def run_backward(scaled: Tensor) -> None:
            model.backward(scaled, *args, **kwargs)

        if self._apex is None:
            self.native.backward(tensor, run_backward)
            return
        if chosen is not None:
            optimizers = [chosen] if not isinstance(chosen, (list, tuple)) else list(chosen)
        else:
            optimizers = [optimizer] if optimizer is not None else self._optimizers
        # A LightningOptimizer wraps the torch optimizer that went through amp.initialize.
        optimizers = [getattr(o, "optimizer", o) for o in optimizers]
        if delay_unscale is None:
            # Automatic optimization runs the final micro-batch's backward inside optimizer_step; earlier
            # micro-batches of an accumulation window keep their gradients scaled, as apex recommends.
            delay_unscale = model.automatic_optimization and not self._stepping
        self._apex.backward(tensor, optimizers, run_backward, loss_id, bool(delay_unscale))

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
        if not self._scales_loss:
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
            self._after_closure(model, optimizer)
            return None
        if self._apex is None:
            self.native.unscale(optimizer)
        self._after_closure(model, optimizer)
        if self._apex is not None:
            # After an overflow apex has replaced step() with a skip for this one call.
            self._skipped[id(optimizer)] = self._apex.step_will_be_skipped(optimizer)
            return optimizer.step(**kwargs)
        result, skipped = self.native.step(optimizer, **kwargs)
        self._skipped[id(optimizer)] = skipped
        return result

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:  # type: ignore[override]
        if self._apex is not None:
            return self._apex.main_params(optimizer)
        return super().main_params(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        backend = self._apex if self._apex is not None else self.native
        state: dict[str, Any] = {
            "backend": self.backend,
            "opt_level": self.opt_level,
            "loss_scalers": backend.loss_scalers(),
        }
        if self._apex is None:
            state["grad_scaler"] = self.native.state_dict()
        elif self.master_weights:
            state["master_weights"] = self._apex.master_weights()
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
        if self._apex is not None:
            self._apex.load_loss_scalers(state_dict["loss_scalers"])
            if "master_weights" in state_dict:
                self._apex.load_master_weights(state_dict["master_weights"])
        elif state_dict["backend"] == "native" and state_dict.get("grad_scaler"):
            self.native.load_state_dict(state_dict["grad_scaler"])
        else:
            self.native.load_loss_scalers(state_dict["loss_scalers"])

    @override
    def teardown(self) -> None:
        if self._native is not None:
            self._native.release()


class SkipAwareScheduler:
    """A step-interval LR scheduler that stands still when its optimizer's step was skipped on overflow.

    Lightning steps schedulers after every training step; a step the loss scaler skipped did not happen, so
    the recipe's ``if not skipped: scheduler.step()`` is applied here. Everything else is the wrapped scheduler.

    Args:
        scheduler: The user's scheduler.
        skipped: Tells whether the last step of an optimizer was skipped.
    """

    _OWN = ("scheduler", "_skipped")

    def __init__(self, scheduler: Any, skipped: Callable[[Optimizer], bool]) -> None:
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "_skipped", skipped)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped scheduler's ``step``, unless the optimizer step it follows was skipped on overflow."""
        if self._skipped(self.scheduler.optimizer):
            return None
        return self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in self._OWN or name.startswith("__"):
            raise AttributeError(name)  # not set up yet (copy, pickle): do not recurse into the scheduler
        return getattr(self.scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.scheduler, name, value)


def resolve_precision_flag(precision: object, plugins: Any) -> tuple[object, Any]:
    """Turn ``Trainer(precision="apex-O1")`` / ``"amp-O1"`` into an :class:`AmpPrecision` in ``plugins``.

    Any other value, valid for Lightning or not, is returned unchanged for Lightning to judge.

    Returns:
        The ``precision`` and ``plugins`` arguments to give Lightning.

    Raises:
        PrecisionConfigurationError: ``plugins`` already holds a precision plugin.
        ApexUnavailableError: ``"apex-O*"`` and apex amp cannot be imported.
    """
    match = PRECISION_FLAG.match(precision) if isinstance(precision, str) else None
    if match is None:
        return precision, plugins
    given = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    for plugin in given:
        if isinstance(plugin, Precision):
            raise PrecisionConfigurationError(
                "precision",
                precision,
                f"plugins also holds a precision plugin ({type(plugin).__name__})",
                "choose one: drop precision=... or the precision plugin from plugins",
            )
    family, level = match.groups()
    try:
        plugin = AmpPrecision(opt_level=level, backend="apex" if family == "apex" else "auto")  # type: ignore[arg-type]
    except ApexUnavailableError as error:
        raise ApexUnavailableError("precision", precision, error.problem, error.fix) from None
    return None, [*given, plugin]


def _device_type(accelerator: Accelerator) -> str:
    if isinstance(accelerator, CUDAAccelerator):
        return "cuda"
    if isinstance(accelerator, MPSAccelerator):
        return "mps"
    return "cpu"


def _submodule(root: Module, name: str) -> Module:
    try:
        module = root.get_submodule(name)
    except AttributeError:
        children = ", ".join(n for n, _ in root.named_children()) or "none"
        raise PrecisionConfigurationError(
            "models",
            name,
            f"{type(root).__name__} has no sub-module of that name (its children: {children})",
            "name attributes of the LightningModule that hold torch.nn.Module, e.g. models=['model_a']",
        ) from None
    return module


def _check_choice(field: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise PrecisionConfigurationError(
            field, value, f"it must be one of {', '.join(repr(c) for c in choices)}", "use one of those values"
        )


def _check_models(models: Sequence[str] | None) -> tuple[str, ...] | None:
    if models is None:
        return None
    if isinstance(models, str) or not all(isinstance(m, str) and m for m in models) or not models:
        raise PrecisionConfigurationError(
            "models", models, "it must be a non-empty list of attribute names", "e.g. models=['model_a', 'model_b']"
        )
    return tuple(models)


def _check_loss_scale(loss_scale: float | str | None) -> float | str | None:
    if loss_scale is None or loss_scale == "dynamic":
        return loss_scale
    try:
        value = float(loss_scale)
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise PrecisionConfigurationError(
            "loss_scale", loss_scale, 'it must be "dynamic" or a positive number', 'e.g. loss_scale="dynamic" or 128.0'
        )
    return value


def _check_positive_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PrecisionConfigurationError(field, value, "it must be a whole number of at least 1", f"e.g. {field}=1")
    return value


def _check_scale_bounds(low: float | None, high: float) -> tuple[float | None, float]:
    if low is not None and not low > 0:
        raise PrecisionConfigurationError("min_loss_scale", low, "it must be positive", "e.g. min_loss_scale=1.0")
    if not high > 0:
        raise PrecisionConfigurationError("max_loss_scale", high, "it must be positive", "e.g. max_loss_scale=2**24")
    if low is not None and low > high:
        raise PrecisionConfigurationError(
            "min_loss_scale", low, f"it is above max_loss_scale={high}", "make min_loss_scale ≤ max_loss_scale"
        )
    return low, high


def _to_dtype(field: str, value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise PrecisionConfigurationError(field, value, "it is not a torch dtype", 'e.g. "float32" or torch.float32')
    return dtype
