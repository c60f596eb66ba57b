"""TEST DOUBLE of ``apex/amp/frontend.py``: ``initialize``, the O0 to O3 property sets, ``state_dict`` and
``load_state_dict``.

As in apex 25.05, nothing stops a second ``initialize`` in a process: apex documents "once" but does not check it.
Each call resets the properties and the loss scalers, and an O1 call patches torch again, over the earlier patch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from . import double_extras
from ._amp_state import _amp_state, maybe_print, warn_or_err
from ._initialize import _initialize

#: What ``initialize`` and amp.py's decorators warn with (apex's ``deprecated_warning``).
DEPRECATED = (
    "apex.amp is deprecated and will be removed by the end of February 2023. Use [PyTorch"
    " AMP](https://pytorch.org/docs/stable/amp.html)"
)


class Properties:
    """frontend.py ``Properties``: the options, with apex's consistency checks when one is set."""

    def __init__(self) -> None:
        self.options: dict[str, Any] = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
        }

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        if "options" not in self.__dict__:
            super().__setattr__(name, value)
            return
        if name not in self.options:
            return  # apex ignores any other name once the options exist
        if name == "cast_model_type":
            if self.opt_level == "O1" and value is not None and value is not False and value is not torch.float32:
                warn_or_err(
                    "O1 inserts casts around Torch functions rather than model weights, so with O1, the model weights"
                    " themselves should remain FP32. If you wish to cast the model to a different type, use"
                    f" opt_level='O2' or 'O3'. cast_model_type was {value}"
                )
        elif name == "patch_torch_functions":
            if self.opt_level != "O1" and value:
                warn_or_err("Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'.")
        elif name == "keep_batchnorm_fp32":
            if self.opt_level == "O1" and value is not None:
                warn_or_err(
                    "With opt_level O1, batchnorm functions are automatically patched to run in FP32, so"
                    f" keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {value}"
                )
            value = {"False": False, "True": True}.get(value, value) if isinstance(value, str) else value
            assert value is True or value is False or value is None, (
                "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None, found"
                f" keep_batchnorm_fp32={value}"
            )
        elif name == "master_weights":
            if self.opt_level == "O1" and value is not None:
                warn_or_err(
                    "It doesn't make sense to use master_weights with O1. With O1, your model weights themselves"
                    " should be FP32."
                )
        elif name == "loss_scale":
            value = value if value == "dynamic" else float(value)
        self.options[name] = value


#: frontend.py ``O0``…``O3``: (brief, the properties each sets, in apex's order).
OPT_LEVELS: dict[str, tuple[str, dict[str, Any]]] = {
    "O3": (
        "O3:  Pure FP16 training.",
        {
            "cast_model_type": torch.float16,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": False,
            "master_weights": False,
            "loss_scale": 1.0,
        },
    ),
    "O2": (
        "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n",
        {
            "cast_model_type": torch.float16,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": True,
            "master_weights": True,
            "loss_scale": "dynamic",
        },
    ),
    "O1": (
        "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n",
        {
            "cast_model_type": None,
            "patch_torch_functions": True,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": "dynamic",
        },
    ),
    "O0": (
        "O0:  Pure FP32 training.\n",
        {
            "cast_model_type": torch.float32,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": False,
            "loss_scale": 1.0,
        },
    ),
}


def _apply_opt_level(properties: Properties, opt_level: str) -> Properties:
    """frontend.py ``O0``...``O3`` ``__call__``: enable, set ``opt_level``, then the level's properties (checked)."""
    properties.enabled = True
    properties.opt_level = opt_level
    for name, value in OPT_LEVELS[opt_level][1].items():
        setattr(properties, name, value)
    return properties


