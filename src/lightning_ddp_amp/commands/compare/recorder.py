"""Inside each run of ``lightning-ddp-amp compare``: what each optimizer step did, kept the same way whichever door
(a Trainer's ``fit`` or a Fabric's kept loop) the script trains through.

:class:`Recorder` knows the run's plan and nothing of Lightning: the door's glue
(:mod:`~lightning_ddp_amp.commands.compare.recording` for the Trainer,
:mod:`~lightning_ddp_amp.commands.compare.fabric_recording` for Fabric) calls it at each point of a step. Per step it
keeps, on the device: the loss (the sum of the losses given to backward since the previous step, per ``loss_id``),
the loss scale, whether the step was skipped, the learning rate and the step's time (CUDA events on a GPU); and, at
every ``plan.grad_norm_every``-th step only, the global norm of the gradients of what the optimizer steps (before
clipping, after unscaling): one more read of every gradient, the one cost of the recording that grows with the model.
While overflows are still located, whether the step overflowed is read back: before the step, its loss (one value,
kept as a float: whether it is finite); after it, whether the loss scaler skipped it (read where the scaler already
decided, on the host for apex). The rest stays on the device until the run ends (:meth:`Recorder.rank_record`). One
:class:`StepRecord` per step holds it all; what the precision plugin is read for (the clock, the loss scale, the skip
flag) is looked up once (:meth:`Recorder.use`).

At the plan's snapshot steps the baseline's rank 0 saves its weights and any other run's rank 0 measures its
distance to them (:meth:`Recorder.snapshot`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_ddp_amp.amp.checkpoint_weights import put_fp32_masters
from lightning_ddp_amp.commands.compare import run_folder
from lightning_ddp_amp.commands.compare.run_folder import START_WEIGHTS, Plan, snapshot_file
from lightning_ddp_amp.commands.compare.schema import CUDA_MAX_MEMORY_ALLOCATED, PROCESS_MAX_RSS, Evaluation
from lightning_ddp_amp.commands.compare.summary import weight_distance
from lightning_ddp_amp.commands.compare.tensors import fp32, hash_tensors, one_ulp_up


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


class StepRecord:
    """What one optimizer step recorded: before it (:meth:`Recorder.before_step`) and after it (``after_step``)."""

    __slots__ = ("closed", "loss", "loss_id", "losses", "lr", "norm", "opened", "scale", "skipped", "step")

    def __init__(
        self,
        step: int,
        loss: Tensor | float,
        loss_id: int,
        losses: Mapping[int, Tensor | float] | None,
        scale: Tensor | float | None,
        lr: float,
        norm: Tensor | None,
    ) -> None:
        self.step = step  #: the global step
        self.loss = loss  #: the sum of the losses given to backward since the previous step (on the device until read)
        self.loss_id = loss_id  #: the ``loss_id`` of a step's only loss
        self.losses = losses  #: the losses per ``loss_id`` where there were several, or none (else None)
        self.scale = scale  #: the loss scale the step's backward ran under (None without loss scaling)
        self.lr = lr  #: the first parameter group's learning rate
        self.norm = norm  #: the gradient norm; None at a step it was not measured at
        self.skipped: Tensor | bool = False  #: the loss scaler skipped it (a tensor until read back)
        self.opened: Any = None  #: when its time started and ended (clock values); None: not timed
        self.closed: Any = None

    def by_id(self) -> Mapping[int, Tensor | float]:
        """The step's losses per ``loss_id``."""
        return {self.loss_id: self.loss} if self.losses is None else self.losses


