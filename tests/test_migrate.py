"""A half-trained classic apex run continues under Lightning: convert_apex_checkpoint (lightning_ddp_amp.commands.convert).

On 2 real ranks (forked, conftest.Preloaded; apex through its CPU double): the classic recipe
(workers/train_apex_recipe.py, Adam and a per-step LR schedule) trains 2 epochs and saves apex's recommended
checkpoint after the first; the checkpoint is converted and train_amp.py (the same two sub-models under
``Trainer(strategy="envddp")``) continues it for the second epoch. The continued run must end where the classic run
that never stopped ended (0.0 under O0 and O1). Under O2 the classic checkpoint holds only fp16 weights: the continued
run's masters must start as those weights, its optimizer state as saved, and it ends within Adam's steps of the
uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import runpy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import Preloaded, Torchrun, check, max_abs_difference, needs_cpu_fp16

from lightning_ddp_amp import AmpPrecision, CheckpointError, convert_apex_checkpoint
from lightning_ddp_amp.commands.convert import CONVERTED_KEY

STEPS_PER_EPOCH = 8  # 64 samples, 2 ranks, 4 samples per rank per step
#: apex O2's checkpoint has the fp16 roundings of its fp32 masters; continued from them, the weights drift from the
#: uninterrupted run's by up to Adam's step size (lr 0.01) per step (measured: 0.019 after 8 steps).
O2_DRIFT = 0.05


class TwoModels(L.LightningModule):
    """train_amp.py's sub-models (names and shapes are what the conversion reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh())
        self.model_b = torch.nn.Linear(16, 1)


class OneModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def classic(preloaded: Preloaded, out: Path, *args: str) -> dict[str, Any]:
    saved = preloaded.reference("train_apex_recipe.py", "--optimizer", "adam", *args, out=out)
    return torch.load(saved)


def lightning(preloaded: Preloaded, out: Path, *args: str) -> dict[str, Any]:
    out.mkdir(parents=True)
    preloaded.run("train_amp.py", "--out", str(out), "--optimizer", "adam", *args, log=out / "logs").check()
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    logs = (out / "logs" / "rank0.log").read_text()
    return {"reports": reports, "logs": logs, "directory": out, **torch.load(out / "amp_state.pt")}


class Continued:
    """One opt_level: the uninterrupted classic run (which saved after epoch 1), and its continuation."""

    def __init__(self, preloaded: Preloaded, root: Path, opt_level: str) -> None:
        self.checkpoint = root / "classic.pt"
        self.uninterrupted = classic(
            preloaded, root / "classic", "--opt-level", opt_level, "--save-classic", str(self.checkpoint)
        )
        self.converted = convert_apex_checkpoint(self.checkpoint, TwoModels(), root / "converted.ckpt")
        self.continued = lightning(
            preloaded, root / "continued", "--precision", f"apex-{opt_level}", "--resume", str(self.converted)
        )


class Runs(dict[str, Continued]):
    """The runs of each opt_level, started when a test first asks for them (O0 needs no CPU float16)."""

    def __init__(self, preloaded: Preloaded, root: Path) -> None:
        super().__init__()
        self.preloaded, self.root = preloaded, root

    def __missing__(self, opt_level: str) -> Continued:
        self[opt_level] = Continued(self.preloaded, self.root / opt_level, opt_level)
        return self[opt_level]


