# Generated from ../../commands/convert.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
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
from lightning_fabric.utilities import rank_zero_info
from torch import Tensor
from torch.nn import Module

from lightning_ddp_amp.pytorch_lightning import _lightning
from lightning_ddp_amp.errors import CheckpointError, whole_number
from lightning_ddp_amp.precision_strings import OPT_LEVELS
from lightning_ddp_amp.safe_load import load_checkpoint
from lightning_ddp_amp.pytorch_lightning.trainer.precision import AmpPrecision
from lightning_ddp_amp.pytorch_lightning.trainer.resume import AtomicCheckpointIO

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
    ...


def _read(source: Path, trusted: bool) -> dict[str, Any]:
    ...


def _is_weights(value: object) -> bool:
    ...


def _map_weights(
    source: Path, classic: dict[str, Any], module: Module, names: dict[str, str]
) -> tuple[dict[str, Tensor], bool]:
    """The module's ``state_dict`` filled from the classic model entries, and whether they were fp16 (apex O2)."""
    ...


def _fp16_valued(tensor: Tensor) -> bool:
    """Whether ``tensor`` holds fp16 weights: their dtype, or, as apex O2's ``state_dict`` returns them, float32
    values that are all fp16 roundings (a trained fp32 tensor of several distinct values never is)."""
    ...


def _place(
    entry: str, keys: Mapping[str, Tensor], target: Mapping[str, Tensor], children: list[str], count: int
) -> str:
    """The prefix an entry's names go under: the submodule it is named after, or, for a script's one model, where
    every one of its names is found."""
    ...


def _count(classic: dict[str, Any], field: str, keys: tuple[str, ...], given: int | None) -> tuple[int, str | None]:
    """The count ``field`` continues at, and where it came from: ``"field="`` (passed), the key read, or None."""
    ...


def _report(
    source: Path, target: Path, classic: dict[str, Any], converted: dict[str, Any], read: tuple[str | None, str | None]
) -> str:
    """What rank 0 says once the file is written: where the fit continues, from which entries, and what is missing."""
    ...


def _loss_scalers(source: Path, amp_state: object) -> list[dict[str, float]]:
    """``amp.state_dict()`` (``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}``) as AmpPrecision's
    list; none for a run without loss scaling (O0, or no ``amp`` entry)."""
    ...


def _listed(classic: dict[str, Any], keys: tuple[str, ...]) -> list[Any]:
    ...