def _print_options(properties: Properties) -> None:
    """frontend.py ``initialize``: its loop printing each option, rank 0 only (``maybe_print(..., True)``)."""
    for name, value in properties.options.items():
        maybe_print(f"{name:22} : {value}", True)


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> Any:
    """frontend.py ``initialize``: the opt_level's properties, then every argument that is not None as an
    override (checked by :class:`Properties`), then :func:`~apex.amp._initialize._initialize`.

    Returns the models and optimizers in the shapes given: a list for a list, one for one, and only the models
    when ``optimizers`` is None.
    """
    from apex import deprecated_warning

    deprecated_warning(DEPRECATED)
    _amp_state.opt_properties = Properties()
    _amp_state.verbosity = verbosity
    if not enabled:
        return models if optimizers is None else (models, optimizers)
    if not torch.backends.cudnn.enabled:
        raise RuntimeError("Amp requires torch.backends.cudnn.enabled = True")
    if opt_level not in OPT_LEVELS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'.  Note that in `O0`,"
            " `O1`, etc., the prefix O is the letter O, not the number zero."
        )
    _amp_state.opt_properties = _apply_opt_level(_amp_state.opt_properties, opt_level)
    maybe_print(f"Selected optimization level {OPT_LEVELS[opt_level][0]}", True)
    maybe_print("Defaults for this optimization level are:", True)
    _print_options(_amp_state.opt_properties)

    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale

    maybe_print("Processing user overrides (additional kwargs that are not None)...", True)
    overrides = {
        "enabled": enabled,
        "opt_level": opt_level,
        "cast_model_type": cast_model_type,
        "patch_torch_functions": patch_torch_functions,
        "keep_batchnorm_fp32": keep_batchnorm_fp32,
        "master_weights": master_weights,
        "loss_scale": loss_scale,
    }
    for name, value in overrides.items():
        if value is not None:
            setattr(_amp_state.opt_properties, name, value)
    maybe_print("After processing overrides, optimization options are:", True)
    _print_options(_amp_state.opt_properties)

    result = _initialize(models, optimizers, _amp_state.opt_properties, num_losses, cast_model_outputs)
    model_list = models if isinstance(models, list) else [models]
    optimizer_list = [] if optimizers is None else optimizers if isinstance(optimizers, list) else [optimizers]
    double_extras.record(
        "initialize",
        models=[type(m).__name__ for m in model_list],
        optimizers=[type(o).__name__ for o in optimizer_list],
        opt_level=opt_level,
        loss_scale=_amp_state.opt_properties.loss_scale,
        num_losses=num_losses,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        cast_model_outputs=None if cast_model_outputs is None else str(cast_model_outputs),
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        params_on=sorted({p.device.type for m in model_list for p in m.parameters()}),
    )
    double_extras.watch_backward(model_list)
    return result


def state_dict(destination: Any = None) -> OrderedDict[str, dict[str, Any]]:
    """frontend.py ``state_dict``: ``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}``. Before
    ``initialize`` there are no loss scalers: AttributeError, as in apex."""
    if destination is None:
        destination = OrderedDict()
    for idx, loss_scaler in enumerate(_amp_state.loss_scalers):
        destination[f"loss_scaler{idx}"] = {"loss_scale": loss_scaler.loss_scale(), "unskipped": loss_scaler._unskipped}
    return destination


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """frontend.py ``load_state_dict``: the ``loss_scaler`` entries in order, one per scaler; extra ones are skipped
    (printed), and keys without ``loss_scaler`` are an error after the others were loaded."""
    if len(state_dict) != len(_amp_state.loss_scalers):
        print(
            f"Warning: state_dict contains {len(state_dict)} entries, while {len(_amp_state.loss_scalers)}"
            " loss_scalers are used"
        )
    state_dict = state_dict.copy()
    nb_loss_scalers = len(_amp_state.loss_scalers)
    unexpected_keys = []
    idx = 0
    for key in state_dict:
        if "loss_scaler" not in key:
            unexpected_keys.append(key)
            continue
        if idx > nb_loss_scalers - 1:
            print(f"Skipping loss_scaler[{idx}], since num_losses was set to {nb_loss_scalers}")
            break
        _amp_state.loss_scalers[idx]._loss_scale = state_dict[key]["loss_scale"]
        _amp_state.loss_scalers[idx]._unskipped = state_dict[key]["unskipped"]
        idx += 1
    double_extras.record("load_state_dict", state={k: dict(v) for k, v in state_dict.items() if "loss_scaler" in k})
    if unexpected_keys:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: {}. ".format(
                ", ".join(f'"{k}"' for k in unexpected_keys)
            )
        )
