"""Continue a classic apex run under Lightning: its checkpoint, converted into the one the Trainer resumes from.

A classic script saves, on rank 0, what apex's README recommends, often with the epoch, the step and a scheduler::

    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict(),
                "epoch": epoch + 1, "step": step, "scheduler": scheduler.state_dict()}, "checkpoint.pt")

:func:`convert_apex_checkpoint` maps it onto the LightningModule that replaces the script and writes a Lightning
checkpoint; ``trainer.fit(module, ckpt_path=...)`` then continues at the next epoch, with the weights, the optimizer
state (momentum, Adam's moments), the loss scale and the scheduler carried, under ``apex-O*`` or under torch's AMP.

How the classic entries become the module's names, with no options in the common cases:

* every entry whose values are all tensors is a model's ``state_dict``; DDP's ``module.`` prefixes are dropped;
* an entry named like a submodule of the LightningModule (``model_a`` → ``self.model_a``) goes under that name;
  the one model entry of a single-model script goes where its names fit: on the LightningModule itself, or under
  the one submodule whose names they are (``self.model``, ``self.net``, ...); ``names={"model": "net"}`` decides
  where the rule cannot;
* ``optimizer`` (or a list under ``optimizers``), ``amp``, ``scheduler`` (or ``lr_scheduler``) are taken as they
  are; ``epoch`` counts the epochs done, which is the epoch to continue at, as apex's ImageNet example saves
  ``epoch + 1``; ``step`` (or ``global_step``, ``iteration``) counts the optimizer steps done.

Rank 0 says where the fit continues: the epoch and the global step, the entries they were read from, what the file
does not hold (without a step count, Lightning's step count starts again at 0) and the arguments that set them.

apex O2 trains fp32 master copies of fp16 weights, and its checkpoint holds only the fp16 weights: as apex's own
resume does, the masters are rebuilt from them (rank 0 says so when the fit continues).

Reading the file runs none of its code: only tensors, plain values and ``argparse.Namespace`` (a script's saved
``args``) are built (:mod:`lightning_ddp_amp.safe_load`); a file that names anything else is refused unless
``trusted=True``. The converted checkpoint is written atomically, as the strategy writes its own.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities import rank_zero_info
from torch import Tensor
from torch.nn import Module

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.errors import CheckpointError, whole_number
from lightning_ddp_amp.precision_strings import OPT_LEVELS
from lightning_ddp_amp.safe_load import load_checkpoint
from lightning_ddp_amp.trainer.precision import AmpPrecision
from lightning_ddp_amp.trainer.resume import AtomicCheckpointIO

#: The classic entries that are not a model's weights, by what they become.
OPTIMIZER_KEYS = ("optimizer", "optimizers")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "schedulers", "lr_schedulers")
STEP_KEYS = ("step", "global_step", "iteration")
_DDP_PREFIX = "module."
#: The entry a converted checkpoint records where it came from: ``{"source": PATH, "opt_level": "O1"}``.
CONVERTED_KEY = "converted_from_apex"


def convert_apex_checkpoint(
    checkpoint: str | Path,
    module: Module,
    out: str | Path | None = None,
    *,
    opt_level: str | None = None,
    names: Mapping[str, str] | None = None,
    epoch: int | None = None,
    global_step: int | None = None,
    trusted: bool = False,
) -> Path:
    """Write the Lightning checkpoint that continues the classic apex checkpoint ``checkpoint`` as ``module``.

    Args:
        checkpoint: The file the classic script saved (``torch.save`` of a dict).
        module: The LightningModule that replaces the script, built as for training (its names and shapes are the
            target; its weights are not used).
        out: Where to write; default: beside ``checkpoint``, named ``<stem>-lightning.ckpt``.
        opt_level: The ``opt_level`` the classic run used; default: O2 when its weights are fp16 (apex O2's
            ``state_dict`` returns them as float32 roundings to fp16), else O1 (O0 and O1 checkpoints are alike;
            O3's weights are fp16 too: say O3).
        names: Where a model entry goes, e.g. ``{"model": "net"}``; ``""`` for the LightningModule itself.
        epoch: The epochs done (the epoch to continue at), when the checkpoint's ``epoch`` is missing or counts
            otherwise.
        global_step: The optimizer steps done, when the checkpoint has no ``step``.
        trusted: Read a file that names more than tensors, plain values and ``argparse.Namespace`` (a custom class,
            a numpy scalar) as ``torch.load(weights_only=False)`` does, which runs whatever code its pickle says:
            only for a file whose source you trust.

    Returns:
        The path written.

    Raises:
        CheckpointError: The file is not a classic checkpoint, or its weights do not fit ``module`` (the message
            names the first key that does not), or, without ``trusted``, it names a class or function that only
            unpickling could build (nothing of it is built).
    """
    source = Path(checkpoint)
    classic = _read(source, trusted)
    loss_scalers = _loss_scalers(source, classic.get("amp"))
    state, fp16 = _map_weights(source, classic, module, dict(names or {}))
    level = opt_level or ("O2" if fp16 else "O1")
    if level not in OPT_LEVELS:
        raise CheckpointError("opt_level", opt_level, "apex's opt_levels are O0, O1, O2 and O3", "e.g. opt_level='O1'")
    done, epoch_from = _count(classic, "epoch", ("epoch",), epoch)
    steps, step_from = _count(classic, "global_step", STEP_KEYS, global_step)
    converted = {
        "epoch": done,
        "global_step": steps,
        "pytorch-lightning_version": _lightning.version(),
        "state_dict": state,
        "optimizer_states": _listed(classic, OPTIMIZER_KEYS),
        "lr_schedulers": _listed(classic, SCHEDULER_KEYS),
        "loops": _lightning.epoch_boundary_loops(done, steps),
        CONVERTED_KEY: {"source": str(source), "opt_level": level},
    }
    if "amp" in classic or level in ("O2", "O3"):
        # Without amp.state_dict() or fp16 weights, nothing of apex is in the file: no apex state to resume from.
        amp_state: dict[str, Any] = {"backend": "apex", "opt_level": level, "loss_scalers": loss_scalers}
        if level == "O2":
            amp_state["rebuild_masters"] = True  # AmpPrecision: no fp32 masters saved; rebuilt from the fp16 weights
        converted[AmpPrecision.__qualname__] = amp_state
    target = Path(out) if out is not None else source.with_name(f"{source.stem}-lightning.ckpt")
    AtomicCheckpointIO().save_checkpoint(converted, target)
    rank_zero_info(_report(source, target, classic, converted, (epoch_from, step_from)))
    return target


def _read(source: Path, trusted: bool) -> dict[str, Any]:
    try:
        classic = load_checkpoint(source, field="checkpoint", opt_in="pass trusted=True", trusted=trusted)
    except FileNotFoundError:
        raise CheckpointError(
            "checkpoint", str(source), "there is no such file", "pass the file the classic script saved"
        ) from None
    except CheckpointError:
        raise
    except (RuntimeError, EOFError, ValueError, OSError, pickle.UnpicklingError) as error:
        raise CheckpointError(
            "checkpoint",
            str(source),
            f"it cannot be read ({type(error).__name__}: {error})",
            "pass the file the classic script saved",
        ) from error
    if not isinstance(classic, dict):
        raise CheckpointError(
            "checkpoint",
            str(source),
            f"it holds a {type(classic).__name__}, not the dict a classic script saves",
            "save {'model': model.state_dict(), 'optimizer': ..., 'amp': amp.state_dict()} as apex's README does",
        )
    if "state_dict" in classic and "loops" in classic:
        raise CheckpointError(
            "checkpoint",
            str(source),
            "it is already a Lightning checkpoint",
            "pass it to trainer.fit(ckpt_path=...) as it is",
        )
    return classic


def _is_weights(value: object) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(isinstance(item, Tensor) for item in value.values())


def _map_weights(
    source: Path, classic: dict[str, Any], module: Module, names: dict[str, str]
) -> tuple[dict[str, Tensor], bool]:
    """The module's ``state_dict`` filled from the classic model entries, and whether they were fp16 (apex O2)."""
    target = module.state_dict()
    models = {key: value for key, value in classic.items() if _is_weights(value)}
    if not models:
        raise CheckpointError(
            "checkpoint",
            str(source),
            f"none of its entries ({', '.join(map(str, classic)) or 'none'}) is a model's state_dict",
            "save model.state_dict() in it, as apex's README does",
        )
    unknown = sorted(set(names) - set(models))
    if unknown:
        raise CheckpointError(
            "names", dict(names), f"the checkpoint has no model entry {unknown[0]!r}", f"name one of {sorted(models)}"
        )
    children = [name for name, _ in module.named_children()]
    state: dict[str, Tensor] = {}
    fp16 = False
    for entry, weights in models.items():
        keys = {key.removeprefix(_DDP_PREFIX): value for key, value in weights.items()}
        prefix = names.get(entry, _place(entry, keys, target, children, len(models)))
        for key, value in keys.items():
            name = f"{prefix}.{key}" if prefix else key
            if name not in target:
                raise CheckpointError(
                    "checkpoint",
                    str(source),
                    f"its entry {entry!r} holds {key!r}, and {type(module).__name__} has no {name!r}",
                    f"build the module as the classic script built its model, or place the entry with"
                    f" names={{{entry!r}: '<attribute>'}} (its submodules: {', '.join(children) or 'none'})",
                )
            if tuple(value.shape) != tuple(target[name].shape):
                raise CheckpointError(
                    "checkpoint",
                    str(source),
                    f"its {entry!r}[{key!r}] has shape {tuple(value.shape)}, {type(module).__name__}'s {name!r}"
                    f" {tuple(target[name].shape)}",
                    "build the module with the classic model's sizes",
                )
            fp16 |= target[name].dtype == torch.float32 and _fp16_valued(value)
            state[name] = value.to(target[name].dtype)
    missing = [name for name in target if name not in state]
    if missing:
        raise CheckpointError(
            "checkpoint",
            str(source),
            f"{type(module).__name__}'s {missing[0]!r} is in none of its model entries ({', '.join(models)})"
            + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""),
            "convert with the module the classic script trained (the same submodules), or place an entry with names=",
        )
    return state, fp16


