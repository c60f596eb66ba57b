"""The AMP options: one typed dataclass, with their defaults and their checks, that both doors and compare take.

``AmpPrecision(opt_level="O2", loss_scale=128.0)`` passes its options through, untouched, to :class:`AmpSettings`,
on the Trainer as on Fabric; every backend reads them from there, and compare carries a script's settings to another
level with :meth:`AmpSettings.options`. :class:`AmpOptions` is how a door's signature lists them (``**options``), so
that type checkers and LightningCLI see each option typed; a test keeps the two alike.

Each check raises :class:`~lightning_ddp_amp.errors.PrecisionConfigurationError` naming the option, its value and the
fix. Nothing here knows Lightning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal, TypedDict, cast

import torch

from lightning_ddp_amp.errors import PrecisionConfigurationError, nearest, whole_number
from lightning_ddp_amp.precision_strings import OPT_LEVELS, OptLevel

#: ``AmpPrecision(dtype=...)``: the half-precision dtypes of the native backend.
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class AmpOptions(TypedDict, total=False):
    """The options ``AmpPrecision`` takes by keyword besides ``opt_level``, as ``amp.initialize`` names them; their
    defaults and checks are :class:`AmpSettings`'.

    Args:
        keep_batchnorm_fp32: As in ``amp.initialize`` (O2 / O3 only).
        loss_scale: ``"dynamic"`` or a fixed scale; default: the level's (dynamic for O1 / O2).
        num_losses: Number of losses with their own loss scale; pass ``loss_id`` to the backward.
        min_loss_scale: Floor of a dynamic loss scale.
        max_loss_scale: Ceiling of a dynamic loss scale.
        cast_model_outputs: dtype the amp models' floating outputs are cast to, e.g. ``"float32"``.
        dtype: Native backend only: ``"float16"`` or ``"bfloat16"`` (no loss scaling).
    """

    keep_batchnorm_fp32: bool | None
    loss_scale: float | Literal["dynamic"] | None
    num_losses: int
    min_loss_scale: float | None
    max_loss_scale: float
    cast_model_outputs: str | torch.dtype | None
    dtype: Literal["float16", "bfloat16"]


def settings_of(opt_level: OptLevel, options: Mapping[str, object]) -> AmpSettings:
    """:class:`AmpSettings` from a door's ``opt_level`` and ``**options``, a name that is no option refused.

    Raises:
        PrecisionConfigurationError: An option's name is not one of :class:`AmpOptions`' (the nearest is named), or
            :class:`AmpSettings` refuses a value.
    """
    names = tuple(AmpOptions.__annotations__)
    for name, value in options.items():
        if name not in names:
            near = nearest(name, names)
            raise PrecisionConfigurationError(
                name,
                value,
                "not an option of AmpPrecision",
                (f"did you mean {near!r}? " if near else "") + f"The options are opt_level, {', '.join(names)}",
            )
    return AmpSettings(opt_level, **cast(AmpOptions, options))


@dataclasses.dataclass(frozen=True)
class AmpSettings:
    """The AMP options, checked, with their defaults: what every backend reads (what each means: :class:`AmpOptions`).

    ``AmpSettings("O2", loss_scale=128.0)``; the doors build it from their arguments as given.

    Args:
        opt_level: apex's optimization level, ``"O0"`` … ``"O3"``.

    Raises:
        PrecisionConfigurationError: An option is invalid, or two of them contradict each other.
    """

    opt_level: OptLevel = "O1"
    _: dataclasses.KW_ONLY
    keep_batchnorm_fp32: bool | None = None
    loss_scale: float | Literal["dynamic"] | None = None
    num_losses: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24
    cast_model_outputs: str | torch.dtype | None = None
    dtype: Literal["float16", "bfloat16"] = "float16"

    def __post_init__(self) -> None:
        check_choice("opt_level", self.opt_level, OPT_LEVELS)
        check_choice("dtype", self.dtype, tuple(DTYPES))
        if self.keep_batchnorm_fp32 is not None and self.opt_level in ("O0", "O1"):
            raise PrecisionConfigurationError(
                "keep_batchnorm_fp32",
                self.keep_batchnorm_fp32,
                f"it only applies to opt_level O2 and O3 (opt_level={self.opt_level!r} keeps batchnorm in fp32 anyway)",
                "leave keep_batchnorm_fp32 unset",
            )
        whole_number(
            PrecisionConfigurationError,
            "num_losses",
            self.num_losses,
            "it must be a whole number of at least 1",
            "e.g. num_losses=1",
            minimum=1,
        )
        # A fixed scale given as a whole number (or a YAML string) is the float both backends are handed.
        object.__setattr__(self, "loss_scale", _loss_scale(self.loss_scale))
        _check_scale_bounds(self.min_loss_scale, self.max_loss_scale)
        _to_dtype("cast_model_outputs", self.cast_model_outputs)

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as torch's: the half precision of the native backend (apex runs float16 only)."""
        return DTYPES[self.dtype]

    @property
    def output_dtype(self) -> torch.dtype | None:
        """``cast_model_outputs`` as torch's dtype; None leaves the outputs as the models make them."""
        return _to_dtype("cast_model_outputs", self.cast_model_outputs)

    def options(self) -> AmpOptions:
        """Every option but ``opt_level``, as a door takes them: ``AmpPrecision(level, **settings.options())`` runs
        these settings at another level (what compare does with a script's own AmpPrecision)."""
        fields = dataclasses.fields(self)
        return cast(AmpOptions, {f.name: getattr(self, f.name) for f in fields if f.name != "opt_level"})

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


def check_choice(field: str, value: object, choices: Sequence[str]) -> None:
    """Refuse a ``value`` of ``field`` that is not one of ``choices``.

    Raises:
        PrecisionConfigurationError: ``value`` is not among ``choices``.
    """
    if value not in choices:
        raise PrecisionConfigurationError(
            field, value, f"it must be one of {', '.join(repr(c) for c in choices)}", "use one of those values"
        )


def _loss_scale(loss_scale: float | str | None) -> float | Literal["dynamic"] | None:
    if loss_scale is None:
        return None
    if loss_scale == "dynamic":
        return "dynamic"
    try:
        value = float(loss_scale)
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise PrecisionConfigurationError(
            "loss_scale", loss_scale, 'it must be "dynamic" or a positive number', 'e.g. loss_scale="dynamic" or 128.0'
        )
    return value


def _check_scale_bounds(low: float | None, high: float) -> None:
    if low is not None and not low > 0:
        raise PrecisionConfigurationError("min_loss_scale", low, "it must be positive", "e.g. min_loss_scale=1.0")
    if not high > 0:
        raise PrecisionConfigurationError("max_loss_scale", high, "it must be positive", "e.g. max_loss_scale=2**24")
    if low is not None and low > high:
        raise PrecisionConfigurationError(
            "min_loss_scale", low, f"it is above max_loss_scale={high}", "make min_loss_scale ≤ max_loss_scale"
        )


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
    cast_weights = {id(param) for model in models for param in model.parameters()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            eps = group.get("eps")
            steps_cast_weights = any(id(param) in cast_weights for param in group["params"])
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
