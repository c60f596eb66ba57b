"""torch.amp as a backend of :class:`~lightning_ddp_amp.AmpPrecision`: apex's O-levels in native terms.

========  ===================================================  ================================================
level     apex ``amp.initialize``                               native (this module)
========  ===================================================  ================================================
O0        fp32                                                  fp32: no autocast, no loss scaling
O1        torch functions patched to run in fp16 where safe,    ``torch.autocast(dtype)`` + dynamic
          dynamic loss scaling                                  ``GradScaler``: the same idea, done by torch
O2        model in fp16 except batchnorm, fp32 master           autocast + dynamic ``GradScaler``, like O1: the
          weights, dynamic loss scaling                         weights stay fp32 (they are the master weights)
                                                                and batchnorm runs in fp32 under autocast. Not
                                                                identical: activations are cast per operation
                                                                rather than the whole model living in fp16
O3        whole model in fp16, loss scale 1                     the selected modules cast to ``dtype``, their
                                                                floating inputs to ``dtype`` and outputs to
                                                                fp32 (as apex patches their forward); no loss
                                                                scaling. With the LightningModule itself
                                                                selected, the batch is cast instead
                                                                (Lightning's ``"16-true"``)
========  ===================================================  ================================================

``dtype="bfloat16"`` runs the same levels in bfloat16, which needs no loss scaling. On the CPU, autocast and
``GradScaler`` work as on CUDA from torch 2.3 on; with an older torch, float16 on the CPU is an error naming what
this torch lacks (:func:`cpu_fp16_missing`), and CUDA uses ``torch.cuda.amp.GradScaler``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp_amp.amp.backend import AmpBackend, cast_floats
from lightning_ddp_amp.amp.settings import AmpSettings
from lightning_ddp_amp.errors import PrecisionConfigurationError


def describe(opt_level: str, dtype: torch.dtype, loss_scale: float | str | None = None) -> str:
    """What a level means natively, as printed when ``"amp-O*"`` falls back to this backend.

    Args:
        opt_level: The apex level.
        dtype: The autocast dtype.
        loss_scale: ``AmpPrecision(loss_scale=...)``: a number is the fixed scale used; None or ``"dynamic"``, a
            dynamic one.
    """
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    if dtype == torch.bfloat16:
        scaling = "no loss scaling"
    elif loss_scale is None or loss_scale == "dynamic":
        scaling = "dynamic loss scaling"
    else:
        scaling = f"a fixed loss scale of {float(loss_scale):g}"
    return {
        "O0": "fp32, no autocast, no loss scaling",
        "O1": f"torch.autocast({name}) with {scaling}",
        "O2": f"torch.autocast({name}) with {scaling}; weights stay fp32 as O2's master weights",
        "O3": f"the selected modules (or the whole model) cast to {name}, no loss scaling",
    }[opt_level]


# A loss scale the user fixed never grows: GradScaler has no static mode, so growth is pushed out of reach.
_NEVER = 2**31 - 1


def lightning_precision(opt_level: str, dtype: torch.dtype) -> str:
    """The Lightning precision label for a level (what ``trainer.precision`` reports)."""
    prefix = "bf16" if dtype == torch.bfloat16 else "16"
    return {"O0": "32-true", "O1": f"{prefix}-mixed", "O2": f"{prefix}-mixed", "O3": f"{prefix}-true"}[opt_level]


@functools.cache
def cpu_fp16_missing() -> tuple[str, ...]:
    """What this torch lacks to train in float16 on the CPU; empty when it has it all (torch 2.3 and later).

    A probe, not a version check: it runs an fp16 linear, conv2d and bmm, a linear under
    ``torch.autocast("cpu", dtype=torch.float16)``, and scales a tensor with ``torch.amp.GradScaler("cpu")``.
    """
    half = torch.float16

    def autocast_linear() -> Tensor:
        # torch 2.1 warns and disables CPU autocast for float16 instead of raising: the dtype tells.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast("cpu", dtype=half):
                return torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2))

    def ones(*shape: int) -> Tensor:
        return torch.ones(*shape, dtype=half)

    probes: dict[str, tuple[Callable[[], Tensor], torch.dtype]] = {
        "fp16 linear": (lambda: torch.nn.functional.linear(ones(2, 2), ones(2, 2)), half),
        "fp16 conv2d": (lambda: torch.nn.functional.conv2d(ones(1, 1, 3, 3), ones(1, 1, 2, 2)), half),
        "fp16 bmm": (lambda: torch.bmm(ones(1, 2, 2), ones(1, 2, 2)), half),
        'torch.autocast("cpu", dtype=torch.float16)': (autocast_linear, half),
        'torch.amp.GradScaler("cpu")': (lambda: torch.amp.GradScaler("cpu").scale(torch.ones(1)), torch.float32),
    }
    missing = []
    for name, (probe, dtype) in probes.items():
        try:
            works = probe().dtype == dtype
        except Exception:  # whatever this torch raises for an operation it lacks
            works = False
        if not works:
            missing.append(name)
    return tuple(missing)


def torch_gaps() -> list[str]:
    """What this torch lacks that the native backend would use, and what it does instead; empty on torch >= 2.3."""
    gaps = []
    if not hasattr(torch.amp, "GradScaler"):
        gaps.append(f"torch {torch.__version__} has no torch.amp.GradScaler, so CUDA uses torch.cuda.amp.GradScaler")
    if cpu_fp16_missing():
        gaps.append(
            f"torch {torch.__version__} lacks {', '.join(cpu_fp16_missing())}, so native float16 AMP runs on CUDA"
            " only (bfloat16 and fp32 run on the CPU)"
        )
    return gaps


def _grad_scaler(device_type: str, **options: Any) -> Any:
    """``torch.amp.GradScaler``, or on CUDA before torch 2.3 (which lacks it) ``torch.cuda.amp.GradScaler``."""
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device_type, **options)
    return torch.cuda.amp.GradScaler(**options)


class NativeAmp(AmpBackend):
    """The torch.amp calls :class:`~lightning_ddp_amp.AmpPrecision` makes.

    Args:
        opt_level: ``"O0"`` … ``"O3"``.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        device_type: Where autocast and the scaler run: ``"cuda"``, ``"cpu"``, ...
        loss_scale: ``"dynamic"``, a fixed scale, or None for the level's default.
        min_loss_scale: Floor of the scale, or None.
        max_loss_scale: Ceiling of the scale.
        cast_model_outputs: dtype for the selected modules' floating outputs, or None for the level's default.
    """

    def __init__(
        self,
        opt_level: str,
        dtype: torch.dtype,
        device_type: str,
        loss_scale: float | str | None,
        min_loss_scale: float | None,
        max_loss_scale: float,
        cast_model_outputs: torch.dtype | None = None,
    ) -> None:
        self.dtype = dtype
        self.device_type = device_type
        self.autocast = opt_level in ("O1", "O2")
        self.cast_model = opt_level == "O3"
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.scaler: torch.amp.GradScaler | None = None
        self._scale = 0.0  # the scale after the last step, to tell a skipped step from the next one
        self.cast_batch = False
        self.cast_model_outputs = cast_model_outputs
        self._hooks: list[Any] = []
        if device_type == "cpu" and dtype == torch.float16 and opt_level != "O0" and cpu_fp16_missing():
            raise PrecisionConfigurationError(
                "dtype",
                "float16",
                f"torch {torch.__version__} cannot train in float16 on the CPU: it lacks {', '.join(cpu_fp16_missing())}",
                'use dtype="bfloat16" (precision="bf16-mixed") on the CPU, train on CUDA, or install torch>=2.3',
            )
        if self.autocast and dtype == torch.float16:
            if loss_scale is None or loss_scale == "dynamic":
                self.scaler = _grad_scaler(device_type, init_scale=min(max_loss_scale, 2.0**16))
            else:
                # A fixed scale: it never grows, and an overflowing step is skipped and the scale restored.
                self.min_loss_scale = float(loss_scale)
                self.scaler = _grad_scaler(device_type, init_scale=float(loss_scale), growth_interval=_NEVER)
            self._scale = self.scaler.get_scale()

    @classmethod
    @override
    def unavailable(cls, settings: AmpSettings) -> str | None:
        return None

    @classmethod
    @override
    def check_settings(cls, settings: AmpSettings, requested: str) -> None:
        level, bf16 = settings.opt_level, settings.torch_dtype == torch.bfloat16
        if settings.loss_scale is not None and (level == "O3" or bf16):
            reason = "bfloat16 needs no loss scaling" if bf16 else "native O3 (pure half precision) has no loss scaler"
            raise PrecisionConfigurationError(
                "loss_scale", settings.loss_scale, f"{reason} on the native backend", "leave loss_scale unset"
            )
        if level == "O2" and settings.keep_batchnorm_fp32 is False:
            raise PrecisionConfigurationError(
                "keep_batchnorm_fp32",
                False,
                "native O2 (autocast) always runs batchnorm in fp32",
                'leave it unset, or use opt_level="O3" for a model entirely in half precision',
            )
        if level == "O3" and settings.keep_batchnorm_fp32:
            raise PrecisionConfigurationError(
                "keep_batchnorm_fp32",
                True,
                "native O3 casts the whole model, batchnorm included",
                'use opt_level="O2" (autocast keeps batchnorm in fp32), or backend="apex"',
            )

    @classmethod
    @override
    def lightning_precision(cls, settings: AmpSettings) -> str:
        return lightning_precision(settings.opt_level, settings.torch_dtype)

    @classmethod
    @override
    def describe(cls, settings: AmpSettings) -> str:
        return "torch.amp: " + describe(settings.opt_level, settings.torch_dtype, settings.loss_scale)

    @classmethod
    @override
    def from_settings(cls, settings: AmpSettings, device_type: str) -> NativeAmp:
        return cls(
            settings.opt_level,
            settings.torch_dtype,
            device_type,
            settings.loss_scale,
            settings.min_loss_scale,
            settings.max_loss_scale,
            settings.output_dtype,
        )

    @classmethod
    @override
    def master_weights(cls, settings: AmpSettings) -> bool:
        # The model's weights stay fp32 (they are the master weights), or under O3 the optimizer steps them cast.
        return False

    @classmethod
    @override
    def model_dtype(cls, settings: AmpSettings) -> torch.dtype | None:
        return settings.torch_dtype if settings.opt_level == "O3" else None

    @property
    @override
    def scales_loss(self) -> bool:
        return self.scaler is not None

    @property
    @override
    def may_skip_steps(self) -> bool:
        return self.scaler is not None

    @override
    def convert_module(self, module: Module, selected: list[Module]) -> None:
        """Cast the selected modules here, where apex would cast them in ``amp.initialize``."""
        self.prepare(module, selected)

    def prepare(self, root: Module, selected: list[Module]) -> None:
        """Cast the selected modules (O3) and their inputs and outputs, as ``amp.initialize`` patches them.

        Args:
            root: The model the precision plugin was given (the LightningModule).
            selected: The modules handed to ``amp.initialize`` (``root`` itself by default).
        """
        self.release()
        output_dtype = self.cast_model_outputs or (torch.float32 if self.cast_model else None)
        for module in selected:
            if self.cast_model:
                module.to(dtype=self.dtype)
            if module is root:
                # Lightning calls training_step, not forward: cast the batch instead of the inputs.
                self.cast_batch = self.cast_model
                continue
            if self.cast_model:
                self._hooks.append(module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))
            if output_dtype is not None:
                self._hooks.append(module.register_forward_hook(_cast_outputs(output_dtype)))

    @override
    def teardown(self) -> None:
        self.release()

    def release(self) -> None:
        """Remove the hooks :meth:`prepare` registered."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _cast_inputs(self, module: Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return cast_floats(args, self.dtype), cast_floats(kwargs, self.dtype)

    @override
    def convert_input(self, data: Any) -> Any:
        """The batch, cast to the half dtype when O3 selected the LightningModule itself."""
        return cast_floats(data, self.dtype) if self.cast_batch else data

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """``torch.autocast`` for O1/O2; nothing for O0 and O3."""
        if not self.autocast:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    @override
    def backward(
        self,
        loss: Tensor,
        optimizers: Sequence[Optimizer],
        run_backward: Callable[[Tensor], None],
        loss_id: int,
        delay_unscale: bool,
    ) -> None:
        """Run ``run_backward`` on the loss, scaled by the ``GradScaler`` when there is one.

        One scaler serves every loss and optimizer, and ``GradScaler`` unscales only in :meth:`unscale`.
        """
        run_backward(self.scaler.scale(loss) if self.scaler is not None else loss)

    @override
    def unscale(self, optimizer: Optimizer) -> None:
        """Unscale the gradients before hooks and clipping see them."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    @override
    def step(self, optimizer: Optimizer, **kwargs: Any) -> tuple[Any, bool]:
        """Step through the scaler, which skips a step whose gradients overflowed.

        Returns:
            The optimizer's return value and whether the step was skipped.
        """
        if self.scaler is None:
            return optimizer.step(**kwargs), False
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        # The scaler backs off exactly when it skipped the step. Reading the scale costs a device sync on CUDA:
        # once per step, compared with the value remembered from the step before.
        scale = self.scaler.get_scale()
        skipped = scale < self._scale
        self._scale = self._clamp(scale)
        return result, skipped

    def _clamp(self, scale: float) -> float:
        assert self.scaler is not None
        if self.min_loss_scale is not None and scale < self.min_loss_scale:
            scale = self.min_loss_scale
        elif scale > self.max_loss_scale:
            scale = self.max_loss_scale
        else:
            return scale
        self.scaler.update(new_scale=scale)
        return scale

    @override
    def current_loss_scale(self) -> float | None:
        return self._scale if self.scaler is not None else None

    def loss_scalers(self) -> list[dict[str, float]]:
        """The scaler's state in apex's terms (``loss_scale``, ``unskipped``), to move between backends."""
        if self.scaler is None:
            return []
        state = self.scaler.state_dict()
        return [{"loss_scale": float(state["scale"]), "unskipped": int(state["_growth_tracker"])}]

    def load_loss_scalers(self, scalers: list[dict[str, float]]) -> None:
        """Take the loss scale of a checkpoint written by the apex backend."""
        if self.scaler is None or not scalers:
            return
        state = self.scaler.state_dict()
        state.update(scale=float(scalers[0]["loss_scale"]), _growth_tracker=int(scalers[0]["unskipped"]))
        self._load_grad_scaler(state)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The loss scale in apex's terms, to move between backends, and the ``GradScaler``'s own state."""
        return {
            "loss_scalers": self.loss_scalers(),
            "grad_scaler": self.scaler.state_dict() if self.scaler is not None else {},
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the ``GradScaler``; from a checkpoint of the apex backend, its first loss scale."""
        if state["backend"] == "native" and state.get("grad_scaler"):
            self._load_grad_scaler(state["grad_scaler"])
        else:
            self.load_loss_scalers(state["loss_scalers"])

    def _load_grad_scaler(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
            self._scale = self.scaler.get_scale()


def _cast_outputs(dtype: torch.dtype) -> Callable[[Module, Any, Any], Any]:
    def hook(module: Module, inputs: Any, output: Any) -> Any:
        return cast_floats(output, dtype)

    return hook
