"""Fault injection with real processes and signals: crashes under torchrun restarts, preemption, dead and hanging
peers, a rank alone, a checkpoint write killed halfway, broken checkpoints (workers/train_faults.py); a mid-epoch
checkpoint resumed on another number of ranks is test_elastic.py's."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    WORKERS,
    Preloaded,
    Ranks,
    Torchrun,
    check,
    finish,
    free_port,
    kill,
    launcher_variables,
    max_abs_difference,
    needs_cpu_fp16,
    start_python,
)

pytestmark = [pytest.mark.faults, pytest.mark.multiprocess]

SCRIPT = str(WORKERS / "train_faults.py")
STEPS = 24  # 3 epochs of 8 steps on 2 ranks


def report(out: Path, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "weights.pt")


def wait_for(path: Path, process: subprocess.Popen[str], timeout: float = 120) -> None:
    """Wait until ``path`` exists (a worker's progress marker); fail if the process ends or time runs out."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            pytest.fail(f"the run ended before {path.name} appeared:\n{process.communicate()[0][-4000:]}")
        if time.monotonic() > deadline:
            kill(process)
            pytest.fail(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)


def wait_for_step(out: Path, step: int, process: subprocess.Popen[str]) -> None:
    marker = out / "progress" / "rank0"
    wait_for(marker, process)
    while (text := marker.read_text()) == "" or int(text) < step:
        if process.poll() is not None:
            pytest.fail(f"the run ended before step {step}:\n{process.communicate()[0][-4000:]}")
        time.sleep(0.05)


def run(torchrun: Torchrun, out: Path, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    return check(torchrun.run(SCRIPT, "--out", str(out), *args, timeout=240, **kwargs))


def run_forked(preloaded: Preloaded, out: Path, *args: str) -> Ranks:
    """2 ranks with torchrun's variables, forked from the preloaded interpreter: for the runs a fault is compared
    with, and the starts after one, which are not about torchrun's agent."""
    out.mkdir(parents=True, exist_ok=True)
    return preloaded.run(
        SCRIPT, "--out", str(out), *args, log=out / "logs" / str(len(list(out.glob("logs/*"))))
    ).check()


def crash_and_restart(preloaded: Preloaded, out: Path, *args: str) -> Ranks:
    """What torchrun --max-restarts=1 does after a rank's crash, on forked ranks: the first attempt fails (a rank
    kills itself, the others are ended), the second starts with TORCHELASTIC_RESTART_COUNT=1. For the tests of what
    a restart restores; what the agent does is test_a_killed_rank_restarts_under_torchrun's."""
    out.mkdir(parents=True, exist_ok=True)
    first = preloaded.run(SCRIPT, "--out", str(out), *args, log=out / "logs" / "attempt0")
    assert first.returncode != 0, first.stdout[-4000:]
    port = free_port()
    restarted = [{**launcher_variables(rank, port), "TORCHELASTIC_RESTART_COUNT": "1"} for rank in (0, 1)]
    return preloaded.run(SCRIPT, "--out", str(out), *args, log=out / "logs" / "attempt1", env=restarted).check()


def run_plain(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python train_faults.py ...` with no launcher: with --devices 2 the strategy starts the ranks itself."""
    out.mkdir(parents=True, exist_ok=True)
    return finish(start_python(SCRIPT, "--out", str(out), *args), timeout=240)


def start_ranks_by_hand(
    out: Path, *args: str, ranks: tuple[int, ...] = (0, 1), launcher: str = "torchrun"
) -> list[subprocess.Popen[str]]:
    """Start ranks as plain processes with the variables ``launcher`` exports: no agent to supervise them."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    variables = launcher_variables if launcher == "torchrun" else functools.partial(task_variables, launcher)
    return [start_python(SCRIPT, "--out", str(out), *args, env=variables(rank, port)) for rank in ranks]


def task_variables(launcher: str, rank: int, port: int) -> dict[str, str]:
    """What `srun --ntasks=2` or `mpirun -np 2 -x MASTER_PORT` exports to task ``rank`` of a one-node job.

    Each rank is the launcher's own task, so what srun and mpirun report is the rank's own exit status.
    """
    if launcher == "srun":
        return {
            "SLURM_JOB_ID": "4711",
            "SLURM_JOB_NAME": "train",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_STEP_NODELIST": "127.0.0.1",
            "SLURM_JOB_NODELIST": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "0",
        "MASTER_PORT": str(port),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def uninterrupted(preloaded: Preloaded, runs: Path) -> Path:
    run_forked(preloaded, runs / "uninterrupted")
    return runs / "uninterrupted"


# --- a rank dies under torchrun --max-restarts ----------------------------------------------------------------


def test_a_killed_rank_restarts_under_torchrun_and_ends_with_the_uninterrupted_weights(
    torchrun: Torchrun, uninterrupted: Path, runs: Path
) -> None:
    out = runs / "killed-at-10"
    args = ("--every", "3", "--auto-resume", "--kill-rank", "1", "--kill-at-step", "10")
    result = run(torchrun, out, *args, extra=["--max-restarts=1"])
    assert f"auto_resume continues from {out / 'checkpoints'}" in result.stdout
    for rank in (0, 1):
        assert (report(out, rank)["attempt"], report(out, rank)["started_at_step"]) == (1, 9)
        assert report(out, rank)["global_step"] == STEPS
    assert max_abs_difference(weights(uninterrupted), weights(out)) <= 1e-6
    print("steps lost to the crash at step 10: 1 (checkpoint every 3 steps)")


def test_a_crash_after_an_epoch_boundary_checkpoint_resumes_at_the_epochs_start(
    preloaded: Preloaded, uninterrupted: Path, runs: Path
) -> None:
    out = runs / "killed-at-17"
    restarted = crash_and_restart(
        preloaded, out, "--every", "4", "--auto-resume", "--kill-rank", "0", "--kill-at-step", "17"
    )
    assert f"auto_resume continues from {out / 'checkpoints'}" in restarted.stdout
    for rank in (0, 1):
        assert (report(out, rank)["attempt"], report(out, rank)["started_at_step"]) == (1, 16)
        assert report(out, rank)["global_step"] == STEPS
    assert max_abs_difference(weights(uninterrupted), weights(out)) <= 1e-6


@needs_cpu_fp16
def test_native_fp16_restart_restores_the_loss_scaler(preloaded: Preloaded, runs: Path) -> None:
    baseline, out = runs / "fp16-uninterrupted", runs / "fp16-killed"
    run_forked(preloaded, baseline, "--precision", "native-fp16")
    crash_and_restart(
        preloaded,
        out,
        *("--precision", "native-fp16", "--every", "3", "--auto-resume", "--kill-rank", "1", "--kill-at-step", "13"),
    )
    assert (report(out)["attempt"], report(out)["started_at_step"]) == (1, 12)
    assert report(out)["precision_state"] == report(baseline)["precision_state"]
    assert max_abs_difference(weights(baseline), weights(out)) <= 1e-6


@needs_cpu_fp16
def test_apex_restart_restores_the_amp_state(preloaded: Preloaded, runs: Path) -> None:
    baseline, out = runs / "apex-uninterrupted", runs / "apex-killed"
    run_forked(preloaded, baseline, "--precision", "apex-O1")
    crash_and_restart(
        preloaded,
        out,
        *("--precision", "apex-O1", "--every", "3", "--auto-resume", "--kill-rank", "0", "--kill-at-step", "11"),
    )
    assert (report(out)["attempt"], report(out)["started_at_step"]) == (1, 9)
    assert report(out)["precision_state"] == report(baseline)["precision_state"]
    assert max_abs_difference(weights(baseline), weights(out)) <= 1e-6


def test_self_launched_ranks_restart_with_max_restarts_and_end_with_the_uninterrupted_weights(
    uninterrupted: Path, runs: Path
) -> None:
    # `python train.py` with devices=2 and EnvDDPStrategy(max_restarts=1): the same recovery as under torchrun.
    out = runs / "self-launched-killed"
    args = ("--every", "3", "--auto-resume", "--kill-rank", "1", "--kill-at-step", "7", "--devices", "2")
    check(run_plain(out, *args, "--max-restarts", "1"))
    assert (report(out, 1)["attempt"], report(out, 1)["started_at_step"]) == (1, 6)
    assert max_abs_difference(weights(uninterrupted), weights(out)) <= 1e-6


def test_self_launch_without_restarts_exits_with_the_failed_ranks_status(runs: Path) -> None:
    out = runs / "self-launched-dead"
    result = run_plain(out, "--kill-rank", "1", "--kill-at-step", "3", "--devices", "2")
    assert result.returncode == 128 + 9, result.stdout[-3000:]  # SIGKILL, as a shell reports it
    assert "exitcode  : -9 (pid:" in result.stdout
    # A crash, not a preemption: torchrun's whole failure summary, and no claim of a checkpoint.
    assert f"{SCRIPT} FAILED" in result.stdout
    assert "preempted" not in result.stdout


# --- preemption -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_to_the_launcher_saves_a_checkpoint_and_the_next_start_resumes(
    torchrun: Torchrun, preloaded: Preloaded, uninterrupted: Path, runs: Path, stop: signal.Signals
) -> None:
    # SIGTERM: a scheduler preempting torchrun. SIGINT: Ctrl-C in torchrun's terminal, which torchrun passes on to
    # the ranks (they run in sessions of their own, so the terminal's SIGINT reaches torchrun only).
    out = runs / f"stopped-by-{stop.name}"
    out.mkdir()
    # No periodic checkpoint before the signal: what the next start finds is the one the signal saved.
    launcher = torchrun.start(SCRIPT, "--out", str(out), "--every", "1000", "--auto-resume", "--step-delay", "0.1")
    wait_for_step(out, 5, launcher)
    launcher.send_signal(stop)
    first = finish(launcher, timeout=120)
    saved = sorted((out / "checkpoints").glob("preempted-step=*.ckpt"))
    assert len(saved) == 1, first.stdout[-4000:]
    assert f"envddp: {stop.name} received; saved {saved[0]}, the next start resumes from it" in first.stdout
    if stop == signal.SIGINT:
        assert first.stdout.count("envddp: Ctrl-C (SIGINT): the ranks save a checkpoint at the next step") == 1
    # The ranks exit 128 + the signal; torchrun itself dies of its SignalException, which Python reports as 1
    # (torch's choice).
    assert first.returncode == 1, first.stdout[-4000:]
    preempted_at = int(saved[0].stem.split("=")[1])
    assert preempted_at >= 5
    second = run_forked(preloaded, out, "--every", "1000", "--auto-resume")
    assert f"auto_resume continues from {saved[0]}" in second.stdout
    assert report(out)["started_at_step"] == preempted_at
    assert max_abs_difference(weights(uninterrupted), weights(out)) <= 1e-6


def test_sigterm_to_one_rank_during_validation_saves_at_an_accumulation_boundary(
    torchrun: Torchrun, preloaded: Preloaded, runs: Path
) -> None:
    config = ("--accumulate", "2", "--validate", "--every", "1000", "--auto-resume")
    baseline, out = runs / "accumulate-uninterrupted", runs / "accumulate-preempted"
    run_forked(preloaded, baseline, *config)
    out.mkdir()
    launcher = torchrun.start(SCRIPT, "--out", str(out), *config, "--step-delay", "0.3")
    wait_for(out / "progress" / "validating1", launcher)
    # Only rank 1 is told, and while it validates: rank 0 learns it at the next accumulation boundary.
    pid = int((out / "pids" / "rank1").read_text())
    subprocess.run(["kill", "-TERM", str(pid)], check=True)
    first = finish(launcher, timeout=120)
    assert first.returncode != 0
    # Preempted, not done: 143. (A rank still tearing down when the first one exits may be ended by torchrun.)
    assert "exitcode  : 143" in first.stdout, first.stdout[-4000:]
    # torchrun itself reports any failed rank as its ChildFailedError, which Python reports as 1 (torch's choice).
    assert first.returncode == 1
    assert f"{SCRIPT} FAILED" in first.stdout
    (saved,) = (out / "checkpoints").glob("preempted-step=*.ckpt")
    second = run_forked(preloaded, out, *config)
    assert f"auto_resume continues from {saved}" in second.stdout
    assert max_abs_difference(weights(baseline), weights(out)) <= 1e-6


def test_a_script_with_its_own_process_group_is_preempted_and_resumes_as_without_it(
    torchrun: Torchrun, preloaded: Preloaded, uninterrupted: Path, runs: Path
) -> None:
    # The classic script's dist.init_process_group kept before the Trainer: envddp adopts that group.
    config = ("--script-group", "--every", "1000", "--auto-resume", "--timeout", "30")
    out = runs / "script-group-preempted"
    out.mkdir()
    launcher = torchrun.start(SCRIPT, "--out", str(out), *config, "--step-delay", "0.1")
    wait_for_step(out, 5, launcher)
    os.kill(int((out / "pids" / "rank1").read_text()), signal.SIGTERM)  # one rank only, as a scheduler might
    first = finish(launcher, timeout=120)
    assert "started by torchrun, using the process group the script created" in first.stdout, first.stdout[-4000:]
    assert "exitcode  : 143" in first.stdout, first.stdout[-4000:]
    (saved,) = (out / "checkpoints").glob("preempted-step=*.ckpt")
    second = run_forked(preloaded, out, *config)
    assert f"auto_resume continues from {saved}" in second.stdout
    assert report(out)["started_at_step"] == int(saved.stem.split("=")[1])
    assert max_abs_difference(weights(uninterrupted), weights(out)) <= 1e-6
    # The script ends the group it started: envddp left it alone at exit.
    assert [(out / f"group-at-exit{rank}").read_text() for rank in (0, 1)] == ["True", "True"]


# One launcher per scenario: srun and mpirun differ only in the variables they export (test_launchers.py reads both),
# and each is here once, with its ranks' own exit statuses.
@pytest.mark.parametrize("launcher", ["srun"])
def test_under_srun_or_mpirun_every_rank_exits_143_after_a_sigterm_to_one(runs: Path, launcher: str) -> None:
    out = runs / f"preempted-{launcher}"
    rank0, rank1 = start_ranks_by_hand(
        out, "--every", "1000", "--auto-resume", "--step-delay", "0.1", "--timeout", "60", launcher=launcher
    )
    wait_for_step(out, 3, rank0)
    rank1.send_signal(signal.SIGTERM)
    statuses = [finish(rank, timeout=120) for rank in (rank0, rank1)]
    # No agent between the launcher and the ranks: the launcher (and its scheduler) sees each rank's own status.
    assert [rank.returncode for rank in statuses] == [143, 143], statuses[0].stdout[-4000:]
    assert f"started by {launcher}" in statuses[0].stdout
    assert len(list((out / "checkpoints").glob("preempted-step=*.ckpt"))) == 1


@pytest.mark.parametrize(
    ("signalled", "stop"),
    [("agent", signal.SIGTERM), ("one rank", signal.SIGTERM), ("agent", signal.SIGINT)],
    ids=["SIGTERM-agent", "SIGTERM-one-rank", "SIGINT-agent"],
)
def test_a_preempted_self_launch_exits_128_plus_the_signal_and_ends_with_one_line_naming_the_checkpoint(
    runs: Path, signalled: str, stop: signal.Signals
) -> None:
    # `python train.py` with devices=2: the process started becomes torchrun's agent. A scheduler signals it, or
    # only one rank; either way the ranks agree, save and exit 143. Ctrl-C in its terminal: the same, with 130.
    out = runs / f"self-launched-{stop.name}-{signalled.replace(' ', '-')}"
    out.mkdir()
    agent = start_python(
        SCRIPT, "--out", str(out), "--devices", "2", "--every", "1000", "--auto-resume", "--step-delay", "0.1"
    )
    wait_for_step(out, 3, agent)
    if signalled == "agent":
        agent.send_signal(stop)
    else:
        subprocess.run(["kill", f"-{stop.name[3:]}", (out / "pids" / "rank1").read_text()], check=True)
    result = finish(agent, timeout=120)
    assert result.returncode == 128 + stop, result.stdout[-4000:]
    (saved,) = (out / "checkpoints").glob("preempted-step=*.ckpt")
    lines = result.stdout.splitlines()
    how = "stopped by Ctrl-C (SIGINT)" if stop == signal.SIGINT else "preempted (SIGTERM)"
    said = f"envddp: the run was {how}; rank 0 saved {saved}; start the same command again to resume from it"
    # Once, at the end: only what the interpreter may print as it exits can follow.
    assert lines.count(said) == 1, result.stdout[-4000:]
    assert said in lines[-3:], result.stdout[-4000:]
    # torchrun's failure summary and tracebacks are for crashes.
    assert "FAILED" not in result.stdout
    assert "Traceback" not in result.stdout


def test_two_training_loaders_resume_mid_epoch_exactly(preloaded: Preloaded, runs: Path) -> None:
    # Lightning's default "max_size_cycle": the shorter loader cycles within the epoch.
    baseline, out = runs / "two-loaders-uninterrupted", runs / "two-loaders-killed"
    run_forked(preloaded, baseline, "--two-loaders")
    crash_and_restart(
        preloaded, out, *("--two-loaders", "--every", "3", "--auto-resume", "--kill-rank", "1", "--kill-at-step", "14")
    )
    assert (report(out)["attempt"], report(out)["started_at_step"]) == (1, 12)
    assert max_abs_difference(weights(baseline), weights(out)) <= 1e-6


# --- peers that are gone, hang or never come ------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["mpirun"])
def test_a_dead_peer_without_a_supervisor_stops_the_survivor_with_a_clear_error(runs: Path, launcher: str) -> None:
    rank0, rank1 = start_ranks_by_hand(
        runs / f"dead-peer-{launcher}", "--kill-rank", "1", "--kill-at-step", "5", "--timeout", "30", launcher=launcher
    )
    killed = finish(rank1, timeout=120)
    died = time.monotonic()
    survivor = finish(rank0, timeout=120)
    detected_after = time.monotonic() - died
    print(f"survivor stopped {detected_after:.2f}s after its peer died")
    # What srun and mpirun see after a crash: each task's own status, the killed one's signal and its peer's error.
    assert killed.returncode == -signal.SIGKILL
    assert survivor.returncode != 0
    assert "A peer rank is gone or stopped responding" in survivor.stdout
    assert detected_after < 30, "the survivor waited longer than its timeout"


def test_without_auto_resume_sigterm_ends_the_rank_at_once_and_its_peer_stops(runs: Path) -> None:
    out = runs / "sigterm-plain"
    rank0, rank1 = start_ranks_by_hand(out, "--step-delay", "0.1", "--timeout", "30")
    wait_for_step(out, 3, rank0)
    rank1.send_signal(signal.SIGTERM)
    signalled = finish(rank1, timeout=60)
    survivor = finish(rank0, timeout=60)
    assert signalled.returncode == -signal.SIGTERM  # nothing kept it alive: no grace period to save in
    assert survivor.returncode != 0
    assert "A peer rank is gone or stopped responding" in survivor.stdout


def test_a_hanging_peer_is_given_up_on_after_the_timeout(runs: Path) -> None:
    rank0, rank1 = start_ranks_by_hand(runs / "hanging-peer", "--hang-at-step", "5", "--timeout", "5")
    try:
        wait_for(runs / "hanging-peer" / "hanging", rank0)
        hung = time.monotonic()
        survivor = finish(rank1, timeout=120)
        waited = time.monotonic() - hung
    finally:
        kill(rank0)
        rank0.communicate()
    print(f"the other rank gave up {waited:.1f}s after its peer hung (timeout 5s)")
    assert survivor.returncode != 0
    assert "A peer rank is gone or stopped responding" in survivor.stdout
    assert waited < 60, "the survivor waited far beyond its 5-second timeout"


def test_under_torchrun_a_late_rank_is_counted_as_missing(torchrun: Torchrun, runs: Path) -> None:
    out = runs / "late-rank"
    out.mkdir()
    result = finish(torchrun.start(SCRIPT, "--out", str(out), "--timeout", "3", "--start-delay", "60"), timeout=120)
    assert result.returncode != 0
    assert result.returncode == 1  # torchrun's status for any failed rank, a crash as a preemption (torch's choice)
    assert "PeerError: WORLD_SIZE=2: rank 0 waited 3s" in result.stdout
    assert "only 1 of 2 ranks joined" in result.stdout


def test_rank_zero_alone_stops_within_the_timeout_and_counts_who_joined(runs: Path) -> None:
    (rank0,) = start_ranks_by_hand(runs / "alone", "--timeout", "3", ranks=(0,))
    started = time.monotonic()
    result = finish(rank0, timeout=120)
    print(f"rank 0 alone gave up after {time.monotonic() - started:.1f}s (process start included)")
    assert result.returncode != 0
    assert "PeerError: WORLD_SIZE=2: rank 0 waited 3s at 127.0.0.1:" in result.stdout
    assert "only 1 of 2 ranks joined" in result.stdout


# --- checkpoints ----------------------------------------------------------------------------------------------


def test_a_writer_killed_during_a_save_leaves_the_previous_checkpoint_intact(runs: Path) -> None:
    out = runs / "killed-writer"
    out.mkdir()
    # One process (no launcher): the save at step 8 stalls while it is being written, and is killed there.
    writer = start_python(SCRIPT, "--out", str(out), "--every", "4", "--save-last", "--stall-save-at-step", "8")
    wait_for(out / "saving", writer)
    writer.send_signal(signal.SIGKILL)
    writer.communicate()
    last = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 4  # the save at step 8 never replaced it
    assert sorted(p.name for p in (out / "checkpoints").glob("*.ckpt")) == ["epoch=0-step=4.ckpt", "last.ckpt"]