def _fp16_valued(tensor: Tensor) -> bool:
    """Whether ``tensor`` holds fp16 weights: their dtype, or, as apex O2's ``state_dict`` returns them, float32
    values that are all fp16 roundings (a trained fp32 tensor of several distinct values never is)."""
    if tensor.dtype == torch.float16:
        return True
    if tensor.dtype != torch.float32 or tensor.numel() < 2 or bool((tensor == tensor.flatten()[0]).all()):
        return False
    return torch.equal(tensor.half().float(), tensor)


def _place(
    entry: str, keys: Mapping[str, Tensor], target: Mapping[str, Tensor], children: list[str], count: int
) -> str:
    """The prefix an entry's names go under: the submodule it is named after, or, for a script's one model, where
    every one of its names is found."""
    if entry in children:
        return entry
    if count == 1:
        for prefix in ["", *children]:
            if all((f"{prefix}.{key}" if prefix else key) in target for key in keys):
                return prefix
    return entry  # reported as not fitting, naming its first key


def _count(classic: dict[str, Any], field: str, keys: tuple[str, ...], given: int | None) -> tuple[int, str | None]:
    """The count ``field`` continues at, and where it came from: ``"field="`` (passed), the key read, or None."""
    found = next((key for key in keys if key in classic), None)
    source = f"{field}=" if given is not None else found
    value = given if given is not None else classic[found] if found is not None else 0
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    count = whole_number(
        CheckpointError,
        field,
        value,
        "it must be a whole number, 0 or more",
        f"pass {field}=N to convert_apex_checkpoint",
        minimum=0,
    )
    return count, source