class Recorder:
    """The series of one rank of a compare run, and what is computed from them.

    Args:
        plan: The run's plan.
        changes: What the door's arguments were changed to; the record lists them.
    """

    def __init__(self, plan: Plan, changes: Changes) -> None:
        self.plan = plan
        self.changes = changes
        self.weights_hash: str | None = None
        self.batch_hash: str | None = None
        self._module_hashes: list[str] = []
        self._pending_loss: dict[int, Tensor] = {}  # per loss_id, since the previous step
        self._norm_every = plan.grad_norm_every
        self._pending_scale: Tensor | float | None = None
        self.steps: list[StepRecord] = []  # one per optimizer step, in order
        self.overflows: list[dict[str, Any]] = []
        self.distances: list[tuple[int, float | None]] = []  # (global step, weight distance to the baseline's)
        self._snapshot_steps: list[int] = []  # the global steps the weights were measured at
        self._snapshots_reached: list[int] = []  # the plan's snapshots those measurements stand for
        self._next_snapshot: float = min(plan.snapshots, default=math.inf)  # the first one not reached yet
        self._baseline_start: dict[str, Tensor] | None = None  # read once, at the first snapshot
        self.evaluations: list[Evaluation] = []
        self._document: dict[str, Any] | None = None
        # What each step reads, looked up once (:meth:`use`): the run's device, and of its precision plugin:
        self.device: torch.device | None = None
        self.clock: Callable[[], Any] = time.perf_counter
        self.scale: Callable[[], Tensor | float | None] = lambda: None
        self._step_skipped: Callable[[Any], Any] | None = None

    def use(self, plugin: Any, device: torch.device) -> None:
        """The run's precision plugin and device, as the door knows them before the first backward: what each step reads
        of them (the clock, the loss scale, the plugin's skip flag) is looked up here, once."""
        self.device = device
        self.clock = clock(device)
        self.scale = scale_reader(plugin)
        self._step_skipped = getattr(plugin, "step_skipped", None)

    # -- the start ---------------------------------------------------------------------------------------------------

    def started(self, module: Any, rank: int, prefix: str = "") -> None:
        """A model's weights as the run starts, before any cast or broadcast: hashed, saved by the baseline's rank 0,
        moved one ulp up for the noise floor. Several models (a Fabric loop's) each come once, named by ``prefix``;
        the run's hash is then the hash of theirs in order."""
        state = {f"{prefix}{name}": tensor for name, tensor in module.state_dict().items()}
        self._module_hashes.append(hash_tensors(state))
        joined = hashlib.sha256(":".join(self._module_hashes).encode()).hexdigest()
        self.weights_hash = self._module_hashes[0] if len(self._module_hashes) == 1 else joined
        if self.plan.save_start and rank == 0:
            path = Path(self.plan.directory) / START_WEIGHTS
            before = torch.load(path, map_location="cpu") if prefix and path.is_file() else {}
            torch.save({**before, **fp32(state)}, path)
        if self.plan.perturb:
            one_ulp_up(module)

    # -- a step ------------------------------------------------------------------------------------------------------

    def backward(self, loss: Tensor, loss_id: int = 0) -> None:
        """A loss handed to backward; the step's first backward also keeps the scale it runs under (apex updates it
        as its backward ends, torch's scaler at ``step()``). The usual one, a step's only float32 loss, is kept as given
        until :meth:`before_step` reads it (holding it after its backward keeps no graph buffer, and the loop holds it
        that long anyway); a second loss of the step is added detached."""
        pending = self._pending_loss
        if not pending:
            self._pending_scale = self.scale()
            if loss.dtype == torch.float32:
                pending[loss_id] = loss
                return
        loss = loss.detach().float()
        earlier = pending.get(loss_id)
        pending[loss_id] = loss if earlier is None else earlier.detach() + loss

    def has_pending_loss(self) -> bool:
        """Whether a loss was handed to backward since the previous step."""
        return bool(self._pending_loss)

    def measures_norm(self, step: int) -> bool:
        """Whether ``step``'s gradient norm is measured (``plan.grad_norm_every``)."""
        return step % self._norm_every == 0

    def before_step(self, optimizer: Any, step: int, *, check: bool, scaled_by: Tensor | float | None = None) -> bool:
        """Keep what ``optimizer`` is about to step with; returns whether the step overflowed, read from the device only
        when ``check`` (the door still locates overflows): its loss is not finite, or, at a step whose gradient norm is
        measured (:meth:`measures_norm`), its gradients are not. Such a step is located before the optimizer applies it,
        as no scaler may skip it (a step the scaler skips is located after it, :meth:`after_step`). ``scaled_by``: the
        loss scale the gradients still carry (an optimizer that unscales inside its own step), which the norm is divided
        by."""
        losses = self._pending_loss
        norm = None
        if self.measures_norm(step):
            norm = gradient_norm(optimizer, self.device)
            if scaled_by is not None:
                norm = norm / scaled_by
        loss_id, by_id = 0, None  # a step's only loss: no dict of it
        if len(losses) == 1:
            ((loss_id, total),) = losses.items()
            scale = self._pending_scale
            # The one value read before each step, while the door checks: the loss, kept as a float. Else it stays on
            # the device, detached, until the run ends.
            value: Tensor | float = total.item() if check else total.detach()
        else:
            detached = [loss.detach() for loss in losses.values()]
            by_id = dict(zip(losses, detached, strict=True))
            total = sum(detached) if detached else torch.full((), float("nan"), device=self.device)  # type: ignore[assignment]
            scale = self._pending_scale if detached else self.scale()
            value = total.item() if check and detached else total
        losses.clear()  # the next step's, in the same dict
        self._pending_scale = None
        lr = float(optimizer.param_groups[0]["lr"])
        self.steps.append(StepRecord(step, value, loss_id, by_id, scale, lr, norm))
        if not check:
            return False
        if isinstance(value, float) and not math.isfinite(value):  # read: the step had a loss
            return True
        return norm is not None and not bool(torch.isfinite(norm)) and not gradients_finite(optimizer)

    def after_step(
        self, index: int, optimizer: Any, opened: Any, *, check: bool = False, scale_after: Tensor | float | None = None
    ) -> bool:
        """Step ``index`` ran, its time counted from ``opened`` (a :attr:`clock` value; None: not timed); whether it
        was skipped: AmpPrecision says so; torch's scaler backs off exactly when it skipped a step (``scale_after``: the
        scale once the step ran, read now by default). Returns it, read from the device only when ``check`` (the door
        locates a skipped step's overflow after it: a skipped step left the weights as they were)."""
        record = self.steps[index]
        if opened is not None:
            record.opened, record.closed = opened, self.clock()
        if self._step_skipped is not None:
            record.skipped = skipped = bool(self._step_skipped(optimizer))
        elif isinstance(record.scale, Tensor):
            after = self.scale() if scale_after is None else scale_after
            record.skipped = skipped = isinstance(after, Tensor) and after < record.scale  # type: ignore[assignment]
        else:
            return False
        return check and bool(skipped)

    # -- along the way -----------------------------------------------------------------------------------------------

    def snapshots_due(self, done: int) -> bool:
        """Whether ``done`` steps reach a plan snapshot not measured yet (steps go up by more than one where two
        optimizers step in a batch); marks them measured."""
        if done < self._next_snapshot:  # every step asks: the answer is mostly this comparison
            return False
        due = [step for step in self.plan.snapshots if step <= done and step not in self._snapshots_reached]
        self._next_snapshot = min((s for s in self.plan.snapshots if s > done), default=math.inf)
        if due:
            self._snapshots_reached += due
            self._snapshot_steps.append(done)
        return bool(due)

    def snapshot(self, weights: Callable[[], dict[str, Tensor]], done: int, rank: int) -> None:
        """The baseline keeps its weights after ``done`` steps; any other run measures how far it is from them."""
        if rank != 0 or self.plan.baseline_directory is None:
            return
        state = fp32(weights())
        folder = Path(self.plan.baseline_directory)
        if self.plan.save_start:
            torch.save(state, folder / snapshot_file(done))
            return
        try:
            base = torch.load(folder / snapshot_file(done), map_location="cpu")
            if self._baseline_start is None:
                self._baseline_start = torch.load(folder / START_WEIGHTS, map_location="cpu")
        except FileNotFoundError:  # the baseline stopped earlier
            return
        self.distances.append((done, weight_distance(state, base, self._baseline_start)))

    def add_evaluation(self, evaluation: Evaluation) -> None:
        """Keep a validation, test or logged run's metrics; a record already written is rewritten with them."""
        self.evaluations.append(evaluation)
        if self._document is not None:
            self._write()

    # -- the record --------------------------------------------------------------------------------------------------

    def header(self, ran_as: str, world_size: int) -> dict[str, Any]:
        """What ``record.json`` says of the run besides its ranks."""
        return {
            "candidate": self.plan.candidate,
            "precision": self.plan.precision,
            "door": self.changes.door,  # "Trainer" or "Fabric": how a fix the report gives is worded
            "world_size": world_size,
            "ran_as": ran_as,
            # torchrun --max-restarts: an attempt that failed wrote nothing; this one's series starts where it did.
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "replaced": self.changes.replaced,
            "turned_off": self.changes.turned_off,
        }

    def write_record(self, header: dict[str, Any], records: Sequence[dict[str, Any]]) -> None:
        """Write ``record.json`` with every rank's record; later evaluations rewrite it."""
        self._document = {**header, "ranks": sorted(records, key=lambda r: r["rank"])}
        self._write()

    def document(self) -> dict[str, Any]:
        """The record as written: the header and ranks given, then what was added since."""
        assert self._document is not None
        return {**self._document, "evaluations": self.evaluations, "weight_distances": self.distances}

    def _write(self) -> None:
        run_folder.write_record(Path(self.plan.directory), self.document())

    def rank_record(self, rank: int, device: torch.device) -> dict[str, Any]:
        """This rank's series, read back from the device once."""
        steps = self.steps
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            times = [math.nan if r.opened is None else r.opened.elapsed_time(r.closed) / 1000 for r in steps]
            peak = int(torch.cuda.max_memory_allocated(device))
        else:
            times = [math.nan if r.opened is None else r.closed - r.opened for r in steps]
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        record: dict[str, Any] = {
            "rank": rank,
            "weights_hash": self.weights_hash,
            "batch_hash": self.batch_hash,
            "step": [r.step for r in steps],
            "loss": floats([r.loss for r in steps]),
            "grad_norm": sparse_floats([r.norm for r in steps]),
            "loss_scale": [None if r.scale is None else float(r.scale) for r in steps],
            "skipped": [bool(r.skipped) for r in steps],
            "lr": [r.lr for r in steps],
            "step_time_s": times,
            "peak_memory_bytes": peak,
            "peak_memory_kind": CUDA_MAX_MEMORY_ALLOCATED if device.type == "cuda" else PROCESS_MAX_RSS,
            "overflows": self.overflows,
            # The step after each snapshot: the other ranks wait in it for rank 0, which saved or read weights.
            "slowed_steps": list(self._snapshot_steps),
        }
        by_id = [r.by_id() for r in steps]
        ids = sorted({loss_id for losses in by_id for loss_id in losses})
        if len(ids) > 1:  # several losses per step (num_losses): each kept beside their sum, read back in one go
            given = iter(floats([loss for losses in by_id for loss in losses.values()]))
            read = [{loss_id: next(given) for loss_id in losses} for losses in by_id]
            # None where the step had no loss of that id (a GAN's generator step has none of the discriminator's):
            # NaN stays what an overflowed loss reads as.
            record["loss_by_id"] = {str(loss_id): [losses.get(loss_id) for losses in read] for loss_id in ids}
        return record


