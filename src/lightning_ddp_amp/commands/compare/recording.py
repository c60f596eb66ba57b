"""Inside each run of ``lightning-ddp-amp compare``: what each optimizer step of the script's first ``fit`` did.

:mod:`~lightning_ddp_amp.commands.compare.patching` adds a :class:`Recording` callback to every Trainer of the run; the one
of the process's first ``fit`` records it.

A *step* is one call of an optimizer's ``step`` through Lightning, skipped AMP steps included; that is what
Lightning's ``global_step`` and ``max_steps`` count, and ``max_steps`` ends ``fit`` even before ``min_steps`` or
``min_epochs`` (those only hold back ``should_stop``). What each step keeps is the
:class:`~lightning_ddp_amp.commands.compare.recorder.Recorder`'s, which the Fabric door shares
(:mod:`~lightning_ddp_amp.commands.compare.fabric_recording`); this callback translates Lightning's hooks into its
calls. When a step's gradients are not finite, :mod:`~lightning_ddp_amp.commands.compare.overflow` trains its batch
again through ``training_step`` to locate where. When ``fit`` ends, one ``all_gather_object`` brings every rank's
record to rank 0, which writes ``record.json`` and the final weights (:mod:`~lightning_ddp_amp.commands.compare.run_folder`).

Along the way: the weights are measured at the plan's snapshot steps; each validation and test run's logged metrics
are kept (and the record rewritten for a ``validate`` or ``test`` after ``fit``); a run that raises keeps its steps,
each rank in its own file.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ddp_amp.commands.compare import overflow
from lightning_ddp_amp.commands.compare.model_calls import RandomState, random_state
from lightning_ddp_amp.commands.compare.recorder import Changes, Recorder, ran_as, trained_weights
from lightning_ddp_amp.commands.compare.run_folder import FINAL_WEIGHTS, Plan, partial_file
from lightning_ddp_amp.commands.compare.schema import TEST, VALIDATE, Stage
from lightning_ddp_amp.commands.compare.tensors import hash_batch, save_fp32

__all__ = ["Changes", "Recording"]


class Recording:
    """The callback of a compare run; :func:`~lightning_ddp_amp.commands.compare.patching.patch` mixes it with the
    namespace's ``Callback``. Lightning's hooks, translated into calls of its
    :class:`~lightning_ddp_amp.commands.compare.recorder.Recorder`.

    Args:
        plan: The run's plan.
        changes: What the Trainer's arguments were changed to; rank 0 says them when the first ``fit`` starts, and the
            record lists them.
        redirect_checkpoints: Points the Trainer's ModelCheckpoints into the run's folder; called again when ``fit``
            starts, for those ``LightningModule.configure_callbacks()`` added.
        evaluation_metrics: What the script logged in the validation or test run that is ending
            (:func:`lightning_ddp_amp._lightning.evaluation_metrics` of the Trainer's namespace).
    """

    #: Per-batch hooks of a Callback this one does nothing at; the Trainer does not call them (each call goes through
    #: its profiler, at every batch).
    UNUSED_HOOKS = (
        "on_before_backward",
        "on_after_backward",
        "on_before_zero_grad",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "on_test_batch_start",
        "on_test_batch_end",
    )

    #: The recording of the process's first ``fit``, set on the mixed class: the one that writes the record. A later
    #: Trainer's (``Trainer(devices=1).test(model)`` after a DDP fit) validation and test runs are added to it.
    first: Recording | None = None

    def __init__(
        self,
        plan: Plan,
        changes: Changes,
        redirect_checkpoints: Callable[[Any], None],
        evaluation_metrics: Callable[[Any], dict[str, float]],
    ) -> None:
        self.plan = plan
        self.changes = changes
        self.recorder = Recorder(plan, changes)
        self._redirect_checkpoints = redirect_checkpoints
        self._evaluation_metrics = evaluation_metrics
        self._active = False  # this recording's Trainer runs the process's first fit
        self._finished = False  # that fit ended (on every rank): nothing more is recorded as training
        self.final_step: int | None = None  # the global step that fit ended at
        self._opened: Any = None
        self._stepped: list[tuple[int, Any]] = []  # (index, optimizer) of this batch's steps
        self._restore: list[Callable[[], None]] = []
        self._batch: tuple[Any, int, RandomState] | None = None  # for locating an overflow
        self._plugin: Any = None  # the Trainer's precision plugin

    # -- hooks -------------------------------------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or type(self).first is not None:
            return  # only the process's first fit is recorded
        type(self).first = self
        self._active = True
        # ModelCheckpoints of LightningModule.configure_callbacks() joined the Trainer inside fit, before this hook.
        self._redirect_checkpoints(trainer)
        if trainer.global_rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            print(self.changes.describe(self.plan.candidate), file=sys.stderr, flush=True)
        strategy, plugin = trainer.strategy, trainer.precision_plugin
        self._plugin = plugin
        setup, backward, convert_input = strategy.setup, strategy.backward, plugin.convert_input
        recorder = self.recorder

        def setup_after_restore(trainer_: Any) -> None:
            # Lightning restores a checkpoint's weights before strategy.setup, which casts (precision plugins) and
            # broadcasts (DDP): the one point where every candidate must hold the same weights.
            if recorder.weights_hash is None:
                recorder.started(pl_module, int(trainer.global_rank))
            setup(trainer_)

        def recorded_backward(closure_loss: Tensor, *args: Any, **kwargs: Any) -> Any:
            if recorder.device is None:  # a backward before the first batch started
                recorder.use(plugin, pl_module.device)
            recorder.backward(closure_loss, kwargs.get("loss_id", 0))
            return backward(closure_loss, *args, **kwargs)

        def hashed_convert_input(data: Any) -> Any:
            # The training loop casts a batch here (apex O2, "16-true", ...) before it moves it to the device.
            if recorder.batch_hash is None and trainer.training:
                recorder.batch_hash = hash_batch(data)
            return convert_input(data)

        self._restore = [
            shadow(strategy, "setup", setup_after_restore),
            shadow(strategy, "backward", recorded_backward),
            shadow(plugin, "convert_input", hashed_convert_input),
        ]

    def _training(self) -> bool:
        """Whether this is the first fit, still going: any later fit, of this Trainer or another, is not recorded."""
        return self._active and not self._finished

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._training():
            return
        recorder = self.recorder
        if recorder.batch_hash is None:  # a training_step that takes the dataloader_iter: nothing was cast
            recorder.batch_hash = hash_batch(batch)
        device = recorder.device
        if device is None:  # the LightningModule's, placed by now
            device = torch.device(pl_module.device)
            recorder.use(self._plugin, device)
        if self._opened is None:
            self._opened = recorder.clock()
        if len(recorder.overflows) < overflow.MAX_LOCATED:
            self._batch = (batch, batch_idx, random_state(device))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._training():
            return
        recorder = self.recorder
        overflowed = recorder.before_step(optimizer, trainer.global_step, check=self._batch is not None)
        self._stepped.append((len(recorder.steps) - 1, optimizer))
        if overflowed:  # a loss that is not finite: located before the optimizer applies what it gave
            self._locate(pl_module, self._plugin, len(recorder.steps) - 1)

    def _locate(self, pl_module: Any, plugin: Any, index: int) -> None:
        """Where the overflow of step ``index`` happened: its batch trained again (:func:`overflow.locate`); at most
        once per batch (the batch is then let go)."""
        assert self._batch is not None
        (batch, batch_idx, rng), self._batch = self._batch, None
        scale = self.recorder.steps[index].scale
        self.recorder.overflows.append(
            overflow.locate(
                pl_module,
                batch,
                batch_idx,
                step=self.recorder.steps[index].step,
                scale=None if scale is None else float(scale),
                rng=rng,
                context=plugin.train_step_context,
            )
        )

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._training() or not self._stepped:
            return  # an accumulation window goes on
        plugin, recorder = self._plugin, self.recorder
        # a step's scale after it: the next step's before it; the last one's now
        after = [recorder.steps[index].scale for index, _ in self._stepped[1:]] + [None]
        for (index, optimizer), scale_after in zip(self._stepped, after, strict=True):
            check = self._batch is not None
            if recorder.after_step(index, optimizer, self._opened, check=check, scale_after=scale_after):
                self._locate(pl_module, plugin, index)  # skipped: the weights are the ones the step started from
        self._stepped = []
        self._opened = None
        self._batch = None
        done = recorder.steps[-1].step + 1  # trainer.global_step, without its chain of properties at every batch
        if recorder.snapshots_due(done):  # the first batch at or past a snapshot
            weights = functools.partial(trained_weights, [("", pl_module)], plugin)
            recorder.snapshot(weights, done, int(trainer.global_rank))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._evaluated(trainer, VALIDATE)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._evaluated(trainer, TEST)

    def _evaluated(self, trainer: Any, stage: Stage) -> None:
        """Keep what the script logged in this validation or test run, as rank 0 holds it (what loggers write)."""
        if trainer.sanity_checking or trainer.global_rank != 0:
            return
        owner = type(self).first or self  # the first fit's recording, whichever Trainer evaluates
        metrics = self._evaluation_metrics(trainer)
        # Another Trainer's steps start again at 0 (or its checkpoint's): its evaluation is put where the fit ended.
        step = int(trainer.global_step) if owner is self or owner.final_step is None else owner.final_step
        owner.recorder.add_evaluation({"stage": stage, "step": step, "metrics": metrics})

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A run that crashes keeps the steps it took: each rank writes its own, since no collective is safe now."""
        if not self._training():
            return
        for restore in self._restore:
            restore()
        self._restore = []
        try:
            record = self.recorder.rank_record(int(trainer.global_rank), pl_module.device)
        except Exception:  # a device that failed cannot be read back; the error to report is the script's
            return
        path = Path(self.plan.directory) / partial_file(int(trainer.global_rank))
        header = self.recorder.header(ran_as(trainer.precision_plugin), 1)
        path.write_text(json.dumps({**header, "ranks": [record], "crashed": repr(exception)}))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._training():
            return
        self._finished, self.final_step = True, int(trainer.global_step)
        for restore in self._restore:
            restore()
        self._restore = []
        record = self.recorder.rank_record(int(trainer.global_rank), pl_module.device)
        records = [record]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            records = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(records, record)
        if trainer.global_rank != 0:
            return
        plugin = trainer.precision_plugin
        save_fp32(trained_weights([("", pl_module)], plugin), Path(self.plan.directory) / FINAL_WEIGHTS)
        self.recorder.write_record(self.recorder.header(ran_as(plugin), len(records)), records)


def shadow(owner: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Put ``replacement`` on this one object (not its class); returns what puts the object back as it was."""
    had, before = name in vars(owner), vars(owner).get(name)
    setattr(owner, name, replacement)

    def restore() -> None:
        if had:
            setattr(owner, name, before)
        else:
            delattr(owner, name)

    return restore
