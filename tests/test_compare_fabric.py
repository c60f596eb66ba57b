"""``lightning-ddp-amp compare`` on a kept loop: each run's ``Fabric(...)`` gets the run's precision, as the Trainer does.

In one process, the patch is put on a subclass of Fabric, so that Fabric itself stays as it was; one run through
compare's ``sitecustomize`` checks that a script's own ``Fabric`` is patched in both namespaces.
docs/design/compare-fabric.md has the whole design and the launched tests to come.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import lightning.fabric
import lightning.pytorch
import pytest
import torch
from conftest import needs_cpu_fp16, worker_env
from lightning.fabric import Fabric
from lightning.fabric.plugins import HalfPrecision, MixedPrecision

from lightning_ddp_amp.commands.compare import command as compare
from lightning_ddp_amp.commands.compare import doors, run_files, run_folder
from lightning_ddp_amp.commands.compare.candidate import Candidate
from lightning_ddp_amp.commands.compare.comparable import missing_metric
from lightning_ddp_amp.commands.compare.fabric_patching import PRECISION_VARIABLE, changes_of, patch_fabric
from lightning_ddp_amp.commands.compare.fabric_recording import FabricRecording
from lightning_ddp_amp.commands.compare.recorder import Changes
from lightning_ddp_amp.commands.compare.run_folder import (
    FINAL_WEIGHTS,
    PLAN_VARIABLE,
    START_WEIGHTS,
    Plan,
    snapshot_file,
)
from lightning_ddp_amp.commands.compare.tensors import hash_tensors
from lightning_ddp_amp.commands.compare.tolerance import Metric
from lightning_ddp_amp.errors import CompareScriptError
from lightning_ddp_amp.fabric import AmpPrecision, setup_models


@pytest.fixture(autouse=True)
def unpatched_fabric(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's own ``Fabric.__init__`` for each test: test_compare.py's in-process runs of compare's ``patch``
    change the real class, as a run does, and a patched ``__init__`` inherited by these tests' subclasses would apply
    its own plan after theirs."""
    init = Fabric.__init__
    while getattr(init, "__lightning_ddp_amp_compare__", False):
        init = init.__wrapped__  # type: ignore[attr-defined]
    monkeypatch.setattr(Fabric, "__init__", init)


def script_namespace(fabric_class: type[Fabric]) -> SimpleNamespace:
    """``lightning.fabric`` as the patch reads it, with ``fabric_class`` as its Fabric."""
    return SimpleNamespace(
        __name__="lightning.fabric",
        Fabric=fabric_class,
        plugins=lightning.fabric.plugins,
        loggers=lightning.fabric.loggers,
    )


def patched_fabric(tmp_path: Path, precision: str) -> type[Fabric]:
    """A subclass of Fabric, patched as a run of ``precision`` patches the script's."""

    class ScriptFabric(Fabric):
        pass

    namespace = script_namespace(ScriptFabric)
    patch_fabric(namespace, Plan("run", precision, steps=4, directory=str(tmp_path)))
    return ScriptFabric


def changes(fabric: Fabric) -> list[str]:
    """The changes listed, but the one every Fabric of a run has: where ``fabric.save`` writes (tested below)."""
    return [line for line in changes_of(fabric).replaced if not line.startswith("fabric.save(")]


@needs_cpu_fp16
def test_a_fabric_built_at_another_precision_gets_the_runs_amp_level_and_lists_the_change(tmp_path: Path) -> None:
    fabric = patched_fabric(tmp_path, "native-O2")(accelerator="cpu", devices=1, precision="bf16-mixed")
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision)
    assert (plugin.backend, plugin.opt_level) == ("native", "O2")
    assert changes(fabric) == ["precision='bf16-mixed' -> 'native-O2'"]


def test_a_lightning_precision_string_is_handed_to_fabric_as_it_is(tmp_path: Path) -> None:
    fabric = patched_fabric(tmp_path, "bf16-mixed")(accelerator="cpu", devices=1, precision="32-true")
    assert isinstance(fabric.strategy.precision, MixedPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"


def test_apex_levels_run_apex_under_the_runs_opt_level(tmp_path: Path, apex_double: ModuleType) -> None:
    fabric = patched_fabric(tmp_path, "apex-O1")(strategy="envddp", accelerator="cpu", devices=1, precision="native-O1")
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision)
    assert (plugin.backend, plugin.opt_level) == ("apex", "O1")


