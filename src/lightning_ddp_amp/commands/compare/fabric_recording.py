"""Inside each run of ``lightning-ddp-amp compare``: what each optimizer step of a kept loop (a Fabric script) did.

:mod:`~lightning_ddp_amp.commands.compare.fabric_patching` attaches a :class:`FabricRecording` to the process's first
``Fabric(...)``. It records through the same :class:`~lightning_ddp_amp.commands.compare.recorder.Recorder` as the
Trainer's callback, from what it puts on that one Fabric and its precision plugin (on the instances, never the
classes):

* the plugin's ``convert_module``, the first thing ``fabric.setup``, ``setup_module`` and ``setup_models`` do to a
  model: its starting weights are hashed (and moved one ulp up for the noise floor) before any cast or broadcast;
  every model is kept in setup order, its weights named ``module{i}.{name}``;
* the plugin's ``convert_input``, which each set-up model's forward calls: the first batch's hash, and where a step's
  time starts (the first forward with gradients after the previous step);
* ``fabric.backward``: the loss, per ``loss_id``;
* each set-up optimizer's ``step``: the recorder before and after it, then the snapshots and the end;
* ``fabric.log_dict`` (which ``fabric.log`` calls): rank 0's scalars, as evaluations of stage ``logged``.

There is no ``fit`` to return from, so every rank writes its own record (:func:`~run_folder.rank_file`), which
``compare`` merges after the run (:func:`~run_folder.merge_rank_records`): after the ``--steps``-th step (then every
rank waits for the others, the process group is destroyed and ``SystemExit(0)`` is raised from inside ``step``), at
the script's own end (``atexit``), or, partially, when the script raises.
"""

from __future__ import annotations

import atexit
import json
import numbers
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from lightning_ddp_amp.commands.compare import overflow
from lightning_ddp_amp.commands.compare.model_calls import ModelCalls, Watched
from lightning_ddp_amp.commands.compare.recorder import Changes, Recorder, ran_as, trained_weights
from lightning_ddp_amp.commands.compare.recording import shadow
from lightning_ddp_amp.commands.compare.run_folder import FINAL_WEIGHTS, Plan, partial_file, rank_file
from lightning_ddp_amp.commands.compare.schema import LOGGED
from lightning_ddp_amp.commands.compare.tensors import hash_batch, save_fp32
from lightning_ddp_amp.errors import CompareScriptError


