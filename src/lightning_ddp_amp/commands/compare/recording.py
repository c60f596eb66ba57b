"""Inside each run of ``lightning-ddp-amp compare``: what each optimizer step of the script's first ``fit`` did.

:mod:`~lightning_ddp_amp.commands.compare.patching` adds a :class:`Recording` callback to every Trainer of the run; the one
of the process's first ``fit`` records it.

A *step* is one call of an optimizer's ``step`` through Lightning, skipped AMP steps included; that is what
Lightning's ``global_step`` and ``max_steps`` count, and ``max_steps`` ends ``fit`` even before ``min_steps`` or
``min_epochs`` (those only hold back ``should_stop``). Per step the callback keeps, on the device: the loss
(the sum of the losses given to backward since the previous step, so the mean of an accumulation window), the
global norm of the gradients of what the optimizer steps (before clipping, after unscaling), the loss scale, whether
the step was skipped, the learning rate and the step's time (CUDA events on a GPU). One value is read back per step:
whether the gradient norm is finite (as loss scalers read their overflow flag); when it is not,
:mod:`~lightning_ddp_amp.commands.compare.overflow` locates where. The rest stays on the device until ``fit`` ends; then one
``all_gather_object`` brings every rank's record to rank 0, which writes ``record.json`` and the final weights
(:mod:`~lightning_ddp_amp.commands.compare.run_folder`).

Along the way: at the plan's snapshot steps the baseline's rank 0 saves its weights and any other run's rank 0
measures its distance to them; each validation and test run's logged metrics are kept (and the record rewritten
for a ``validate`` or ``test`` after ``fit``); a run that raises keeps its steps, each rank in its own file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ddp_amp.commands.compare import overflow, run_folder
from lightning_ddp_amp.commands.compare.run_folder import (
    FINAL_WEIGHTS,
    START_WEIGHTS,
    Plan,
    partial_file,
    snapshot_file,
)
from lightning_ddp_amp.commands.compare.schema import (
    CUDA_MAX_MEMORY_ALLOCATED,
    PROCESS_MAX_RSS,
    TEST,
    VALIDATE,
    Evaluation,
    Stage,
)
from lightning_ddp_amp.commands.compare.summary import weight_distance
from lightning_ddp_amp.commands.compare.tensors import fp32, hash_batch, hash_tensors, one_ulp_up, save_fp32


@dataclasses.dataclass
class Changes:
    """What the patched Trainer or Fabric changed, as rank 0 says it and the report lists it."""

    replaced: list[str] = dataclasses.field(default_factory=list)
    turned_off: list[str] = dataclasses.field(default_factory=list)
    door: str = "Trainer"

    def describe(self, candidate: str) -> str:
        lines = [f"lightning-ddp-amp compare [{candidate}]: this run's {self.door} was changed:"]
        lines += [f"  {line}" for line in self.replaced]
        lines += [f"  turned off {name}: it cannot write into the candidate's folder" for name in self.turned_off]
        return "\n".join(lines)


def ran_as(plugin: Any) -> str:
    """What a precision plugin trains with, in a few words: ``"native amp O1"``, ``"MixedPrecision 16-mixed"``."""
    if hasattr(plugin, "amp_backend"):
        return f"{plugin.backend} amp {plugin.opt_level}"
    return f"{type(plugin).__name__} {getattr(plugin, 'precision', '')}".strip()


class Recording:
    """The callback of a compare run; :func:`~lightning_ddp_amp.commands.compare.patching.patch` mixes it with the
    namespace's ``Callback``.

    Args:
        plan: The run's plan.
        changes: What the Trainer's arguments were changed to; rank 0 says them when the first ``fit`` starts, and the
            record lists them.
        redirect_checkpoints: Points the Trainer's ModelCheckpoints into the run's folder; called again when ``fit``
            starts, for those ``LightningModule.configure_callbacks()`` added.
        evaluation_metrics: What the script logged in the validation or test run that is ending
            (:func:`lightning_ddp_amp._lightning.evaluation_metrics` of the Trainer's namespace).
    """

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
        self._redirect_checkpoints = redirect_checkpoints
        self._evaluation_metrics = evaluation_metrics
        self._active = False  # this recording's Trainer runs the process's first fit
        self._finished = False  # that fit ended (on every rank): nothing more is recorded as training
        self.final_step: int | None = None  # the global step that fit ended at
        self.weights_hash: str | None = None
        self.batch_hash: str | None = None
        self._pending_loss: Tensor | None = None
        self._loss: list[Tensor] = []
        self._grad_norm: list[Tensor] = []
        self._loss_scale: list[Tensor | float | None] = []
        self._skipped: list[Tensor | bool] = []
        self._lr: list[float] = []
        self._step: list[int] = []
        self._times: list[tuple[Any, Any]] = []
        self._opened: Any = None
        self._stepped: list[tuple[int, Any]] = []  # (index, optimizer) of this batch's steps
        self._pending_scale: Tensor | float | None = None
        self._restore: list[Callable[[], None]] = []
        self._batch: tuple[Any, int, tuple[Tensor, Tensor | None]] | None = None  # for locating an overflow
        self._overflows: list[dict[str, Any]] = []
        self._distances: list[tuple[int, float | None]] = []  # (global step, weight distance to the baseline's)
        self._snapshot_steps: list[int] = []  # the global steps the weights were measured at
        self._snapshots_reached: list[int] = []  # the plan's snapshots those measurements stand for
        self._baseline_start: dict[str, Tensor] | None = None  # read once, at the first snapshot
        self._evaluations: list[Evaluation] = []
        self._document: dict[str, Any] | None = None

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
        setup, backward, convert_input = strategy.setup, strategy.backward, plugin.convert_input

        def setup_after_restore(trainer_: Any) -> None:
            # Lightning restores a checkpoint's weights before strategy.setup, which casts (precision plugins) and
            # broadcasts (DDP): the one point where every candidate must hold the same weights.
            if self.weights_hash is None:
                state = pl_module.state_dict()
                self.weights_hash = hash_tensors(state)
                if self.plan.save_start and trainer.global_rank == 0:
                    save_fp32(state, Path(self.plan.directory) / START_WEIGHTS)
                if self.plan.perturb:
                    one_ulp_up(pl_module)
            setup(trainer_)

        def recorded_backward(closure_loss: Tensor, *args: Any, **kwargs: Any) -> Any:
            loss = closure_loss.detach().float()
            if self._pending_loss is None:  # the step's first backward: the scale it runs under (apex updates it
                self._pending_scale = _loss_scale(plugin)  # as its backward ends, torch's scaler at step())
            self._pending_loss = loss if self._pending_loss is None else self._pending_loss + loss
            return backward(closure_loss, *args, **kwargs)

        def hashed_convert_input(data: Any) -> Any:
            # The training loop casts a batch here (apex O2, "16-true", ...) before it moves it to the device.
            if self.batch_hash is None and trainer.training:
                self.batch_hash = hash_batch(data)
            return convert_input(data)

        self._restore = [
            _shadow(strategy, "setup", setup_after_restore),
            _shadow(strategy, "backward", recorded_backward),
            _shadow(plugin, "convert_input", hashed_convert_input),
        ]

    def _training(self) -> bool:
        """Whether this is the first fit, still going: any later fit, of this Trainer or another, is not recorded."""
        return self._active and not self._finished

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._training():
            return
        if self.batch_hash is None:  # a training_step that takes the dataloader_iter: nothing was cast
            self.batch_hash = hash_batch(batch)
        if self._opened is None:
            self._opened = _now(pl_module.device)
        if len(self._overflows) < overflow.MAX_LOCATED:
            device = torch.device(pl_module.device)
            cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
            self._batch = (batch, batch_idx, (torch.get_rng_state(), cuda_rng))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._training():
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms = [torch.linalg.vector_norm(grad.detach(), dtype=torch.float32) for grad in grads]
        device = grads[0].device if grads else pl_module.device
        self._grad_norm.append(
            torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=device)
        )
        loss = self._pending_loss
        self._loss.append(loss if loss is not None else torch.full((), float("nan"), device=device))
        self._pending_loss = None
        scale = self._pending_scale if loss is not None else _loss_scale(trainer.precision_plugin)
        self._loss_scale.append(scale)
        self._pending_scale = None
        self._lr.append(float(optimizer.param_groups[0]["lr"]))
        self._step.append(int(trainer.global_step))
        self._stepped.append((len(self._step) - 1, optimizer))
        # The one device read per step: whether this step's gradients are finite (loss scalers read as much).
        if (
            self._batch is not None
            and not bool(torch.isfinite(self._grad_norm[-1]))
            and not all(bool(torch.isfinite(grad).all()) for grad in grads)  # not only the norm overflowing fp32
        ):
            batch, batch_idx, rng = self._batch
            self._overflows.append(
                overflow.locate(
                    pl_module,
                    batch,
                    batch_idx,
                    step=int(trainer.global_step),
                    scale=None if scale is None else float(scale),
                    rng=rng,
                    context=trainer.precision_plugin.train_step_context,
                )
            )

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._training() or not self._stepped:
            return  # an accumulation window goes on
        closed = _now(pl_module.device)
        plugin = trainer.precision_plugin
        after = [self._loss_scale[index] for index, _ in self._stepped[1:]] + [_loss_scale(plugin)]
        for (index, optimizer), scale_after in zip(self._stepped, after, strict=True):
            self._times.append((self._opened, closed))
            scale = self._loss_scale[index]
            if hasattr(plugin, "step_skipped"):
                self._skipped.append(bool(plugin.step_skipped(optimizer)))
            elif isinstance(scale, Tensor) and isinstance(scale_after, Tensor):
                self._skipped.append(scale_after < scale)  # torch's scaler backs off exactly when it skipped a step
            else:
                self._skipped.append(False)
        self._stepped = []
        self._opened = None
        self._batch = None
        done = int(trainer.global_step)
        due = [step for step in self.plan.snapshots if step <= done and step not in self._snapshots_reached]
        if due:  # the first batch at or past a snapshot: steps go up by more than one where two optimizers step
            self._snapshots_reached += due
            self._snapshot_steps.append(done)
            self._snapshot(trainer, pl_module, done)

    def _snapshot(self, trainer: Any, pl_module: Any, done: int) -> None:
        """The baseline keeps its weights after ``done`` steps; any other run measures how far it is from them."""
        if trainer.global_rank != 0 or self.plan.baseline_directory is None:
            return
        weights = fp32(_trained_weights(pl_module, trainer.precision_plugin))
        folder = Path(self.plan.baseline_directory)
        if self.plan.save_start:
            torch.save(weights, folder / snapshot_file(done))
            return
        try:
            base = torch.load(folder / snapshot_file(done), map_location="cpu")
            if self._baseline_start is None:
                self._baseline_start = torch.load(folder / START_WEIGHTS, map_location="cpu")
        except FileNotFoundError:  # the baseline stopped earlier
            return
        self._distances.append((done, weight_distance(weights, base, self._baseline_start)))

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
        owner.add_evaluation({"stage": stage, "step": step, "metrics": metrics})

    def add_evaluation(self, evaluation: Evaluation) -> None:
        """Keep a validation or test run's metrics; after fit the record is rewritten with them."""
        self._evaluations.append(evaluation)
        if self._document is not None:
            self._write()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A run that crashes keeps the steps it took: each rank writes its own, since no collective is safe now."""
        if not self._training():
            return
        for restore in self._restore:
            restore()
        self._restore = []
        try:
            self._pad_series()
            record = self._rank_record(trainer, pl_module)
        except Exception:  # a device that failed cannot be read back; the error to report is the script's
            return
        path = Path(self.plan.directory) / partial_file(int(trainer.global_rank))
        path.write_text(json.dumps({**self._header(trainer, 1), "ranks": [record], "crashed": repr(exception)}))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._training():
            return
        self._finished, self.final_step = True, int(trainer.global_step)
        for restore in self._restore:
            restore()
        self._restore = []
        self._pad_series()
        record = self._rank_record(trainer, pl_module)
        records = [record]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            records = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(records, record)
        if trainer.global_rank != 0:
            return
        save_fp32(_trained_weights(pl_module, trainer.precision_plugin), Path(self.plan.directory) / FINAL_WEIGHTS)
        self._document = {**self._header(trainer, len(records)), "ranks": sorted(records, key=lambda r: r["rank"])}
        self._write()

    def _header(self, trainer: Any, world_size: int) -> dict[str, Any]:
        return {
            "candidate": self.plan.candidate,
            "precision": self.plan.precision,
            "world_size": world_size,
            "ran_as": ran_as(trainer.precision_plugin),
            # torchrun --max-restarts: an attempt that failed wrote nothing; this one's series starts where it did.
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "replaced": self.changes.replaced,
            "turned_off": self.changes.turned_off,
        }

    def _write(self) -> None:
        assert self._document is not None
        document = {**self._document, "evaluations": self._evaluations, "weight_distances": self._distances}
        run_folder.write_record(Path(self.plan.directory), document)

    def _pad_series(self) -> None:
        """A step outside a training batch (an optimizer stepped in another hook) has no batch time or skip flag."""
        missing = len(self._step) - len(self._skipped)
        self._skipped += [False] * missing
        self._times += [(None, None)] * missing

    # -- the record --------------------------------------------------------------------------------------------------

    def _rank_record(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        """This rank's series, read back from the device once."""
        device = pl_module.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            times = [math.nan if start is None else start.elapsed_time(end) / 1000 for start, end in self._times]
            peak = int(torch.cuda.max_memory_allocated(device))
        else:
            times = [math.nan if start is None else end - start for start, end in self._times]
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        return {
            "rank": int(trainer.global_rank),
            "weights_hash": self.weights_hash,
            "batch_hash": self.batch_hash,
            "step": self._step,
            "loss": _floats(self._loss),
            "grad_norm": _floats(self._grad_norm),
            "loss_scale": [None if s is None else float(s) for s in self._loss_scale],
            "skipped": [bool(s) for s in self._skipped],
            "lr": self._lr,
            "step_time_s": times,
            "peak_memory_bytes": peak,
            "peak_memory_kind": CUDA_MAX_MEMORY_ALLOCATED if device.type == "cuda" else PROCESS_MAX_RSS,
            "overflows": self._overflows,
            # The step after each snapshot: the other ranks wait in it for rank 0, which saved or read weights.
            "slowed_steps": list(self._snapshot_steps),
        }


def _floats(values: list[Tensor]) -> list[float]:
    return torch.stack(values).cpu().tolist() if values else []


def _now(device: torch.device) -> Any:
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event
    return time.perf_counter()


def _loss_scale(plugin: Any) -> Tensor | float | None:
    """The loss scale the next backward runs under, read without a device sync; None without loss scaling."""
    if hasattr(plugin, "amp_backend"):  # AmpPrecision keeps it on the host
        scale: float | None = plugin.current_loss_scale
        return scale
    scaler = getattr(plugin, "scaler", None)  # Lightning's MixedPrecision: torch's GradScaler
    if scaler is None:
        return None
    # Why the private method: get_scale() syncs. None until the scaler's first scale(), which the step-0 backward runs
    # under: then get_scale() is the initial scale, read without a sync.
    tensor: Tensor | None = scaler._get_scale_async()
    if tensor is None:
        return torch.tensor(float(scaler.get_scale())) if scaler.is_enabled() else None
    return tensor.detach().clone()


def _shadow(owner: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Put ``replacement`` on this one object (not its class); returns what puts the object back as it was."""
    had, before = name in vars(owner), vars(owner).get(name)
    setattr(owner, name, replacement)

    def restore() -> None:
        if had:
            setattr(owner, name, before)
        else:
            delattr(owner, name)

    return restore


def _trained_weights(pl_module: Any, plugin: Any) -> dict[str, Tensor]:
    """The LightningModule's state, with apex O2's fp32 masters in place of the fp16 weights they train."""
    state: dict[str, Tensor] = pl_module.state_dict()
    if hasattr(plugin, "put_fp32_masters"):  # AmpPrecision
        plugin.put_fp32_masters(state, pl_module)
    return state