@needs_cpu_fp16
def test_a_scripts_amp_precision_is_replaced_and_its_settings_carried_to_the_runs_level(tmp_path: Path) -> None:
    script_plugin = AmpPrecision(
        opt_level="O1", backend="native", num_losses=3, loss_scale=128.0, max_loss_scale=2.0**16
    )
    fabric = patched_fabric(tmp_path, "native-O2")(accelerator="cpu", devices=1, plugins=[script_plugin])
    plugin = fabric.strategy.precision
    assert isinstance(plugin, AmpPrecision) and plugin is not script_plugin
    assert plugin.opt_level == "O2"
    settings = plugin.settings
    assert (settings.num_losses, settings.loss_scale, settings.max_loss_scale) == (3, 128.0, 2.0**16)
    assert changes(fabric) == [
        "precision=None -> 'native-O2'",
        "removed the precision plugin AmpPrecision",
        "kept the script's AmpPrecision settings (num_losses, loss scale, ...)",
    ]


@needs_cpu_fp16
def test_settings_the_runs_level_refuses_are_dropped_and_num_losses_kept(tmp_path: Path) -> None:
    script_plugin = AmpPrecision(opt_level="O2", backend="native", keep_batchnorm_fp32=True, num_losses=2)
    fabric = patched_fabric(tmp_path, "native-O1")(accelerator="cpu", devices=1, plugins=script_plugin)
    settings = fabric.strategy.precision.settings
    assert (settings.opt_level, settings.num_losses, settings.keep_batchnorm_fp32) == ("O1", 2, None)
    assert changes(fabric)[-1].startswith("kept only num_losses of the script's AmpPrecision (keep_batchnorm_fp32=")


def test_a_lightning_precision_plugin_is_removed_for_the_runs_precision(tmp_path: Path) -> None:
    script_plugins: list[Any] = [HalfPrecision("bf16-true")]
    fabric = patched_fabric(tmp_path, "32-true")(accelerator="cpu", devices=1, plugins=script_plugins)
    assert type(fabric.strategy.precision).__name__ == "Precision"
    assert changes(fabric) == ["precision=None -> '32-true'", "removed the precision plugin HalfPrecision"]


def test_the_scripts_own_precision_is_no_change(tmp_path: Path) -> None:
    fabric = patched_fabric(tmp_path, "32-true")(accelerator="cpu", devices=1, precision="32-true")
    assert changes(fabric) == []


def test_fabric_runs_precision_variable_is_removed_so_that_the_runs_precision_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PRECISION_VARIABLE, "bf16-mixed")
    monkeypatch.setenv("LT_CLI_USED", "1")  # as `fabric run` sets it: Fabric would refuse a precision that differs
    fabric = patched_fabric(tmp_path, "32-true")(accelerator="cpu", devices=1, precision="16-mixed")
    assert type(fabric.strategy.precision).__name__ == "Precision"
    assert changes(fabric) == [
        f"removed {PRECISION_VARIABLE}='bf16-mixed', which Fabric takes over precision",
        "precision='bf16-mixed' -> '32-true'",
    ]


# -- the run's files in its folder: loggers and fabric.save / load ----------------------------------------------------


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The script's working directory, beside the run's folder ``tmp_path / "run"``."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "work"


def run_fabric(tmp_path: Path, **arguments: Any) -> Fabric:
    """A Fabric the script builds with ``arguments`` in a run whose folder is ``tmp_path / "run"``, at the run's own
    precision (no change to list)."""
    return patched_fabric(tmp_path / "run", "32-true")(accelerator="cpu", devices=1, precision="32-true", **arguments)


# A TensorBoardLogger goes the same way (one isinstance check, one constructor call); it cannot be built here, where
# neither tensorboard nor tensorboardX is installed.
@pytest.mark.parametrize(
    "logger_class",
    [
        lightning.fabric.loggers.CSVLogger,
        lightning.pytorch.loggers.CSVLogger,  # a subclass of Fabric's, its folder named save_dir
    ],
)
def test_csv_loggers_are_built_again_writing_into_the_runs_logs(
    logger_class: type[Any], tmp_path: Path, work: Path
) -> None:
    fabric = run_fabric(tmp_path, loggers=logger_class("script_logs", name="mine"))
    (logger,) = fabric.loggers
    assert type(logger) is logger_class
    fabric.log("loss", 1.0, step=0)
    logger.finalize("success")
    logs = tmp_path / "run" / "logs"
    written = [path.relative_to(logs).parts[:2] for path in logs.rglob("*") if path.is_file()]
    assert written and set(written) == {("mine", "version_0")}
    assert not (work / "script_logs").exists()
    assert changes(fabric) == [f"{logger_class.__name__} writes to {str(logs)!r}"]