def floats(values: Sequence[Tensor | float]) -> list[float]:
    """Each value as a float: those still on the device read back in one go."""
    tensors = [value for value in values if isinstance(value, Tensor)]
    if not tensors:
        return [float(value) for value in values]
    read = iter(torch.stack(tensors).cpu().tolist())
    return [next(read) if isinstance(value, Tensor) else float(value) for value in values]


def sparse_floats(values: list[Tensor | None]) -> list[float | None]:
    """:func:`floats` of a series measured at some steps only: None stays None."""
    measured = iter(floats([value for value in values if value is not None]))
    return [None if value is None else next(measured) for value in values]


def gradient_norm(optimizer: Any, device: torch.device | None) -> Tensor:
    """The global norm of the gradients ``optimizer`` is about to step with, on their device: each float32 gradient's
    sum of squares as one ``dot`` (one read, and closer to the float64 norm than a norm per tensor: 1e-8 against 6e-7
    relative on the bench MLP), any other's in float32, then the root of their sum (no tensor of all the gradients at
    once). A norm past 1.8e19 reads as inf (its squares overflow float32); the check for non-finite gradients then
    reads the gradients themselves."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    with torch.no_grad():  # gradients of a create_graph backward: no graph of the norm
        squares = [
            torch.dot(grad.view(-1), grad.view(-1))
            if grad.dtype == torch.float32 and grad.layout == torch.strided and grad.is_contiguous()
            else torch.linalg.vector_norm(grad, dtype=torch.float32).square()
            for grad in grads
        ]
        norm: Tensor = torch.stack(squares).sum().sqrt()
    return norm


def gradients_finite(optimizer: Any) -> bool:
    """Whether every gradient ``optimizer`` steps with is finite (a norm can overflow float32 on finite ones)."""
    params = (p for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
    return all(bool(torch.isfinite(p.grad).all()) for p in params)


def clock(device: torch.device) -> Callable[[], Any]:
    """What reads a point in time on ``device``: a recorded CUDA event, or the host's clock."""
    if device.type == "cuda":

        def event() -> Any:
            recorded = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            recorded.record()
            return recorded

        return event
    return time.perf_counter