class FabricRecording:
    """Records the kept loop of one Fabric.

    Args:
        fabric: The script's Fabric, just built.
        plan: The run's plan.
        changes: What the Fabric's arguments were changed to; rank 0 says them at the first setup, the record lists
            them.
    """

    def __init__(self, fabric: Any, plan: Plan, changes: Changes) -> None:
        self.plan = plan
        self.recorder = Recorder(plan, changes)
        self._fabric = fabric
        self._modules: list[Any] = []  # every model set up, in setup order, as the script built it
        self._opened: Any = None  # where the coming step's time starts
        self._written = False  # this rank's record is written: nothing more is recorded
        self._backward_seen = False  # a loss went through fabric.backward: a later step without one is a NaN loss
        self._calls = ModelCalls()  # each set-up model's calls of the coming step, to locate an overflow
        self._watching: list[Watched] = []
        self._plugin = plugin = fabric.strategy.precision
        self._last_step = plan.first_step + plan.steps  # --steps ends the run once this many steps are done
        convert_module, convert_input = plugin.convert_module, plugin.convert_input
        backward, log_dict = fabric.backward, fabric.log_dict
        setup, setup_optimizers = fabric.setup, fabric.setup_optimizers

        def started_convert_module(module: Any) -> Any:
            if not any(module is known for known in self._modules):
                self._started(module)
            return convert_module(module)

        def timed_convert_input(data: Any) -> Any:
            if torch.is_grad_enabled() and not self._written:  # an evaluation's forward is no step's
                recorder = self.recorder
                if self._opened is None:
                    if recorder.device is None:
                        recorder.use(plugin, fabric.device)  # set up by now
                    self._opened = recorder.clock()
                if recorder.batch_hash is None:
                    recorder.batch_hash = hash_batch(data)
            return convert_input(data)

        def recorded_backward(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self._written:
                self._backward_seen = True
                recorder = self.recorder
                if recorder.device is None:  # no forward of a set-up model came first
                    recorder.use(plugin, fabric.device)
                recorder.backward(tensor, kwargs.get("loss_id", 0))
            return backward(tensor, *args, **kwargs)

        def recorded_log_dict(metrics: Mapping[str, Any], step: int | None = None) -> None:
            self._logged(metrics)
            log_dict(metrics, step=step)

        def recorded_setup(*args: Any, **kwargs: Any) -> Any:
            return self._stepped_through(setup(*args, **kwargs))

        def recorded_setup_optimizers(*optimizers: Any) -> Any:
            return self._stepped_through(setup_optimizers(*optimizers))

        shadow(plugin, "convert_module", started_convert_module)
        shadow(plugin, "convert_input", timed_convert_input)
        shadow(fabric, "backward", recorded_backward)
        shadow(fabric, "log_dict", recorded_log_dict)
        shadow(fabric, "setup", recorded_setup)
        shadow(fabric, "setup_optimizers", recorded_setup_optimizers)

    # -- setup -------------------------------------------------------------------------------------------------------

    def _started(self, module: Any) -> None:
        """A model's first setup: before any cast or DDP broadcast, the same point as ``strategy.setup`` on the
        Trainer. The first one also says the changes and registers the ends that need no collective."""
        rank = int(self._fabric.global_rank)
        if not self._modules:
            if rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                print(self.recorder.changes.describe(self.plan.candidate), file=sys.stderr, flush=True)
            atexit.register(self._script_ended)
            previous_hook = sys.excepthook

            def crashed(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
                try:
                    self._crashed(error)
                finally:
                    previous_hook(kind, error, trace)

            sys.excepthook = crashed
        self.recorder.started(module, rank, prefix=f"module{len(self._modules)}.")
        self._watching.append(self._calls.watch(module))  # named module{i} in watch order, as the weights are
        self._modules.append(module)

    def _stepped_through(self, set_up: Any) -> Any:
        """What ``fabric.setup`` / ``setup_optimizers`` returned, each optimizer's ``step`` recorded."""
        for item in set_up if isinstance(set_up, tuple) else (set_up,):
            if isinstance(item, torch.optim.Optimizer):  # Fabric's wrapper takes the optimizer's class too
                self._record_steps(item)
        return set_up

    def _record_steps(self, optimizer: Any) -> None:
        step = optimizer.step

        def recorded_step(*args: Any, **kwargs: Any) -> Any:
            if self._written:
                if self._ended:  # a script that swallowed the SystemExit of --steps meets it again
                    raise SystemExit(0)
                return step(*args, **kwargs)
            if not self._backward_seen:
                raise _no_backward(len(self.recorder.steps), optimizer)
            index = self._before_step(optimizer)
            result = step(*args, **kwargs)
            self._after_step(index, optimizer)
            return result

        shadow(optimizer, "step", recorded_step)

    # -- a step ------------------------------------------------------------------------------------------------------

    _ended = False  # --steps ended the run on this rank

    def _before_step(self, optimizer: Any) -> int:
        recorder = self.recorder
        step = len(recorder.steps)
        scaled_by = None
        if recorder.measures_norm(step):
            # The norm after unscaling, as on the Trainer: a scaler unscales inside the step, so first unscale here as
            # fabric.clip_gradients does (the step then does not unscale again). Lightning's MixedPrecision refuses for
            # an optimizer that unscales inside its own (fused) step: there the norm is divided by the scale instead.
            try:
                self._plugin.unscale_gradients(getattr(optimizer, "optimizer", optimizer))
            except NotImplementedError:
                scaled_by = recorder.scale()
        if recorder.before_step(optimizer, step, check=bool(self._watching), scaled_by=scaled_by):
            self._locate(step)
        return step

    def _locate(self, step: int) -> None:
        """Where the overflow of ``step`` happened: its model calls run again (:func:`overflow.locate_calls`), before
        the step where its loss is not finite, after it where the scaler skipped it. Once the most a run locates are
        located, the models are no longer watched: nothing is left of the cost."""
        scale = self.recorder.steps[step].scale
        self.recorder.overflows.append(
            overflow.locate_calls(
                self._calls.take(),
                step=step,
                scale=None if scale is None else float(scale),
                context=self._plugin.forward_context,
            )
        )
        self._calls.take()  # the calls the re-run made
        if len(self.recorder.overflows) >= overflow.MAX_LOCATED:
            for watching in self._watching:
                watching.remove()
            self._watching = []

    def _after_step(self, index: int, optimizer: Any) -> None:
        recorder = self.recorder
        opened, self._opened = self._opened, None
        overflows = recorder.overflows
        check = bool(self._watching) and not (overflows and overflows[-1]["step"] == index)  # not located before it
        if recorder.after_step(index, optimizer, opened, check=check):
            self._locate(index)
        if self._watching:
            self._calls.start_step()
        done = index + 1
        if recorder.snapshots_due(done):
            recorder.snapshot(self._weights, done, int(self._fabric.global_rank))
        if done >= self._last_step:
            self._end()

    def _weights(self) -> dict[str, Tensor]:
        modules = [(f"module{index}.", module) for index, module in enumerate(self._modules)]
        return trained_weights(modules, self._plugin)

    def _logged(self, metrics: Mapping[str, Any]) -> None:
        """Rank 0's scalars of a ``fabric.log`` / ``log_dict``, as one evaluation per step done."""
        if self._written or int(self._fabric.global_rank) != 0:
            return
        scalars = {name: _scalar(value) for name, value in metrics.items()}
        values = {name: value for name, value in scalars.items() if value is not None}
        if not values:
            return
        evaluations, step = self.recorder.evaluations, len(self.recorder.steps)
        if evaluations and evaluations[-1]["stage"] == LOGGED and evaluations[-1]["step"] == step:
            evaluations[-1]["metrics"].update(values)
        else:
            self.recorder.add_evaluation({"stage": LOGGED, "step": step, "metrics": values})

    # -- the ends ----------------------------------------------------------------------------------------------------

    def _end(self) -> None:
        """``--steps`` reached: every rank writes its record, and the script stops here, its ``finally`` blocks and
        ``atexit`` run. No collective: each rank's record is a file of its own, which ``compare`` merges once every
        rank has exited, and every rank reaches this step at the same point of the loop (the gradients it steps on
        were all-reduced), so none is left waiting in one."""
        self._write()
        self._ended = True
        atexit.unregister(self._script_ended)
        raise SystemExit(0)

    def _script_ended(self) -> None:
        """The script ended before ``--steps``; no collective is safe here (the process group may be gone). A loop
        that never stepped leaves no record: the report says the script built a Fabric but stepped no optimizer."""
        if not self._written and self.recorder.steps:
            self._write()

    def _write(self) -> None:
        """This rank's record (``record-rank{r}.json``); rank 0 also the final weights."""
        self._written = True
        recorder, rank = self.recorder, int(self._fabric.global_rank)
        document = {**self._header(), "ranks": [recorder.rank_record(rank, self._fabric.device)]}
        document |= {"evaluations": recorder.evaluations, "weight_distances": recorder.distances}
        folder = Path(self.plan.directory)
        if rank == 0:
            save_fp32(self._weights(), folder / FINAL_WEIGHTS)
        temporary = folder / f"{rank_file(rank)}.tmp"
        temporary.write_text(json.dumps(document))
        temporary.replace(folder / rank_file(rank))

    def _crashed(self, error: BaseException) -> None:
        """The script raised: this rank keeps the steps it took, as the Trainer's ``on_exception`` does."""
        if self._written:
            return
        self._written = True
        rank = int(self._fabric.global_rank)
        try:
            record = self.recorder.rank_record(rank, self._fabric.device)
        except Exception:  # a device that failed cannot be read back; the error to report is the script's
            return
        document = {**self._header(), "ranks": [record], "crashed": repr(error)}
        (Path(self.plan.directory) / partial_file(rank)).write_text(json.dumps(document))

    def _header(self) -> dict[str, Any]:
        return self.recorder.header(ran_as(self._plugin), int(self._fabric.world_size))


def _no_backward(step: int, optimizer: Any) -> CompareScriptError:
    """A loop's first step came with no ``fabric.backward``: compare would have no loss to record."""
    name = type(getattr(optimizer, "optimizer", optimizer)).__name__
    return CompareScriptError(
        "fabric.backward",
        "never called",
        f"optimizer step {step} ({name}) came with no fabric.backward(loss) before it, and compare records the loss"
        " each step trained on from fabric.backward",
        "call fabric.backward(loss) in place of loss.backward() (under AMP, Fabric needs it to scale the loss too)",
    )


def _scalar(value: Any) -> float | None:
    """A logged value as a float: a number, or a tensor of one element; None for anything else."""
    if isinstance(value, Tensor):
        return float(value.detach().item()) if value.numel() == 1 else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def attach(fabric: Any, plan: Plan, changes: Changes, recordings: list[FabricRecording]) -> None:
    """Record ``fabric`` when it is the first of ``recordings`` (the process's first Fabric records, as the first
    ``fit`` does on the Trainer)."""
    if not recordings:
        recordings.append(FabricRecording(fabric, plan, changes))