def test_any_other_logger_is_turned_off_and_its_experiment_swallows_what_the_script_calls(
    tmp_path: Path, work: Path
) -> None:
    class Remote(lightning.fabric.loggers.Logger):
        name, version = "remote", 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            raise AssertionError("the remote logger was called")

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("the remote logger was called")

    fabric = run_fabric(tmp_path, loggers=Remote())
    fabric.log("loss", 1.0)
    fabric.logger.log_hyperparams({"lr": 0.1})
    fabric.logger.experiment.anything("image", step=3).deeper[0].call()  # a W&B run's calls, swallowed
    assert isinstance(fabric.logger, lightning.fabric.loggers.Logger) and not isinstance(fabric.logger, Remote)
    assert fabric.logger.root_dir == str(tmp_path / "run" / "logs")
    assert not (tmp_path / "run" / "logs").exists()  # it writes nothing
    assert changes_of(fabric).turned_off == ["Remote"]
    assert "turned off Remote: it cannot write into the candidate's folder" in changes_of(fabric).describe("run")


def test_fabric_save_writes_into_the_runs_files_and_fabric_load_reads_that_copy_back(
    tmp_path: Path, work: Path
) -> None:
    fabric = run_fabric(tmp_path)
    model = torch.nn.Linear(2, 1)
    saved = model.weight.detach().clone()
    fabric.save("ckpt/last.ckpt", {"model": model, "epoch": 3})
    assert (tmp_path / "run" / "files" / "ckpt" / "last.ckpt").is_file()
    assert not (work / "ckpt").exists()
    torch.nn.init.zeros_(model.weight)
    assert fabric.load("ckpt/last.ckpt", {"model": model}) == {"epoch": 3}
    assert torch.equal(model.weight, saved)


def test_a_load_reads_the_runs_copy_over_the_scripts_file_and_the_scripts_file_where_the_run_saved_none(
    tmp_path: Path, work: Path
) -> None:
    torch.save({"epoch": 7}, work / "given.ckpt")  # the checkpoint a script is handed (--resume PATH)
    torch.save({"weight": torch.zeros(1, 2), "bias": torch.zeros(1)}, work / "weights.pt")
    fabric = run_fabric(tmp_path)
    assert fabric.load("given.ckpt") == {"epoch": 7}
    model = torch.nn.Linear(2, 1)
    fabric.save("weights.pt", model.state_dict())
    loaded = torch.nn.Linear(2, 1)
    fabric.load_raw("weights.pt", loaded)
    assert torch.equal(loaded.weight, model.weight)  # the run's copy, not the script's zeros
    assert torch.equal(torch.load(work / "weights.pt")["weight"], torch.zeros(1, 2))


def test_paths_outside_the_working_directory_and_urls_are_kept_under_files_absolute(tmp_path: Path, work: Path) -> None:
    run = tmp_path / "run"
    fabric = run_fabric(tmp_path)
    elsewhere = tmp_path / "elsewhere" / "last.ckpt"
    fabric.save(elsewhere, {"epoch": 1})
    fabric.save("../climbed.ckpt", {"epoch": 2})
    absolute = run / "files-absolute" / Path(*tmp_path.parts[1:])
    assert torch.load(absolute / "elsewhere" / "last.ckpt") == {"epoch": 1}
    assert torch.load(absolute / "climbed.ckpt") == {"epoch": 2}
    assert not elsewhere.exists() and not (tmp_path / "climbed.ckpt").exists()
    assert run_files.run_copy("s3://bucket/ckpt/../../../last.ckpt", str(run)) == str(
        run / "files-absolute" / "s3" / "last.ckpt"
    )


def test_each_path_saved_is_listed_once_after_the_rule_said_at_setup(tmp_path: Path, work: Path) -> None:
    run = tmp_path / "run"
    fabric = run_fabric(tmp_path)
    (rule,) = changes_of(fabric).replaced
    assert rule.startswith(f"fabric.save(path) -> {str(run / 'files')!r} for a path in the working directory")
    for epoch in range(2):
        fabric.save("ckpt/last.ckpt", {"epoch": epoch})
    fabric.save(run / "own.ckpt", {"epoch": 0})  # already in the run's folder: saved there, no change
    assert (run / "own.ckpt").is_file()
    assert changes_of(fabric).replaced == [
        rule,
        f"fabric.save('ckpt/last.ckpt') -> {str(run / 'files' / 'ckpt' / 'last.ckpt')!r}",
    ]


