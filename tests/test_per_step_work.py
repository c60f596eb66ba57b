"""The package's own work per training step is exactly what docs/strategy.md documents ("What runs every step").

A worker counts the calls into lightning_ddp_amp during two fits of 4 and 12 steps on 2 ranks; every function
whose count grows with the steps is per-step work. Setup work (reading the environment, choosing devices,
sharding DataLoaders) must not be among them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Preloaded

pytestmark = pytest.mark.multiprocess

#: Per-step work docs/strategy.md documents, and why it runs each step.
DOCUMENTED = {
    # Lightning asks the strategy for its device and ranks (cached properties, no computation; the Trainer's and
    # Fabric's envddp share them).
    "reconciler.ReconciledTopology.parallel_devices",
    "reconciler.ReconciledTopology.cluster_environment",
    # ... which hand over to the negotiated flags' cached values.
    "reconciler.TopologyReconciler.devices",
    "reconciler.TopologyReconciler.environment",
    "cluster_environment.LauncherEnvironment.local_rank",
    "cluster_environment.LauncherEnvironment.global_rank",
    "cluster_environment.LauncherEnvironment.world_size",
    # The preemption check (the strategy's hook hands it to auto-resume); returns at once without auto_resume.
    "strategy.EnvDDPStrategy.on_train_batch_start",
    "resume.AutoResume.on_train_batch_start",
    # The no-op that stands in for Lightning's per-step SIGTERM broadcast (which waits for every rank).
    "loops.disable_sigterm_broadcast.<locals>.<lambda>",
    # Once per epoch, not per step: the sampler's order for the new epoch, and what a checkpoint records of it.
    "samplers.ResumableDistributedSampler.__iter__",
    "samplers.ResumableSampler._pass",
    "samplers.ResumableSampler._rest_of_resumed_epoch",
    "samplers.ResumableDistributedSampler.own_order",
}
#: With AmpPrecision, its Lightning hooks and the native backend's autocast / GradScaler calls.
DOCUMENTED_AMP = DOCUMENTED | {
    "precision.AmpPrecision.backward",
    "precision.AmpPrecision.backward.<locals>.run_backward",
    # backward's check of the loss_id it is given (a few isinstance tests).
    "settings.AmpSettings.check_loss_id",
    "errors.whole_number",
    # which optimizers the loss is scaled for: automatic optimization names the one it steps (no graph walk).
    "loss_optimizers.LossOptimizers.choose",
    "loss_optimizers.LossOptimizers.choose.<locals>.<listcomp>",
    "precision.AmpPrecision.convert_input",
    "precision.AmpPrecision.forward_context",
    "precision.AmpPrecision.amp_backend",
    "precision.AmpPrecision.optimizer_step",
    # Lightning's before-step hooks and gradient clipping, between the closure and the step (through the fence).
    "members.after_closure",
    "native_backend.NativeAmp.scales_loss",
    "native_backend.NativeAmp.backward",
    "native_backend.NativeAmp.convert_input",
    "native_backend.NativeAmp.forward_context",
    "native_backend.NativeAmp.step",
    "native_backend.NativeAmp.unscale",
    "native_backend.NativeAmp._clamp",
}
#: Setup work that would be a regression if it ran every step.
SETUP_ONLY = {
    "environment.read_topology",
    "devices.select_devices",
    "sharding.shard_dataloader",
    "position.DataLayout.of",
    "position.LoaderPosition.attach",
    "members.rebuild_dataloader",
    "precision.AmpPrecision.amp_modules",
    "amp_models.amp_modules",
}


def per_step_calls(preloaded: Preloaded, out: Path, *args: str) -> dict[str, float]:
    out.mkdir()
    preloaded.run("count_calls.py", "--out", str(out), *args, log=out / "logs").check()
    return json.loads((out / "rank0.json").read_text())  # type: ignore[no-any-return]


def test_fp32_steps_do_only_the_documented_work(preloaded: Preloaded, tmp_path: Path) -> None:
    calls = per_step_calls(preloaded, tmp_path / "fp32")
    assert set(calls) <= DOCUMENTED, sorted(set(calls) - DOCUMENTED)
    assert not set(calls) & SETUP_ONLY
    assert calls["samplers.ResumableDistributedSampler.__iter__"] < 1  # once per epoch of 8 steps


def test_amp_steps_do_only_the_documented_work(preloaded: Preloaded, tmp_path: Path) -> None:
    calls = per_step_calls(preloaded, tmp_path / "amp", "--amp")
    assert set(calls) <= DOCUMENTED_AMP, sorted(set(calls) - DOCUMENTED_AMP)
    assert not set(calls) & SETUP_ONLY
