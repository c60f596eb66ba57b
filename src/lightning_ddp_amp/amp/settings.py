"""AmpPrecision's arguments, checked once, as every AMP backend reads them.

Each check raises :class:`~lightning_ddp_amp.errors.PrecisionConfigurationError` naming the argument, its value and
the fix. Nothing here knows Lightning: the Trainer's precision plugin and a Fabric one check the same arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lightning_ddp_amp.errors import PrecisionConfigurationError, whole_number
from lightning_ddp_amp.precision_strings import OPT_LEVELS

#: ``AmpPrecision(dtype=...)``: the half-precision dtypes of the native backend.
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class AmpSettings:
    """AmpPrecision's validated arguments, as every backend reads them (see :class:`~lightning_ddp_amp.AmpPrecision`)."""

    opt_level: str
    dtype: torch.dtype
    keep_batchnorm_fp32: bool | None
    loss_scale: float | str | None
    num_losses: int
    min_loss_scale: float | None
    max_loss_scale: float
    cast_model_outputs: torch.dtype | None

    def check_loss_id(self, loss_id: object) -> None:
        """Refuse a ``loss_id`` that names none of the ``num_losses`` loss scalers.

        Raises:
            PrecisionConfigurationError: ``loss_id`` is not a whole number below ``num_losses``.
        """
        whole_number(
            PrecisionConfigurationError,
            "loss_id",
            loss_id,
            f"AmpPrecision has num_losses={self.num_losses} loss scaler(s), numbered from 0",
            "use a smaller loss_id, or raise AmpPrecision(num_losses=...)",
            minimum=0,
            below=self.num_losses,
        )

    @classmethod
    def checked(
        cls,
        opt_level: object,
        dtype: object,
        keep_batchnorm_fp32: bool | None,
        loss_scale: float | str | None,
        num_losses: object,
        min_loss_scale: float | None,
        max_loss_scale: float,
        cast_model_outputs: str | torch.dtype | None,
    ) -> AmpSettings:
        """The settings, once each argument is checked (``AmpPrecision``'s arguments of the same names).

        Raises:
            PrecisionConfigurationError: An argument is invalid, or two of them contradict each other.
        """
        check_choice("opt_level", opt_level, OPT_LEVELS)
        check_choice("dtype", dtype, tuple(DTYPES))
        assert isinstance(opt_level, str) and isinstance(dtype, str)
        if keep_batchnorm_fp32 is not None and opt_level in ("O0", "O1"):
            raise PrecisionConfigurationError(
                "keep_batchnorm_fp32",
                keep_batchnorm_fp32,
                f"it only applies to opt_level O2 and O3 (opt_level={opt_level!r} keeps batchnorm in fp32 anyway)",
                "leave keep_batchnorm_fp32 unset",
            )
        losses = whole_number(
            PrecisionConfigurationError,
            "num_losses",
            num_losses,
            "it must be a whole number of at least 1",
            "e.g. num_losses=1",
            minimum=1,
        )
        return cls(
            opt_level,
            DTYPES[dtype],
            keep_batchnorm_fp32,
            _loss_scale(loss_scale),
            losses,
            *_scale_bounds(min_loss_scale, max_loss_scale),
            _to_dtype("cast_model_outputs", cast_model_outputs),
        )


def check_choice(field: str, value: object, choices: Sequence[str]) -> None:
    """Refuse a ``value`` of ``field`` that is not one of ``choices``.

    Raises:
        PrecisionConfigurationError: ``value`` is not among ``choices``.
    """
    if value not in choices:
        raise PrecisionConfigurationError(
            field, value, f"it must be one of {', '.join(repr(c) for c in choices)}", "use one of those values"
        )


def check_models(models: Sequence[str] | None) -> tuple[str, ...] | None:
    """``AmpPrecision(models=...)``: the attribute names of the sub-modules amp acts on, or None for the module.

    Raises:
        PrecisionConfigurationError: ``models`` is not a non-empty list of names.
    """
    if models is None:
        return None
    if isinstance(models, str) or not all(isinstance(m, str) and m for m in models) or not models:
        raise PrecisionConfigurationError(
            "models", models, "it must be a non-empty list of attribute names", "e.g. models=['model_a', 'model_b']"
        )
    return tuple(models)


def _loss_scale(loss_scale: float | str | None) -> float | str | None:
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


def _scale_bounds(low: float | None, high: float) -> tuple[float | None, float]:
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


def check_half_steps(
    dtype: torch.dtype | None,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    where: str,
    o2: str,
) -> None:
    """Refuse an ``eps`` the optimizer cannot hold where it steps half-precision weights itself (O3: no fp32 masters).

    Adam's default 1e-8 is 0 in float16: the first step of a weight whose gradient is 0 (a dead ReLU, an unused
    embedding row) divides 0 by 0, and every weight it reaches becomes NaN, with no error.

    Args:
        dtype: The dtype the optimizer steps ``models``' weights in; None (fp32, or fp32 masters) checks nothing.
        models: The modules whose weights are cast.
        optimizers: Their optimizers.
        where: What runs at which level, for the message ("opt_level O3", "fabric.setup under precision 'apex-O3'").
        o2: The O2 setting to name in the fix ('opt_level="O2"', "precision='apex-O2'").

    Raises:
        PrecisionConfigurationError: a param group's ``eps`` rounds to 0 in ``dtype``.
    """
    if dtype is None:
        return
    cast = {id(param) for model in models for param in model.parameters()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            eps = group.get("eps")
            steps_cast_weights = any(id(param) in cast for param in group["params"])
            if steps_cast_weights and isinstance(eps, float) and torch.tensor(eps, dtype=dtype).item() == 0 < eps:
                name = type(optimizer).__name__
                raise PrecisionConfigurationError(
                    "eps",
                    eps,
                    f"{where} steps the {str(dtype).removeprefix('torch.')} weights themselves, where {name}'s eps"
                    " rounds to 0, so a weight whose gradient is 0 becomes NaN at its first step",
                    f"pass {name}(..., eps=1e-4) (the smallest that float16 holds is about 6e-8), or use {o2}, whose"
                    " optimizer steps fp32 master weights",
                )
