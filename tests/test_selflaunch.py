"""Self-launch decisions that need no ranks: what is re-run, and when a process must not start ranks.

The launch itself runs for real in test_multiprocess.py (equivalence) and test_faults.py (restarts, exit status,
the line a preempted run ends with).
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed
import torch.distributed.run
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from lightning_ddp_amp import StrategyConfigurationError
from lightning_ddp_amp.ddp.launcher import StartMissingRanks
from lightning_ddp_amp.ddp.reconciler import TopologyReconciler
from lightning_ddp_amp.launch import selflaunch
from lightning_ddp_amp.launch.environment import SELF_LAUNCH_VARIABLE
from lightning_ddp_amp.launch.preemption import PREEMPTION, PREEMPTION_REPORT_VARIABLE
from lightning_ddp_amp.launch.selflaunch import _first_failure


def main_module(file: str | None = None, spec_name: str | None = None) -> types.ModuleType:
    """A ``__main__`` as Python sets it up for `python file`, `python -m spec_name`, or an interactive session."""
    module = types.ModuleType("__main__")
    if file is not None:
        module.__file__ = file
    module.__spec__ = None if spec_name is None else types.SimpleNamespace(name=spec_name)  # type: ignore[assignment]
    return module


def test_a_script_is_run_again_by_its_absolute_path_with_the_same_arguments(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    command = selflaunch.script_command(main_module(str(script)), ["train.py", "--lr", "0.1"])
    assert command == [str(script.resolve()), "--lr", "0.1"]


@pytest.mark.parametrize("spec_name", ["project.train", "project.__main__"])
def test_a_module_is_run_again_as_a_module(spec_name: str) -> None:
    command = selflaunch.script_command(main_module("/x/project/train.py", spec_name), ["/x/project/train.py", "-v"])
    assert command == ["-m", "project.train" if spec_name == "project.train" else "project", "-v"]


def test_a_zipapp_is_run_again_as_the_archive(tmp_path: Path) -> None:
    archive = tmp_path / "app.pyz"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("__main__.py", "")
    command = selflaunch.script_command(main_module(str(archive / "__main__.py")), [str(archive), "--fast"])
    assert command == [str(archive), "--fast"]


@pytest.mark.parametrize("argv0", ["", "-c"])
def test_no_script_file_is_an_error_naming_the_fix(argv0: str) -> None:
    with pytest.raises(StrategyConfigurationError, match="Python is not running a script file") as raised:
        selflaunch.script_command(main_module(None), [argv0])
    assert "torchrun --nproc-per-node=N train.py" in raised.value.fix


@pytest.mark.parametrize(
    ("main", "argv0"),
    [
        (main_module("/venv/lib/python3.11/site-packages/pytest/__main__.py", "pytest.__main__"), "-m"),
        (main_module("/venv/bin/pytest"), "/venv/bin/pytest"),
    ],
    ids=["python -m pytest", "the pytest script"],
)
def test_pytest_is_never_run_again_on_every_rank(main: types.ModuleType, argv0: str) -> None:
    # As pytest's own process sets up __main__ (a pytest-xdist worker is `python -c`: no script file, refused too).
    with pytest.raises(StrategyConfigurationError, match="every rank would run the whole test session"):
        selflaunch.script_command(main, [argv0, "tests/"])


def test_the_agent_of_a_self_launch_prints_only_what_it_does(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Up to the start of torchrun at fit, this is what `python train.py` runs in the process that becomes the agent.
    monkeypatch.setattr(selflaunch, "script_command", lambda: ["train.py"])
    started: list[list[str]] = []

    def launch(arguments: list[str]) -> None:
        started.append(arguments)
        raise SystemExit(0)  # as torchrun's agent exits once the ranks finished

    monkeypatch.setattr(selflaunch, "launch", launch)
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit):
        trainer = L.Trainer(strategy="envddp", accelerator="cpu", devices=2, precision="amp-O1", logger=False)
        trainer.fit(BoringModel())
    assert started == [["--standalone", "--nproc-per-node=2", "--max-restarts=0", "train.py"]]
    said = [record.getMessage() for record in caplog.records]
    assert [line for line in said if line.startswith(("envddp", "AmpPrecision"))] == [
        "envddp: no launcher variables and 2 devices: starting the ranks as"
        " `torchrun --standalone --nproc-per-node=2 --max-restarts=0 train.py`"
    ]


@pytest.mark.parametrize(
    ("front", "fix"),
    [("Trainer", "Leave the GPU to the LightningModule's hooks"), ("Fabric", "Call fabric.launch() before touching")],
)
def test_cuda_used_before_the_ranks_start_is_a_warning_with_the_fix_of_each_front_door(
    monkeypatch: pytest.MonkeyPatch, front: str, fix: str
) -> None:
    monkeypatch.setattr(selflaunch, "plan", lambda nproc, max_restarts: ["train.py"])
    monkeypatch.setattr(selflaunch, "launch", lambda arguments: sys.exit(0))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    reconciler = TopologyReconciler(front=front)
    reconciler.requested = [torch.device("cuda", 0), torch.device("cuda", 1)]
    strategy = types.SimpleNamespace(accelerator=CUDAAccelerator(), max_restarts=0)
    started = rf"^CUDA was used before the {front} started the ranks"
    with pytest.warns(UserWarning, match=started) as warned, pytest.raises(SystemExit):
        StartMissingRanks(reconciler, strategy).launch(lambda: None)
    assert fix in str(warned[0].message)


def test_a_rank_of_a_self_launch_does_not_launch_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SELF_LAUNCH_VARIABLE, "1")
    with pytest.raises(StrategyConfigurationError, match="starting ranks again would never end"):
        selflaunch.plan(2, 0)


@pytest.mark.parametrize("name", ["PMI_SIZE", "MV2_COMM_WORLD_SIZE", "JSM_NAMESPACE_SIZE"])
def test_processes_of_a_launcher_envddp_does_not_read_do_not_each_start_a_job(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, "4")
    with pytest.raises(StrategyConfigurationError) as raised:
        selflaunch.plan(2, 0)
    assert f"a launcher envddp does not read started this process ({name}='4')" in str(raised.value)


def failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    """torchrun's record of a rank that failed without an error file, stamped ``timestamp`` (whole seconds)."""
    recorded = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")
    recorded.timestamp = timestamp
    return recorded