# -- the recording of a kept loop, in one process (no launch) ------------------------------------------------------


def test_ckpt_on_a_fabric_script_is_refused_with_the_scripts_own_option_as_the_fix(tmp_path: Path) -> None:
    class ScriptFabric(Fabric):
        pass

    plan = Plan("run", "32-true", steps=4, directory=str(tmp_path), ckpt="/data/last.ckpt")
    patch_fabric(script_namespace(ScriptFabric), plan)
    with pytest.raises(CompareScriptError) as refused:
        ScriptFabric(accelerator="cpu", devices=1)
    assert str(refused.value) == (
        "--ckpt='/data/last.ckpt': a Fabric script loads its own checkpoints with fabric.load, so compare cannot start"
        " it from one. Fix: pass the checkpoint to the script's own option in the command (e.g. -- python train.py"
        " --resume PATH)"
    )


@pytest.fixture
def at_exit(monkeypatch: pytest.MonkeyPatch) -> list[Callable[[], None]]:
    """What the recording registers with ``atexit``, kept here (and run by the test) instead of at pytest's exit; the
    exception hook it chains is put back after the test."""
    registered: list[Callable[[], None]] = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", registered.remove)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    return registered


def recorded_fabric(
    tmp_path: Path, steps: int = 3, precision: str = "32-true", strategy: str = "auto", **plan: Any
) -> Fabric:
    """A Fabric built in a run of ``steps`` steps at ``precision``, the baseline of ``tmp_path``, recorded."""
    run = Plan("run", precision, steps=steps, directory=str(tmp_path), baseline_directory=str(tmp_path), **plan)

    class ScriptFabric(Fabric):
        pass

    namespace = script_namespace(ScriptFabric)
    patch_fabric(namespace, run)
    return ScriptFabric(strategy=strategy, accelerator="cpu", devices=1)


def train(
    fabric: Fabric,
    batches: int,
    log: bool = True,
    together: bool = False,
    norms: list[float] | None = None,
    nan_gradient_at: int | None = None,
) -> list[float]:
    """A kept loop of two models and one optimizer, logging ``val_acc`` after each step; the losses it trained on.
    ``norms`` gets the global norm of the gradients before each step; at batch ``nan_gradient_at`` the loss stays finite
    and the head's weight gradient is NaN (``sqrt(0)``'s backward times 0), as nothing in float32 overflows.
    ``together``: the models set up with their optimizer in one call (``setup_models``, as apex needs)."""
    torch.manual_seed(0)
    encoder, head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1)
    if together:
        (encoder, head), optimizer = setup_models(fabric, [encoder, head], optimizer)
    else:
        encoder = fabric.setup_module(encoder)
        head, optimizer = fabric.setup(head, optimizer)
    losses = []
    for batch in range(batches):
        x = torch.randn(16, 4)
        loss = torch.nn.functional.mse_loss(head(encoder(x)), x[:, :1])
        if batch == nan_gradient_at:
            loss = loss + torch.sqrt((head.weight * 0).sum())
        losses.append(float(loss.detach()))
        fabric.backward(loss)
        if norms is not None:
            grads = [p.grad for p in [*encoder.parameters(), *head.parameters()]]
            norms.append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))
        optimizer.step()
        optimizer.zero_grad()
        if log:
            fabric.log("val_acc", torch.tensor(batch / 10))
            fabric.log_dict({"val_loss": float(loss.detach()), "phase": "warm-up"})
    return losses


def merged_record(tmp_path: Path) -> dict[str, Any]:
    assert run_folder.merge_rank_records(tmp_path)
    record = run_folder.read_record(tmp_path)
    assert record is not None
    return record