def scale_reader(plugin: Any) -> Callable[[], Tensor | float | None]:
    """What reads the loss scale the next backward of ``plugin`` runs under, without a device sync (None without loss
    scaling)."""
    if hasattr(plugin, "amp_backend"):  # AmpPrecision keeps it on the host
        return lambda: plugin.current_loss_scale
    scaler = getattr(plugin, "scaler", None)  # Lightning's MixedPrecision: torch's GradScaler
    if scaler is None:
        return lambda: None
    return functools.partial(_scaler_scale, scaler)


def _scaler_scale(scaler: Any) -> Tensor | None:
    # Why the private method: get_scale() syncs. None until the scaler's first scale(), which the step-0 backward runs
    # under: then get_scale() is the initial scale, read without a sync.
    tensor: Tensor | None = scaler._get_scale_async()
    if tensor is None:
        return torch.tensor(float(scaler.get_scale())) if scaler.is_enabled() else None
    return tensor.detach().clone()


def trained_weights(modules: Sequence[tuple[str, Any]], plugin: Any) -> dict[str, Tensor]:
    """The models' states, each name after its prefix, with apex O2's fp32 masters in place of the fp16 weights they
    train (either door's AmpPrecision)."""
    pairs = plugin.amp_backend.master_weight_pairs() if hasattr(plugin, "amp_backend") else []
    state: dict[str, Tensor] = {}
    for prefix, module in modules:
        own: dict[str, Tensor] = module.state_dict()
        put_fp32_masters(own, module, pairs)
        state.update({f"{prefix}{name}": tensor for name, tensor in own.items()})
    return state