def _report(
    source: Path, target: Path, classic: dict[str, Any], converted: dict[str, Any], read: tuple[str | None, str | None]
) -> str:
    """What rank 0 says once the file is written: where the fit continues, from which entries, and what is missing."""
    done, steps = converted["epoch"], converted["global_step"]
    epoch_from, step_from = read
    if epoch_from == "epoch=":
        epoch = f"epoch={done}, as passed" + (
            f" (its 'epoch' holds {classic['epoch']!r})" if "epoch" in classic else ""
        )
    elif epoch_from is not None:
        epoch = (
            f"its 'epoch' ({done}), read as the epochs done, as apex's ImageNet example saves epoch + 1 (if it is the"
            f" epoch last trained, pass epoch={done + 1})"
        )
    else:
        epoch = "it holds no 'epoch', so the fit starts at the first epoch; pass epoch=N, the epochs done"
    if step_from == "global_step=":
        step = f"global_step={steps}, as passed"
    elif step_from is not None:
        step = f"its {step_from!r} ({steps}), the optimizer steps done"
    else:
        step = (
            f"it holds no step count ({', '.join(map(repr, STEP_KEYS))}), so Lightning's step count starts again at 0,"
            " and with it step-based schedules that read it, the checkpoint names (step=N), every_n_train_steps,"
            " max_steps and the loggers' step axis; pass global_step=N, the optimizer steps done (epochs done times"
            " steps per epoch)"
        )
    carried = [f"the weights ({', '.join(key for key, value in classic.items() if _is_weights(value))})"]
    missing = []
    for kind, entry, key, afresh in (
        ("the optimizer's state", "optimizer_states", "optimizer", "momentum and Adam's moments start at zero"),
        ("the LR scheduler's state", "lr_schedulers", "scheduler", "a schedule starts from its beginning"),
    ):
        if converted[entry]:
            carried.append(kind)
        else:
            missing.append(f"{kind} ({key!r}: {afresh})")
    amp = converted.get(AmpPrecision.__qualname__)
    if "amp" in classic and amp is not None:
        scales = ", ".join(f"{scaler['loss_scale']:g}" for scaler in amp["loss_scalers"]) or "none"
        carried.append(f"apex amp {amp['opt_level']}'s loss scale ({scales})")
    else:
        missing.append("a loss scale ('amp': the loss scaler starts at its initial scale)")
    lines = [
        f"convert_apex_checkpoint: wrote {target} from {source}; trainer.fit(ckpt_path=...) continues it at epoch"
        f" {done}, global step {steps}.",
        f"  epoch {done}: {epoch}",
        f"  global step {steps}: {step}",
        f"  carried: {', '.join(carried)}",
    ]
    if missing:
        lines.append(f"  not in it: {', '.join(missing)}")
    return "\n".join(lines)


def _loss_scalers(source: Path, amp_state: object) -> list[dict[str, float]]:
    """``amp.state_dict()`` (``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}``) as AmpPrecision's
    list; none for a run without loss scaling (O0, or no ``amp`` entry)."""
    if amp_state is None:
        return []
    if not isinstance(amp_state, Mapping) or not all(str(key).startswith("loss_scaler") for key in amp_state):
        raise CheckpointError(
            "checkpoint",
            str(source),
            f"its 'amp' entry is not amp.state_dict() (keys {sorted(map(str, amp_state)) if isinstance(amp_state, Mapping) else type(amp_state).__name__})",
            "save amp.state_dict() under 'amp', as apex's README does",
        )
    ordered = sorted(amp_state, key=lambda key: int(str(key).removeprefix("loss_scaler") or 0))
    return [
        {"loss_scale": float(amp_state[key]["loss_scale"]), "unskipped": int(amp_state[key]["unskipped"])}
        for key in ordered
    ]


def _listed(classic: dict[str, Any], keys: tuple[str, ...]) -> list[Any]:
    for key in keys:
        if key in classic:
            value = classic[key]
            return list(value) if isinstance(value, (list, tuple)) else [value]
    return []