def test_a_kept_loop_is_recorded_step_by_step_and_ends_cleanly_after_its_steps(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    with pytest.raises(SystemExit) as ended:
        train(recorded_fabric(tmp_path, steps=3), batches=10)
    assert ended.value.code == 0
    record = merged_record(tmp_path)
    assert (record["world_size"], record["ran_as"]) == (1, "Precision 32-true")
    (rank,) = record["ranks"]
    assert rank["step"] == [0, 1, 2] and rank["skipped"] == [False] * 3
    assert all(math.isfinite(t) for t in rank["step_time_s"])
    assert [norm is None for norm in rank["grad_norm"]] == [False, True, True]  # by default at every 20th step
    assert not at_exit  # the end wrote the record: nothing is left for the script's end


def test_the_gradient_norm_is_the_norm_stepped_with_at_every_nth_step_and_none_between(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    with pytest.raises(SystemExit):
        train(recorded_fabric(tmp_path, steps=7, grad_norm_every=3), batches=10)
    torch.manual_seed(0)
    norms: list[float] = []
    train(Fabric(accelerator="cpu", devices=1), batches=7, log=False, norms=norms)
    measured = merged_record(tmp_path)["ranks"][0]["grad_norm"]
    assert measured[0::3] == pytest.approx(norms[0::3], rel=1e-6) and norms[3] != norms[0]
    assert [value is None for value in measured] == [step % 3 != 0 for step in range(7)]


@needs_cpu_fp16
def test_the_gradient_norm_under_a_loss_scaler_is_the_unscaled_norm_the_optimizer_steps_with(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    with pytest.raises(SystemExit):
        train(recorded_fabric(tmp_path, steps=1, precision="native-O1"), batches=10)
    torch.manual_seed(0)
    norms: list[float] = []
    train(Fabric(accelerator="cpu", devices=1), batches=1, log=False, norms=norms)
    rank = merged_record(tmp_path)["ranks"][0]
    assert rank["loss_scale"] == [2.0**16] and rank["skipped"] == [False]
    assert rank["grad_norm"][0] == pytest.approx(norms[0], rel=0.01)  # float16 forwards; not 65536 times it


@needs_cpu_fp16
def test_under_an_optimizer_that_unscales_in_its_own_fused_step_the_norm_is_divided_by_the_scale(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    # Lightning's MixedPrecision refuses to unscale for it (NotImplementedError), as for fabric.clip_gradients.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    FabricRecording(fabric, Plan("run", "16-mixed", 2, str(tmp_path)), Changes(door="Fabric"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    assert optimizer._step_supports_amp_scaling  # type: ignore[attr-defined]
    model, optimizer = fabric.setup(model, optimizer)
    x = torch.randn(16, 4)
    loss = model(x).float().pow(2).mean()
    fabric.backward(loss)
    expected = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))) / 1024
    with pytest.raises(SystemExit):
        for _ in range(2):
            optimizer.step()
            optimizer.zero_grad()
            fabric.backward(model(x).float().pow(2).mean())
    rank = merged_record(tmp_path)["ranks"][0]
    assert rank["skipped"] == [False, False] and rank["grad_norm"][0] == pytest.approx(expected, rel=1e-6)


@needs_cpu_fp16
def test_a_step_the_scaler_skips_on_a_finite_loss_is_located_after_it_from_its_calls(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    with pytest.raises(SystemExit):
        train(recorded_fabric(tmp_path, steps=4, precision="native-O1"), batches=10, nan_gradient_at=2)
    rank = merged_record(tmp_path)["ranks"][0]
    assert rank["skipped"] == [False, False, True, False] and all(math.isfinite(loss) for loss in rank["loss"])
    (found,) = rank["overflows"]  # the step's loss was finite: found once the scaler skipped it
    assert (found["step"], found["phase"], found["module"], found["loss_scale"]) == (2, "loss", "(the loss)", 2.0**16)


def test_a_finite_loss_with_non_finite_gradients_is_located_at_its_step_where_its_norm_is_measured(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    with pytest.raises(SystemExit):
        train(recorded_fabric(tmp_path, steps=5, grad_norm_every=1), batches=10, nan_gradient_at=2)
    found, after = merged_record(tmp_path)["ranks"][0]["overflows"][:2]
    assert (found["step"], found["phase"], found["module"]) == (2, "loss", "(the loss)")
    assert (after["step"], after["phase"]) == (3, "not re-run")  # 32-true: no scaler skipped step 2


def test_between_measured_norms_the_step_after_names_the_weights_an_unchecked_step_left_not_finite(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    with pytest.raises(SystemExit):
        train(recorded_fabric(tmp_path, steps=5, grad_norm_every=10), batches=10, nan_gradient_at=2)
    rank = merged_record(tmp_path)["ranks"][0]
    assert math.isfinite(rank["loss"][2]) and not math.isfinite(rank["loss"][3])
    found = rank["overflows"][0]  # each step after it is NaN too, each located as far as MAX_LOCATED
    assert (found["step"], found["phase"], found["module"], found["tensor"]) == (3, "not re-run", "module1", "weight")
    assert "already not finite as the step started" in found["note"] and "--grad-norm-every 1" in found["note"]


def test_the_loss_of_each_step_is_the_loss_handed_to_fabric_backward(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    with pytest.raises(SystemExit):
        train(recorded_fabric(tmp_path, steps=3), batches=10)
    torch.manual_seed(0)
    expected = train(Fabric(accelerator="cpu", devices=1), batches=3, log=False)
    assert merged_record(tmp_path)["ranks"][0]["loss"] == pytest.approx(expected, rel=1e-6)


def test_every_model_set_up_is_hashed_before_setup_and_named_in_the_weights(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    torch.manual_seed(0)
    encoder, head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    hashes = [
        hash_tensors({f"module{i}.{name}": t for name, t in model.state_dict().items()})
        for i, model in enumerate((encoder, head))
    ]
    with pytest.raises(SystemExit):
        train(recorded_fabric(tmp_path, steps=2, save_start=True, snapshots=(1,)), batches=10)
    rank = merged_record(tmp_path)["ranks"][0]
    assert rank["weights_hash"] == hashlib.sha256(":".join(hashes).encode()).hexdigest()
    assert rank["batch_hash"] is not None
    for weights in (START_WEIGHTS, snapshot_file(1), FINAL_WEIGHTS):
        saved = torch.load(tmp_path / weights)
        assert sorted(saved) == ["module0.bias", "module0.weight", "module1.bias", "module1.weight"]
    assert torch.equal(torch.load(tmp_path / START_WEIGHTS)["module1.weight"], head.weight)


@needs_cpu_fp16
def test_under_apex_o2_the_weights_compared_are_the_fp32_masters_the_optimizer_steps(
    tmp_path: Path, at_exit: list[Callable[[], None]], apex_double: ModuleType
) -> None:
    fabric = recorded_fabric(tmp_path, steps=2, precision="apex-O2", strategy="envddp", save_start=True, snapshots=(1,))
    fabric.launch()  # one process: no ranks to start
    with pytest.raises(SystemExit):
        train(fabric, batches=10, log=False, together=True)
    pairs = fabric.strategy.precision.amp_backend.master_weight_pairs()
    assert pairs and all(weight.dtype == torch.float16 for weight, _ in pairs)
    final, snapshot = torch.load(tmp_path / FINAL_WEIGHTS), torch.load(tmp_path / snapshot_file(1))
    for name in ("module0.weight", "module1.weight"):
        (weight, master) = next((w, m) for w, m in pairs if w.shape == final[name].shape)
        assert torch.equal(final[name], master)  # the master, bit for bit: not its fp16 copy
        assert not torch.equal(final[name], weight.float())
        assert not torch.equal(snapshot[name], final[name])


def test_fabric_log_and_log_dict_scalars_are_kept_as_logged_evaluations_one_per_step(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    with pytest.raises(SystemExit):
        train(recorded_fabric(tmp_path, steps=3), batches=10)
    evaluations = merged_record(tmp_path)["evaluations"]
    assert [(e["stage"], e["step"], sorted(e["metrics"])) for e in evaluations] == [
        ("logged", 1, ["val_acc", "val_loss"]),
        ("logged", 2, ["val_acc", "val_loss"]),
    ]  # the phase is no scalar; the third step ended the run before its log
    assert evaluations[1]["metrics"]["val_acc"] == pytest.approx(0.1)


def test_a_metric_a_kept_loop_never_logged_is_told_to_log_it_with_fabric_log(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    with pytest.raises(SystemExit):
        train(recorded_fabric(tmp_path, steps=3), batches=10)
    record = merged_record(tmp_path)
    assert record["door"] == "Fabric"
    assert missing_metric(record["evaluations"], [Metric("val_acc"), Metric("val_top5")], record["door"]) == (
        "--metric='val_top5': the baseline logged no such metric with fabric.log (it logged: val_acc, val_loss)."
        " Fix: name one of those, or log it with fabric.log('val_top5', value) in the loop, within the steps compare"
        " runs (--steps)"
    )


def test_a_script_that_swallows_the_end_meets_it_again_at_its_next_step(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    fabric = recorded_fabric(tmp_path, steps=1)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(fabric.setup_module(torch.nn.Linear(2, 1)).parameters()))
    for _ in range(2):
        fabric.backward(fabric.setup_module(torch.nn.Linear(2, 1))(torch.ones(1, 2)).sum())
        with pytest.raises(SystemExit):
            optimizer.step()


def test_a_script_that_ends_before_its_steps_writes_its_record_at_exit(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    train(recorded_fabric(tmp_path, steps=100), batches=4)
    assert not (tmp_path / run_folder.rank_file(0)).exists()
    (script_ended,) = at_exit
    script_ended()
    assert merged_record(tmp_path)["ranks"][0]["step"] == [0, 1, 2, 3]


def test_a_script_that_raises_keeps_the_steps_it_took_in_a_partial_record(
    tmp_path: Path, at_exit: list[Callable[[], None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    handed_on: list[BaseException] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, trace: handed_on.append(error))
    train(recorded_fabric(tmp_path, steps=100), batches=2)
    error = RuntimeError("the script's own")
    sys.excepthook(RuntimeError, error, None)
    assert handed_on == [error]  # sitecustomize's hook still writes the error
    assert [rank["step"] for rank in run_folder.read_partial(tmp_path)] == [[0, 1]]
    at_exit[0]()  # and the exit after the crash writes no whole record
    assert not run_folder.merge_rank_records(tmp_path)


def test_a_loop_that_steps_without_fabric_backward_is_told_to_call_it(
    tmp_path: Path, at_exit: list[Callable[[], None]]
) -> None:
    fabric = recorded_fabric(tmp_path)
    model, optimizer = fabric.setup(torch.nn.Linear(2, 1), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(CompareScriptError) as refused:
        optimizer.step()
    assert str(refused.value) == (
        "fabric.backward='never called': optimizer step 0 (SGD) came with no fabric.backward(loss) before it, and"
        " compare records the loss each step trained on from fabric.backward. Fix: call fabric.backward(loss) in"
        " place of loss.backward() (under AMP, Fabric needs it to scale the loss too)"
    )


def test_rank_records_are_merged_only_when_every_rank_wrote_one(tmp_path: Path) -> None:
    def rank_document(rank: int) -> dict[str, Any]:
        return {"world_size": 2, "candidate": "run", "ranks": [{"rank": rank, "step": [0]}]}

    (tmp_path / run_folder.rank_file(1)).write_text(json.dumps(rank_document(1)))
    (tmp_path / run_folder.partial_file(0)).write_text(json.dumps(rank_document(0)))
    assert not run_folder.merge_rank_records(tmp_path)
    (tmp_path / run_folder.rank_file(0)).write_text(json.dumps(rank_document(0)))
    assert run_folder.merge_rank_records(tmp_path)
    assert [rank["rank"] for rank in merged_record_of(tmp_path)["ranks"]] == [0, 1]


def merged_record_of(tmp_path: Path) -> dict[str, Any]:
    record = run_folder.read_record(tmp_path)
    assert record is not None
    return record


def test_a_scripts_fabric_is_patched_in_both_namespaces_through_compares_site(tmp_path: Path) -> None:
    """A script that never imports the package: its ``lightning.fabric.Fabric`` and the standalone
    ``lightning_fabric.Fabric`` both train at the run's precision."""
    pytest.importorskip("pytorch_lightning")
    plan = tmp_path / "plan.json"
    Plan("run", "bf16-mixed", steps=4, directory=str(tmp_path)).write(plan)
    probe = (
        "import lightning.fabric, pytorch_lightning, lightning_fabric\n"
        "for door in (lightning.fabric.Fabric, lightning_fabric.Fabric):\n"
        "    plugin = door(accelerator='cpu', devices=1, precision='32-true').strategy.precision\n"
        "    print(type(plugin).__module__.split('.')[0], plugin.precision)\n"
    )
    env = worker_env({PLAN_VARIABLE: str(plan)})
    env["PYTHONPATH"] = os.pathsep.join([str(compare.SITE), *filter(None, [env.get("PYTHONPATH")])])
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    printed = result.stdout.splitlines()
    assert printed == ["lightning bf16-mixed", "lightning_fabric bf16-mixed"], result.stderr[-2000:]
    assert not (tmp_path / "errors").exists(), json.dumps([p.read_text() for p in (tmp_path / "errors").iterdir()])


# The errors of a run without a record (design note, "Errors"): how far the script got, from the markers it left.

NEVER_IMPORTED = (
    "command='python train.py': the script never imported lightning, pytorch_lightning or lightning_fabric, so it"
    " built neither a Trainer nor a Fabric to compare. Fix: run the script that builds the Trainer or the Fabric (or"
    " its Python ignored PYTHONPATH: drop python -E / -I)"
)


def imported_only(namespace: str) -> str:
    return (
        f"command='python train.py': the script imported {namespace} but built neither a Trainer nor a Fabric, so"
        " compare had no precision to change. Fix: run the script that builds Trainer(...) or Fabric(...)"
    )


@pytest.mark.parametrize(
    ("markers", "reason"),
    [
        ([], NEVER_IMPORTED),
        (["imported-lightning"], imported_only("lightning")),
        (["imported-lightning_fabric", "imported-pytorch_lightning"], imported_only("pytorch_lightning")),
        (
            ["imported-lightning_fabric", "fabric-41"],
            "command='python train.py': the script built a Fabric but no optimizer set up with fabric.setup /"
            " fabric.setup_optimizers stepped. Fix: set the optimizer up with Fabric and step it in the loop",
        ),
        (
            ["imported-lightning", "trainer-41"],
            "command='python train.py': the script built a Trainer but never completed a Trainer.fit, so compare"
            " recorded no step. Fix: call trainer.fit(...) in the script; compare records the steps of its first fit",
        ),
    ],
)
def test_a_run_without_a_record_says_how_far_its_script_got(markers: list[str], reason: str, tmp_path: Path) -> None:
    (tmp_path / doors.FOLDER).mkdir()
    for marker in markers:
        (tmp_path / doors.FOLDER / marker).touch()
    run = Candidate("native-O1", "native-O1", ["python", "train.py"], tmp_path, returncode=0)
    assert run.failure() == reason


def test_an_error_a_rank_raised_comes_before_the_markers(tmp_path: Path) -> None:
    (tmp_path / doors.FOLDER).mkdir()
    (tmp_path / doors.FOLDER / "fabric-41").touch()
    (tmp_path / run_folder.ERRORS).mkdir()
    error = {"rank": "0", "type": "CompareScriptError", "message": "fabric.backward='never called': ..."}
    (tmp_path / run_folder.ERRORS / "rank0.json").write_text(json.dumps(error))
    run = Candidate("native-O1", "native-O1", ["python", "train.py"], tmp_path, returncode=1)
    assert run.failure() == "CompareScriptError on rank 0: fabric.backward='never called': ..."


def run_through_site(tmp_path: Path, script: str, precision: str = "bf16-mixed") -> subprocess.CompletedProcess[str]:
    """``python -c script`` as a compare run of ``precision`` starts it, with its folder ``tmp_path``."""
    Plan("run", precision, steps=4, directory=str(tmp_path)).write(tmp_path / "plan.json")
    env = worker_env({PLAN_VARIABLE: str(tmp_path / "plan.json")})
    env["PYTHONPATH"] = os.pathsep.join([str(compare.SITE), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)


def markers_in(folder: Path) -> set[str]:
    return {path.name for path in (folder / doors.FOLDER).iterdir()} if (folder / doors.FOLDER).is_dir() else set()


def test_a_script_of_the_standalone_fabric_alone_is_patched_and_marked_as_its_import(tmp_path: Path) -> None:
    # lightning_fabric alone: its Fabric trains at the run's precision, and what compare imports itself to patch it
    # (lightning, pytorch_lightning) is no import of the script's.
    script = (
        "import os, lightning_fabric\n"
        "fabric = lightning_fabric.Fabric(accelerator='cpu', devices=1, precision='32-true')\n"
        "print(os.getpid(), fabric.strategy.precision.precision)\n"
    )
    result = run_through_site(tmp_path, script)
    pid, precision = result.stdout.split()
    assert precision == "bf16-mixed", result.stderr[-2000:]
    assert markers_in(tmp_path) == {"imported-lightning_fabric", f"fabric-{pid}"}


def test_a_script_that_builds_a_trainer_leaves_its_marker(tmp_path: Path) -> None:
    script = "import os, lightning\nlightning.Trainer(accelerator='cpu', devices=1, logger=False)\nprint(os.getpid())\n"
    result = run_through_site(tmp_path, script, precision="32-true")
    assert markers_in(tmp_path) == {"imported-lightning", f"trainer-{result.stdout.split()[-1]}"}, result.stderr[-2000:]


def test_compare_reports_a_script_that_builds_neither_door(tmp_path: Path) -> None:
    # A real compare run: the baseline exits 0 without a record, so compare stops after it (exit 2) and says why.
    out = tmp_path / "out"
    status = compare.main(["32-true", "native-O1", "--out", str(out), "--", sys.executable, "-c", "import lightning"])
    (entry, *_) = json.loads((out / "compare.json").read_text())["candidates"]
    assert status == 2
    assert entry["status"] == "failed"
    assert entry["reason"].startswith(
        f"command={sys.executable + ' -c ' + shlex.quote('import lightning')!r}: the script imported lightning but"
        " built neither a Trainer nor a Fabric"
    )
