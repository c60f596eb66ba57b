"""The fit loop's progress counters, the ``"loops"`` entry of a checkpoint, and the results of a running evaluation:
Lightning keeps them in undocumented parts of its loops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    import lightning.pytorch as pl


def epoch_progress(trainer: pl.Trainer) -> tuple[int, int]:
    """How many training batches of the current epoch have finished their step, and how many the epoch has.

    Why: Lightning counts them only in its fit loop's progress tracking, which it does not document.
    """
    current: Any = trainer.fit_loop.epoch_loop.batch_progress.current  # typed as its base, which lacks the count
    return int(current.processed), int(trainer.num_training_batches)


def move_epoch_batches(trainer: pl.Trainer, by: int) -> None:
    """Move the fit loop's count of the current epoch's trained batches by ``by`` (its current and total counts).

    Why: Lightning ends an epoch, validates and accumulates gradients by these counters of its undocumented
    progress tracking; a resumed epoch on another number of ranks has another number of batches
    (:func:`lightning_ddp_amp.trainer.position.align_resumed_epoch`).
    """
    progress: Any = trainer.fit_loop.epoch_loop.batch_progress
    for counts in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            setattr(counts, name, getattr(counts, name) + by)


def disable_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Stop the training loop from broadcasting rank 0's SIGTERM flag at every step (Lightning ≥ 2.5.2).

    Why: that broadcast makes every rank wait for the others at every step, which costs as much as a tenth of a
    small model's step, and EnvDDPStrategy handles SIGTERM itself. The loop's method is shadowed on this one loop.
    """
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        setattr(loop, "_broadcast_sigterm_tensor", lambda: None)  # noqa: B010  (instance attribute, not the class)


def make_stateful(
    loader: DataLoader[Any],
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
) -> None:
    """Have Lightning save ``state_dict()`` in checkpoints and hand it to ``load_state_dict`` on resume.

    Why: Lightning saves a DataLoader's position only when the loader itself has these two methods (its private
    ``_Stateful`` protocol); the loader must stay the user's own class, so they go on this one instance.
    """
    loader.state_dict = state_dict
    loader.load_state_dict = load_state_dict


def saved_mid_epoch(checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` was saved after some, but not all, training batches of its epoch had finished.

    Why: only the fit loop's progress counters, in Lightning's undocumented ``"loops"`` entry, tell.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    epoch = fit_loop.get("epoch_progress", {}).get("current", {})
    trained = int(batches.get("current", {}).get("processed", 0))
    epoch_open = int(epoch.get("processed", 0)) < int(epoch.get("started", 0))
    return trained > 0 and epoch_open and not batches.get("is_last_batch", False)


def saved_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The states of the training DataLoaders that ``checkpoint`` holds (see :func:`make_stateful`), in order.

    Why: Lightning keeps them in its fit loop's entry of the undocumented ``"loops"`` format.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return list(fit_loop.get("state_dict", {}).get("combined_loader", []))


def is_loader_state_mismatch(exception: BaseException) -> bool:
    """Whether ``exception`` is Lightning's refusal of a checkpoint that holds more DataLoader states than the run.

    Why: Lightning raises a plain ``RuntimeError`` for it, told apart from others only by its text.
    """
    return isinstance(exception, RuntimeError) and "stateful loaders, but found" in str(exception)


def epoch_boundary_loops(epochs: int, global_step: int) -> dict[str, Any]:
    """The ``"loops"`` entry of a checkpoint saved after ``epochs`` whole epochs and ``global_step`` optimizer steps,
    from which ``fit`` continues at the start of epoch ``epochs`` (a converted classic checkpoint's).

    Why: the epoch and the step a fit continues at are Lightning's fit loop progress counters, in its undocumented
    ``"loops"`` format. The entries come from this Lightning's own loops (a Trainer that never runs), so each
    release gets its own layout; only the counters of epochs, trained batches and optimizer steps are set.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import SingleDeviceStrategy

    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the Trainer's "GPU available" lines and tips
    try:
        trainer = Trainer(
            accelerator="cpu", strategy=SingleDeviceStrategy(torch.device("cpu")), plugins=[LightningEnvironment()],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
    finally:
        quiet.setLevel(level)
    loops = {
        name: getattr(trainer, name).state_dict() for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop")
    }
    fit = loops["fit_loop"]
    counts = {"ready": epochs, "started": epochs, "processed": epochs, "completed": epochs}
    for part in ("total", "current"):
        fit["epoch_progress"][part].update(counts)
    fit["epoch_loop.batch_progress"]["total"].update({name: global_step for name in counts})
    optimizer = fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    optimizer["step"]["total"].update(ready=global_step, completed=global_step)
    optimizer["zero_grad"]["total"].update(ready=global_step, started=global_step, completed=global_step)
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] = global_step  # the step loggers are given
    return loops


def evaluation_metrics(trainer: pl.Trainer) -> dict[str, float]:
    """What the script logged in the validation or test run that is ending, by the names ``callback_metrics`` uses.

    Why: ``callback_metrics`` mixes them with training's; only the running evaluation loop's results tell which were
    logged in this run. Read in ``on_validation_end`` / ``on_test_end``, after Lightning computed (and synced) them.
    """
    results = trainer._results
    if results is None:
        return {}
    values = results.metrics(on_step=False)["callback"]
    return {name: float(value) for name, value in values.items() if value.numel() == 1}