def test_within_the_same_second_the_rank_killed_by_a_signal_failed_first() -> None:
    # Rank 1 was SIGKILLed; rank 0 then failed on the broken connection, stamped in the same second.
    assert _first_failure([failure(0, 1, 100), failure(1, -9, 100)]).local_rank == 1


def test_an_earlier_failure_comes_first_whatever_its_kind() -> None:
    assert _first_failure([failure(0, 1, 99), failure(1, -9, 100)]).local_rank == 0


def test_a_rank_killed_by_a_signal_makes_the_self_launch_exit_128_plus_the_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchrun records -9 for a SIGKILLed rank; a shell, a scheduler and a CI job read 137 as "killed by SIGKILL".
    def torchrun(arguments: list[str]) -> None:
        raise ChildFailedError("train.py", {0: failure(0, 1, 100), 1: failure(1, -signal.SIGKILL, 100)})

    monkeypatch.setattr(torch.distributed.run, "main", torchrun)
    monkeypatch.setattr(gc, "freeze", lambda: None)  # the agent's last act before its exit, not this test's
    monkeypatch.setenv(SELF_LAUNCH_VARIABLE, "")  # set by launch for its ranks; restored after the test
    monkeypatch.setenv(PREEMPTION_REPORT_VARIABLE, "")
    with pytest.raises(SystemExit) as exited:
        selflaunch.launch([])
    assert exited.value.code == 128 + signal.SIGKILL


# --- after the ranks: preempted or crashed ------------------------------------------------------------------------


@pytest.fixture
def report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The file a self-launch's agent creates for rank 0's preemption report, exported as the agent does."""
    path = tmp_path / "report.txt"
    path.write_text("")
    monkeypatch.setenv(PREEMPTION_REPORT_VARIABLE, str(path))
    yield path
    PREEMPTION.stop()


def test_rank_zero_reports_the_checkpoint_it_saved_and_the_next_training_start_forgets_it(report: Path) -> None:
    PREEMPTION.saved(Path("checkpoints") / "preempted-step=12.ckpt")
    assert report.read_text() == str(Path("checkpoints") / "preempted-step=12.ckpt")
    PREEMPTION.start(graceful=True)  # a restarted attempt: the earlier checkpoint is not what it saves
    assert report.read_text() == ""


def test_only_rank_zero_reports(report: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every rank takes part in the save; the file is the agent's, and one writer is enough.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    PREEMPTION.saved(Path("preempted-step=12.ckpt"))
    assert report.read_text() == ""


def test_without_a_self_launch_nothing_is_reported(report: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREEMPTION_REPORT_VARIABLE)
    PREEMPTION.saved(Path("preempted-step=12.ckpt"))
    assert report.read_text() == ""


@pytest.mark.parametrize("exitcodes", [[143, 143], [143, -15], [-15]], ids=["both-143", "peer-stopped", "signalled"])
def test_ranks_that_saved_and_exited_on_sigterm_were_preempted(report: Path, exitcodes: list[int]) -> None:
    report.write_text("checkpoints/preempted-step=12.ckpt")
    failures = [failure(rank, code, 100) for rank, code in enumerate(exitcodes)]
    assert selflaunch.preempted_checkpoint(str(report), failures) == "checkpoints/preempted-step=12.ckpt"


@pytest.mark.parametrize("exitcodes", [[143, 1], [-9, 143]], ids=["exit-1", "sigkill"])
def test_any_other_failure_is_a_crash_even_after_a_preemption_save(report: Path, exitcodes: list[int]) -> None:
    report.write_text("checkpoints/preempted-step=12.ckpt")
    failures = [failure(rank, code, 100) for rank, code in enumerate(exitcodes)]
    assert selflaunch.preempted_checkpoint(str(report), failures) is None


def test_a_sigterm_without_a_saved_checkpoint_is_not_a_preemption(report: Path) -> None:
    # auto_resume=False, or SIGTERM outside the training loop: the ranks die of it and save nothing.
    assert selflaunch.preempted_checkpoint(str(report), [failure(0, -15, 100), failure(1, 143, 100)]) is None