@pytest.fixture(scope="module")
def runs(preloaded: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(preloaded, tmp_path_factory.mktemp("migrate"))


LEVELS = ["O0", pytest.param("O1", marks=needs_cpu_fp16), pytest.param("O2", marks=needs_cpu_fp16)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("opt_level", LEVELS[:2])
def test_a_continued_classic_checkpoint_ends_in_the_uninterrupted_runs_weights(runs: Runs, opt_level: str) -> None:
    run = runs[opt_level]
    assert max_abs_difference(run.uninterrupted["model"], run.continued["model"]) == 0.0
    masters = zip(run.uninterrupted["master_params"], run.continued["master_params"], strict=True)
    assert max((a - b).abs().max().item() for a, b in masters) == 0.0
    assert run.continued["amp"] == run.uninterrupted["amp"]  # the loss scale went on from the saved one


@pytest.mark.multiprocess
@pytest.mark.parametrize("opt_level", LEVELS)
def test_epoch_step_scheduler_and_loss_scale_are_carried(runs: Runs, opt_level: str) -> None:
    run = runs[opt_level]
    saved = torch.load(run.checkpoint, weights_only=False)
    for report in run.continued["reports"]:
        assert report["at_start"]["global_step"] == STEPS_PER_EPOCH
        assert report["global_step"] == 2 * STEPS_PER_EPOCH
        assert report["scheduler_steps"] == 2 * STEPS_PER_EPOCH - run.uninterrupted["skipped"]
        scalers = report["at_start"]["precision_state"]["loss_scalers"]
        assert [scaler["loss_scale"] for scaler in scalers] == [saved["amp"]["loss_scaler0"]["loss_scale"]]


@pytest.mark.multiprocess
@needs_cpu_fp16
def test_under_o2_the_masters_are_rebuilt_from_the_fp16_weights_as_apex_resumes_and_rank_zero_says_so(
    runs: Runs,
) -> None:
    run = runs["O2"]
    saved = torch.load(run.checkpoint, weights_only=False)
    at_start = torch.load(run.continued["directory"] / "at_start.pt")
    # apex O2's state_dict(): fp32 tensors holding the fp16 weights (BatchNorm's own fp32 ones beside them); the
    # masters are rebuilt from them, as apex builds its masters from the model's fp16 weights after a resume.
    classic = [*saved["model_a"].values(), *saved["model_b"].values()]
    parameters = [tensor for tensor in classic if tensor.is_floating_point() and tensor.dim() > 0][:4] + classic[-2:]
    assert [tensor.shape for tensor in at_start["master_params"]] == [tensor.shape for tensor in parameters]
    assert all(torch.equal(a, b) for a, b in zip(at_start["master_params"], parameters, strict=True))
    # Adam's moments stay fp32. apex's own resume loads them into the fp16 parameters before it builds the
    # masters, which rounds them to fp16: model_a's bias's second moments (about 1e-13) become 0 there.
    for index, state in saved["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(at_start["optimizer"]["state"][index][name], value), (index, name)
    # Against the run that never stopped: its masters held more than fp16 at the save, which Adam's normalized
    # steps (lr 0.01) carry on for 8 steps.
    drift = max_abs_difference(run.uninterrupted["model"], run.continued["model"])
    assert 0.0 < drift <= O2_DRIFT
    said = "the fp32 master weights are rebuilt from them, as apex's own resume does"
    assert run.continued["logs"].count(said) == 1


@pytest.mark.multiprocess
@needs_cpu_fp16
def test_a_classic_apex_checkpoint_continues_under_torchs_amp_with_its_loss_scale(
    preloaded: Preloaded, runs: Runs, tmp_path: Path
) -> None:
    run = runs["O1"]
    native = lightning(
        preloaded, tmp_path / "native", "--precision", "plugin", "--opt-level", "O1", "--resume", str(run.converted)
    )
    saved = torch.load(run.checkpoint, weights_only=False)
    for report in native["reports"]:
        assert report["at_start"]["global_step"] == STEPS_PER_EPOCH
        scale = report["at_start"]["precision_state"]["grad_scaler"]["scale"]
        assert scale == saved["amp"]["loss_scaler0"]["loss_scale"]
    assert "Resuming a checkpoint of apex amp O1 under AmpPrecision(backend='native'" in native["logs"]
    # Another autocast for its second epoch: close to the apex run, not equal.
    assert max_abs_difference(run.uninterrupted["model"], native["model"]) < 1e-2


# --- the classic example, stopped, then continued by its own resume and under the Trainer ---------------------

EXAMPLES = Path(__file__).parents[1] / "examples"
EXAMPLE_STEPS = 16  # a training epoch of examples/classic/train.py on 2 ranks: 1024 samples, 32 a rank a batch


def reported(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage() for record in caplog.records if record.getMessage().startswith("convert_apex_checkpoint:")
    ]


@pytest.mark.multiprocess
@needs_cpu_fp16
def test_the_classic_examples_checkpoint_continues_under_the_trainer_with_the_epochs_its_own_resume_trains(
    torchrun: Torchrun, preloaded: Preloaded, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # examples/classic/train.py (the apex double) trains 2 epochs and saves "epoch": 2, the epochs done, as apex's
    # ImageNet example does; its own --resume then trains epoch 2 alone.
    classic, resumed = tmp_path / "classic.pt", tmp_path / "resumed.pt"
    script = str(EXAMPLES / "classic" / "train.py")
    check(torchrun.run(script, "--checkpoint", str(classic), apex_double=True))
    more = ("--epochs", "3", "--resume", str(classic), "--checkpoint", str(resumed))
    said = check(torchrun.run(script, *more, apex_double=True)).stdout
    assert [line.split(":")[0] for line in said.splitlines() if line.startswith("epoch ")] == ["epoch 2"]
    # Converted, it says where the Trainer continues, and what the file cannot say: the step count.
    two_models = runpy.run_path(str(EXAMPLES / "two_models_one_optimizer.py"))["TwoModels"]
    with caplog.at_level(logging.INFO):
        default = convert_apex_checkpoint(classic, two_models())
    # Word for word what docs/resume.md shows for this checkpoint.
    (report,) = reported(caplog)
    page = (EXAMPLES.parent / "docs" / "resume.md").read_text()
    shown = "convert_apex_checkpoint:" + page.split("```text\nconvert_apex_checkpoint:", 1)[1].split("```", 1)[0]
    paths = {"runs/classic/checkpoint-lightning.ckpt": str(default), "runs/classic/checkpoint.pt": str(classic)}
    assert report + "\n" == re.sub("|".join(map(re.escape, paths)), lambda found: paths[found.group()], shown)
    assert "continues it at epoch 2, global step 0." in report and "it holds no step count" in report
    # With the steps done passed, the migrated example trains epoch 2 alone and counts its steps on from there.
    converted = convert_apex_checkpoint(classic, two_models(), tmp_path / "c.ckpt", global_step=2 * EXAMPLE_STEPS)
    migrated = tmp_path / "migrated"
    ran = preloaded.run(
        str(EXAMPLES / "two_models_one_optimizer.py"), *more[:2], "--resume", str(converted),
        "--checkpoints", str(migrated), log=tmp_path / "logs",
    ).check()  # fmt: skip
    assert "trained under apex amp O1 on 2 rank(s)" in ran.stdout
    assert [path.name for path in migrated.iterdir()] == [f"epoch=2-step={3 * EXAMPLE_STEPS}.ckpt"]
    after = torch.load(next(migrated.iterdir()), weights_only=False)["state_dict"]
    before = torch.load(resumed, weights_only=False)
    weights = {f"{model}.{name}": value for model in ("model_a", "model_b") for name, value in before[model].items()}
    assert max_abs_difference(weights, after) == 0.0


# --- the mapping, in this process ------------------------------------------------------------------------------


def save(tmp_path: Path, **classic: Any) -> Path:
    path = tmp_path / "classic.pt"
    torch.save(classic, path)
    return path


def weights(module: torch.nn.Module, prefix: str = "", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}{k}": torch.full_like(v, i, dtype=dtype or v.dtype)
        for i, (k, v) in enumerate(module.state_dict().items())
    }


def converted(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, weights_only=False)
    return loaded


def test_a_single_model_goes_under_the_one_submodule_its_names_fit_or_on_the_module_itself(tmp_path: Path) -> None:
    module = OneModel()
    out = convert_apex_checkpoint(save(tmp_path, model=weights(module.net, "module.")), module, tmp_path / "a.ckpt")
    state = converted(out)["state_dict"]
    assert sorted(state) == sorted(module.state_dict())
    assert state["net.2.bias"].item() == 3  # the 4th tensor of the classic state_dict, "module." dropped

    bare = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    out = convert_apex_checkpoint(save(tmp_path, model=weights(bare)), bare, tmp_path / "b.ckpt")
    assert sorted(converted(out)["state_dict"]) == sorted(bare.state_dict())


def test_sub_models_go_under_the_submodules_they_are_named_after_and_the_rest_is_carried(tmp_path: Path) -> None:
    module = TwoModels()
    optimizer = {"state": {}, "param_groups": [{"lr": 0.1, "params": list(range(7))}]}
    path = save(
        tmp_path,
        model_a=weights(module.model_a, "module."), model_b=weights(module.model_b), optimizer=optimizer,
        amp={"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}}, scheduler={"last_epoch": 40}, epoch=5,
        step=40,
    )  # fmt: skip
    out = converted(convert_apex_checkpoint(path, module))
    assert Path(path.parent / "classic-lightning.ckpt").is_file()  # the default name
    assert sorted(out["state_dict"]) == sorted(module.state_dict())
    assert (out["epoch"], out["global_step"]) == (5, 40)
    assert out["optimizer_states"] == [optimizer] and out["lr_schedulers"] == [{"last_epoch": 40}]
    assert out[AmpPrecision.__qualname__] == {
        "backend": "apex",
        "opt_level": "O1",
        "loss_scalers": [{"loss_scale": 1024.0, "unskipped": 7}],
    }
    assert out[CONVERTED_KEY]["opt_level"] == "O1"
    fit = out["loops"]["fit_loop"]
    assert fit["epoch_progress"]["current"]["completed"] == 5
    assert fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]["completed"] == 40


def test_the_report_names_the_entries_read_and_the_counts_passed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module = TwoModels()
    amp = {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}}
    path = save(
        tmp_path, model_a=weights(module.model_a), model_b=weights(module.model_b), amp=amp,
        scheduler={"last_epoch": 40}, epoch=5, step=40,
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        convert_apex_checkpoint(path, module)
        convert_apex_checkpoint(path, module, epoch=6, global_step=48)
    read, passed = (report.splitlines() for report in reported(caplog))
    assert read[1:3] == [
        "  epoch 5: its 'epoch' (5), read as the epochs done, as apex's ImageNet example saves epoch + 1 (if it is the"
        " epoch last trained, pass epoch=6)",
        "  global step 40: its 'step' (40), the optimizer steps done",
    ]
    assert read[3:] == [
        "  carried: the weights (model_a, model_b), the LR scheduler's state, apex amp O1's loss scale (1024)",
        "  not in it: the optimizer's state ('optimizer': momentum and Adam's moments start at zero)",
    ]
    assert passed[1:3] == [
        "  epoch 6: epoch=6, as passed (its 'epoch' holds 5)",
        "  global step 48: global_step=48, as passed",
    ]


def test_without_an_amp_state_no_apex_state_is_written_and_the_report_names_no_backend(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # apex's ImageNet example saves no amp.state_dict(): nothing in the file says how it was trained.
    module = OneModel()
    path = save(tmp_path, model=weights(module.net), optimizer=sgd_state(module.net), epoch=3)
    with caplog.at_level(logging.INFO):
        out = converted(convert_apex_checkpoint(path, module))
    assert AmpPrecision.__qualname__ not in out
    (report,) = reported(caplog)
    assert "apex amp" not in report and "O1" not in report
    assert report.splitlines()[-1] == (
        "  not in it: the LR scheduler's state ('scheduler': a schedule starts from its beginning), a loss scale"
        " ('amp': the loss scaler starts at its initial scale)"
    )


def test_fp16_weights_are_apex_o2s_and_become_fp32_to_rebuild_the_masters_from(tmp_path: Path) -> None:
    module = TwoModels()
    path = save(tmp_path, model_a=weights(module.model_a, dtype=torch.float16), model_b=weights(module.model_b))
    out = converted(convert_apex_checkpoint(path, module))
    assert {tensor.dtype for name, tensor in out["state_dict"].items() if "num_batches" not in name} == {torch.float32}
    state = out[AmpPrecision.__qualname__]
    assert (state["opt_level"], state["rebuild_masters"]) == ("O2", True)
    assert (
        converted(convert_apex_checkpoint(path, module, opt_level="O3"))[AmpPrecision.__qualname__]["opt_level"] == "O3"
    )


def test_a_lightning_fit_continues_at_the_converted_epoch_and_step(tmp_path: Path) -> None:
    class Regression(OneModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    module = Regression()
    optimizer = torch.optim.SGD(module.net.parameters(), lr=0.1, momentum=0.9)
    module.net(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    path = save(tmp_path, model=module.net.state_dict(), optimizer=optimizer.state_dict(), epoch=3, step=12)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4
    )
    trainer = L.Trainer(
        max_epochs=5, accelerator="cpu", strategy="envddp", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    epochs: list[int] = []
    momentum: list[torch.Tensor] = []
    fresh = Regression()
    fresh.on_train_start = lambda: momentum.extend(  # type: ignore[method-assign]
        state["momentum_buffer"].clone() for state in trainer.optimizers[0].state.values()
    )
    fresh.on_train_epoch_start = lambda: epochs.append(trainer.current_epoch)  # type: ignore[method-assign]
    trainer.fit(fresh, loader, ckpt_path=convert_apex_checkpoint(path, fresh))
    assert epochs == [3, 4]
    assert trainer.global_step == 12 + 2 * 4
    saved = [state["momentum_buffer"] for state in optimizer.state_dict()["state"].values()]
    assert len(momentum) == len(saved) == 4 and all(torch.equal(a, b) for a, b in zip(momentum, saved, strict=True))


@pytest.mark.parametrize(
    ("classic", "message"),
    [
        (
            {"model": {"layers.0.weight": torch.zeros(16, 8)}},
            "its entry 'model' holds 'layers.0.weight', and TwoModels has no 'model.layers.0.weight'",
        ),
        (
            {"model_a": {"0.weight": torch.zeros(16, 8)}},
            "TwoModels's 'model_a.0.bias' is in none of its model entries (model_a) (7 more missing)",
        ),
        (
            {"model_a": {"0.weight": torch.zeros(4, 8)}},
            "its 'model_a'['0.weight'] has shape (4, 8), TwoModels's 'model_a.0.weight' (16, 8)",
        ),
        ({"optimizer": {"state": {}}}, "none of its entries (optimizer) is a model's state_dict"),
        ({"model_a": {"x": torch.zeros(1)}, "amp": {"scale": 1.0}}, "its 'amp' entry is not amp.state_dict()"),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_an_error_naming_the_first_key_that_does_not(
    tmp_path: Path, classic: dict[str, Any], message: str
) -> None:
    with pytest.raises(CheckpointError, match="Fix: ") as error:
        convert_apex_checkpoint(save(tmp_path, **classic), TwoModels())
    assert message in str(error.value)
    assert str(tmp_path / "classic.pt") in str(error.value)


def test_an_entry_named_with_names_goes_there_and_a_wrong_name_is_refused(tmp_path: Path) -> None:
    module = OneModel()
    path = save(tmp_path, weights=weights(module.net))
    assert sorted(converted(convert_apex_checkpoint(path, module, names={"weights": "net"}))["state_dict"]) == sorted(
        module.state_dict()
    )
    with pytest.raises(CheckpointError, match=r"names=\{'model': 'net'\}: the checkpoint has no model entry 'model'"):
        convert_apex_checkpoint(path, module, names={"model": "net"})


def test_a_lightning_checkpoint_or_a_missing_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"there is no such file\. Fix: pass the file the classic script saved"):
        convert_apex_checkpoint(tmp_path / "missing.pt", OneModel())
    path = save(tmp_path, state_dict={}, loops={})
    with pytest.raises(CheckpointError, match=r"it is already a Lightning checkpoint\. Fix: pass it to trainer\.fit"):
        convert_apex_checkpoint(path, OneModel())
    path = save(tmp_path, model=weights(OneModel().net), epoch="3")
    with pytest.raises(CheckpointError, match="epoch='3': it must be a whole number"):
        convert_apex_checkpoint(path, OneModel())


# --- reading the file runs none of its code --------------------------------------------------------------------


class RunsCode:
    """What a hostile checkpoint can hold: unpickled, it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.fixture(params=["this torch", "torch before 2.5"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way a checkpoint is read: torch's weights-only unpickler with safe_globals (torch 2.5 on), and the
    restricted pickle of torch 2.1 to 2.4 (which have no safe_globals)."""
    if request.param == "torch before 2.5":
        monkeypatch.delattr(torch.serialization, "safe_globals", raising=False)
    return str(request.param)


def refused_message(path: Path) -> str:
    return (
        f"checkpoint={str(path)!r}: it names builtins.exec, which is not a tensor, a plain value or argparse.Namespace:"
        " unpickling it could run any code, so nothing of it was built. Fix: if you trust where the file comes from,"
        " pass trusted=True; otherwise ask for a checkpoint of state_dicts and plain values"
    )


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_and_nothing_of_it_runs(
    tmp_path: Path, reader: str
) -> None:
    module = TwoModels()
    marker = tmp_path / "ran"
    path = save(tmp_path, model_a=weights(module.model_a), model_b=weights(module.model_b), amp=RunsCode(marker))
    with pytest.raises(CheckpointError) as error:
        convert_apex_checkpoint(path, module)
    assert str(error.value) == refused_message(path)
    assert not marker.exists()
    assert not (tmp_path / "classic-lightning.ckpt").exists()


def test_a_legacy_format_checkpoint_whose_pickle_would_run_code_is_refused_too(tmp_path: Path, reader: str) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "classic.pt"
    torch.save({"model": weights(OneModel().net), "amp": RunsCode(marker)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError) as error:
        convert_apex_checkpoint(path, OneModel())
    assert str(error.value) == refused_message(path)
    assert not marker.exists()


def test_trusted_reads_a_file_that_names_more_and_runs_what_its_pickle_says(tmp_path: Path) -> None:
    module = TwoModels()
    marker = tmp_path / "ran"
    path = save(tmp_path, model_a=weights(module.model_a), model_b=weights(module.model_b), amp=RunsCode(marker))
    out = converted(convert_apex_checkpoint(path, module, trusted=True))
    assert marker.read_text() == "ran"  # exec returned None: a run without loss scaling
    assert sorted(out["state_dict"]) == sorted(module.state_dict())


def sgd_state(module: torch.nn.Module) -> dict[str, Any]:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()


def test_apex_imagenet_examples_checkpoint_loads_as_torch_1_saved_it(tmp_path: Path, reader: str) -> None:
    # apex/examples/imagenet/main_amp.py: save_checkpoint({"epoch": epoch + 1, "arch": args.arch, "state_dict":
    # model.state_dict(), "best_prec1": best_prec1, "optimizer": optimizer.state_dict()}), the model under apex's DDP.
    module = OneModel()
    optimizer = sgd_state(module.net)
    path = tmp_path / "checkpoint.pth.tar"
    torch.save(
        {"epoch": 3, "arch": "resnet50", "state_dict": weights(module.net, "module."), "best_prec1": 61.5,
         "optimizer": optimizer},
        path, _use_new_zipfile_serialization=False,  # torch before 1.6, as in apex's time
    )  # fmt: skip
    out = converted(convert_apex_checkpoint(path, module))
    assert sorted(out["state_dict"]) == sorted(module.state_dict())
    assert out["epoch"] == 3
    saved = [state["momentum_buffer"] for state in optimizer["state"].values()]
    carried = [state["momentum_buffer"] for state in out["optimizer_states"][0]["state"].values()]
    assert len(carried) == 4 and all(torch.equal(a, b) for a, b in zip(carried, saved, strict=True))


def test_the_classic_scripts_checkpoint_loads(tmp_path: Path, reader: str) -> None:
    # examples/classic/train.py: {"model_a": ..., "model_b": ..., "optimizer": ..., "amp": amp.state_dict()}
    module = TwoModels()
    path = save(
        tmp_path, model_a=weights(module.model_a, "module."), model_b=weights(module.model_b, "module."),
        optimizer={"state": {}, "param_groups": [{"lr": 0.1, "momentum": 0.0, "params": list(range(7))}]},
        amp={"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 3}},
    )  # fmt: skip
    out = converted(convert_apex_checkpoint(path, module))
    assert out[AmpPrecision.__qualname__]["loss_scalers"] == [{"loss_scale": 65536.0, "unskipped": 3}]


def test_a_checkpoint_with_the_scripts_parsed_args_loads(tmp_path: Path, reader: str) -> None:
    module = OneModel()
    args = argparse.Namespace(arch="resnet50", lr=0.1, opt_level="O1", epochs=90)
    path = save(tmp_path, model=weights(module.net), optimizer=sgd_state(module.net), args=args, epoch=2)
    out = converted(convert_apex_checkpoint(path, module))
    assert out["epoch"] == 2 and sorted(out["state_dict"]) == sorted(module.state_dict())


def test_the_converted_checkpoint_is_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = OneModel()
    path = save(tmp_path, model=weights(module.net))
    target = convert_apex_checkpoint(path, module)
    before = target.read_bytes()

    def killed_halfway(obj: object, file: Any, *args: Any, **kwargs: Any) -> None:
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        convert_apex_checkpoint(path, module, epoch=7)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["classic-lightning.ckpt", "classic.pt"]


# --- the migration table's traps, each as a classic/migrated pair ---------------------------------------------


def pair_run(preloaded: Preloaded, out: Path, *args: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    preloaded.run("migration_pairs.py", "--out", str(out), *args, log=out / "logs").check()
    return torch.load(out / "weights.pt"), json.loads((out / "lrs.json").read_text())


@pytest.mark.multiprocess
@needs_cpu_fp16
def test_accumulation_moves_to_accumulate_grad_batches_and_a_kept_division_divides_twice(
    preloaded: Preloaded, tmp_path: Path
) -> None:
    accumulate = ("--accumulate", "2")
    classic_weights, _ = pair_run(preloaded, tmp_path / "classic", "--mode", "classic", *accumulate)
    migrated, _ = pair_run(preloaded, tmp_path / "migrated", "--mode", "lightning", *accumulate)
    assert max_abs_difference(classic_weights, migrated) == 0.0
    divided_twice, _ = pair_run(preloaded, tmp_path / "kept", "--mode", "lightning", *accumulate, "--keep-division")
    assert max_abs_difference(classic_weights, divided_twice) > 1e-3  # trains, on half the gradient


@pytest.mark.multiprocess
@needs_cpu_fp16
def test_a_per_iteration_warmup_needs_interval_step_or_it_lasts_as_many_epochs(
    preloaded: Preloaded, tmp_path: Path
) -> None:
    warmup = ("--warmup", "6")
    classic_weights, classic_lrs = pair_run(preloaded, tmp_path / "classic", "--mode", "classic", *warmup)
    migrated, migrated_lrs = pair_run(preloaded, tmp_path / "migrated", "--mode", "lightning", *warmup)
    assert (
        migrated_lrs == classic_lrs and len(classic_lrs) == 16 and classic_lrs[-1] == classic_lrs[-4] > classic_lrs[0]
    )
    assert max_abs_difference(classic_weights, migrated) == 0.0
    per_epoch, per_epoch_lrs = pair_run(
        preloaded, tmp_path / "epoch", "--mode", "lightning", *warmup, "--interval", "epoch"
    )
    assert per_epoch_lrs == [per_epoch_lrs[0]] * 8 + [per_epoch_lrs[8]] * 8  # once an epoch: 2 epochs in, warming up
    assert per_epoch_lrs[8] < classic_lrs[-1]
    assert max_abs_difference(classic_weights, per_epoch) > 1e-3


def test_an_unreadable_file_a_non_dict_and_an_unknown_opt_level_are_refused_with_the_fix(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(b"PK\x03\x04 not a whole checkpoint")
    with pytest.raises(
        CheckpointError, match=r"it cannot be read \(.*\)\. Fix: pass the file the classic script saved"
    ):
        convert_apex_checkpoint(truncated, OneModel())
    listed = tmp_path / "listed.pt"
    torch.save([1, 2], listed)
    with pytest.raises(
        CheckpointError, match=r"it holds a list, not the dict a classic script saves\. Fix: save \{'model'"
    ):
        convert_apex_checkpoint(listed, OneModel())
    path = save(tmp_path, model=weights(OneModel().net))
    with pytest.raises(
        CheckpointError, match=r"^opt_level='O4': apex's opt_levels are O0, O1, O2 and O3\. Fix: e\.g\."
    ):
        convert_apex_checkpoint(path, OneModel(), opt_level="O4")
