"""Real ranks on gloo: equivalence with the hand-written recipe, sharding, rank-zero writes, two simulated nodes,
clean exits. Each launch is shared by the tests that read its results.

The one-node runs fork their ranks from an interpreter that already imported torch and Lightning (conftest.Preloaded),
with torchrun's variables; torchrun itself starts the two nodes, the self-launch and the ten-run exit loop, which
are about its agent."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    WORKERS,
    Preloaded,
    Torchrun,
    check,
    finish,
    free_port,
    max_abs_difference,
    start_python,
)

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5


def reports(out: Path) -> list[dict[str, Any]]:
    found = sorted(out.glob("rank*.json"))
    return [json.loads(path.read_text()) for path in found]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "weights.pt")


def launch(preloaded: Preloaded, tmp: Path, script: str, *args: str) -> Path:
    tmp.mkdir(parents=True)
    preloaded.run(script, "--out", str(tmp), *args, log=tmp / "logs").check()
    return tmp


@pytest.fixture(scope="module")
def recipe(preloaded: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plain-PyTorch recipe, 2 ranks, 4 samples per rank per step."""
    out = tmp_path_factory.mktemp("recipe") / "out"
    return preloaded.reference("train_recipe.py", "--batch-size", "4", out=out, saves="weights.pt").parent


@pytest.fixture(scope="module")
def envddp(preloaded: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same training with Trainer(strategy=EnvDDPStrategy()), checkpointing and logging on."""
    return launch(
        preloaded, tmp_path_factory.mktemp("envddp") / "out", "train_envddp.py", "--batch-size", "4", "--write"
    )


@pytest.fixture(scope="module")
def envddp_split(preloaded: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A global batch of 8 split over 2 ranks, and exact evaluation."""
    out = tmp_path_factory.mktemp("split") / "out"
    return launch(preloaded, out, "train_envddp.py", "--batch-size", "8", "--split-batches", "--exact-eval")


@pytest.fixture(scope="module")
def scenarios(preloaded: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Several Trainers, one after another, on the same 2 ranks (see workers/scenarios.py)."""
    return reports(launch(preloaded, tmp_path_factory.mktemp("scenarios") / "out", "scenarios.py"))


#: A reference worker's save: the temporary file first, then renamed into place (what makes it atomic).
WRITE_TEMPORARY = """
import os, sys
path = os.path.join(sys.argv[sys.argv.index("--out") + 1], "reference.pt")
with open(path + ".tmp", "w") as f:
    f.write("complete")
"""
RENAME = "os.replace(path + '.tmp', path)\n"
#: As torch's gloo teardown sometimes ends a process that has done its work.
ABORT = "os.abort()\n"


def test_a_reference_that_aborts_after_saving_is_judged_by_what_it_saved(preloaded: Preloaded, tmp_path: Path) -> None:
    script = tmp_path / "saves_then_aborts.py"
    script.write_text(WRITE_TEMPORARY + RENAME + ABORT)
    saved = preloaded.reference(str(script), out=tmp_path / "out", nproc=1, timeout=60)
    assert saved.read_text() == "complete"


def test_a_reference_that_aborts_before_its_save_is_complete_fails(preloaded: Preloaded, tmp_path: Path) -> None:
    script = tmp_path / "aborts_while_saving.py"
    script.write_text(WRITE_TEMPORARY + ABORT)
    with pytest.raises(pytest.fail.Exception, match=r"saved no reference\.pt"):
        preloaded.reference(str(script), out=tmp_path / "out", nproc=1, timeout=60)
    assert (tmp_path / "out" / "reference.pt.tmp").exists()


def test_envddp_ends_with_the_recipes_weights(recipe: Path, envddp: Path) -> None:
    assert max_abs_difference(weights(recipe), weights(envddp)) <= TOLERANCE


def test_pytorch_lightning_ends_with_the_recipes_weights(recipe: Path, preloaded: Preloaded, tmp_path: Path) -> None:
    # `import pytorch_lightning as pl`: the standalone package's Trainer, with the plugins built for it.
    pytest.importorskip("pytorch_lightning")
    out = launch(
        preloaded, tmp_path / "out", "train_envddp.py", "--batch-size", "4", "--namespace", "pytorch_lightning"
    )
    classes = {(r["trainer_class"], r["strategy_class"]) for r in reports(out)}
    assert classes == {("pytorch_lightning.trainer.trainer.Trainer", "lightning_ddp_amp.pytorch_lightning.trainer.strategy.EnvDDPStrategy")}  # fmt: skip
    assert max_abs_difference(weights(recipe), weights(out)) <= TOLERANCE


def test_split_batches_ends_with_the_recipes_weights(recipe: Path, envddp_split: Path) -> None:
    assert {size for r in reports(envddp_split) for size in r["train_batch_sizes"]} == {4}
    assert max_abs_difference(weights(recipe), weights(envddp_split)) <= TOLERANCE


def test_training_shards_are_disjoint_complete_and_reshuffled_every_epoch(envddp: Path) -> None:
    rank0, rank1 = reports(envddp)
    for epoch in ("0", "1"):
        seen0, seen1 = rank0["train_indices"][epoch], rank1["train_indices"][epoch]
        assert not set(seen0) & set(seen1)
        assert sorted(seen0 + seen1) == list(range(64))
    assert rank0["train_indices"]["0"] != rank0["train_indices"]["1"]


def test_only_rank_zero_writes_checkpoints_and_logs(envddp: Path) -> None:
    assert (envddp / "checkpoint_written_by_rank0").exists()
    assert (envddp / "log_written_by_rank0").exists()
    assert not list(envddp.glob("*_written_by_rank1"))
    assert len(list((envddp / "checkpoints").glob("*.ckpt"))) == 1


def test_default_evaluation_pads_shards_with_duplicates(envddp: Path) -> None:
    evaluated = [i for r in reports(envddp) for i in r["eval_indices"]]
    assert len(evaluated) == 38  # 37 samples, one evaluated twice: what exact_eval avoids


def test_exact_eval_evaluates_every_sample_exactly_once(envddp_split: Path) -> None:
    evaluated = [i for r in reports(envddp_split) for i in r["eval_indices"]]
    assert sorted(evaluated) == list(range(37))


def test_exact_eval_epoch_metric_equals_a_single_process_run(envddp_split: Path) -> None:
    from workers.common import val_set

    expected = val_set().tensors[1].mean().item()
    for report in reports(envddp_split):
        assert report["val_mean_y"] == pytest.approx(expected, abs=1e-6)


def test_predictions_cover_every_sample_exactly_once(envddp: Path) -> None:
    predicted = [i for r in reports(envddp) for i in r["predict_indices"]]
    assert sorted(predicted) == list(range(37))


def test_exact_eval_holds_for_validation_inside_fit_and_for_test(scenarios: list[dict[str, Any]]) -> None:
    from workers.common import dataset

    expected = dataset(37, seed=4).tensors[1].mean().item()
    for report in scenarios:
        assert report["reuse"]["val_mean_y"] == pytest.approx(expected, abs=1e-6)
        assert report["reuse"]["test_mean_y"] == pytest.approx(expected, abs=1e-6)


def test_one_strategy_serves_fit_test_and_a_second_fit(scenarios: list[dict[str, Any]]) -> None:
    for report in scenarios:
        assert report["reuse"]["epochs"] == [0, 1]
        assert report["reuse"]["spread"] == 0.0


def test_manual_optimization_keeps_ranks_in_sync(scenarios: list[dict[str, Any]]) -> None:
    for report in scenarios:
        assert report["manual"] == {"spread": 0.0, "samples": 20}


def test_fp16_gradient_compression_runs_on_gloo(scenarios: list[dict[str, Any]]) -> None:
    for report in scenarios:
        assert report["fp16_hook"] == {
            "spread": 0.0,
            "type": "DistributedDataParallel",
            "comm_hook": "fp16_compress_hook",
        }


def test_split_batches_applies_when_the_user_turns_sharding_off(scenarios: list[dict[str, Any]]) -> None:
    for report in scenarios:
        # Every rank reads the whole set (the user's choice), in per-rank batches of 8 / 2.
        assert report["no_sampler"] == {"batch_sizes": [4], "samples": 40}


def test_resume_continues_from_the_checkpoint(scenarios: list[dict[str, Any]]) -> None:
    for report in scenarios:
        assert report["resume"] == {"epochs": [1], "spread": 0.0}


def test_a_later_trainer_on_the_same_group_saves_and_stops_together_on_sigterm(
    scenarios: list[dict[str, Any]],
) -> None:
    # Its strategy finds the group an earlier Trainer started, and still sets up the group preemption agrees on.
    for report in scenarios:
        preempted = report["later_trainer_preempted"]
        assert preempted["exit"] == 143
        assert len(preempted["saved"]) == 1
        assert preempted["saved"][0].startswith("preempted-step=")


def test_two_nodes_of_two_ranks_match_the_four_rank_recipe(
    torchrun: Torchrun, preloaded: Preloaded, tmp_path: Path
) -> None:
    recipe4 = preloaded.reference(
        "train_recipe.py", "--batch-size", "4", out=tmp_path / "recipe4", saves="weights.pt", nproc=4
    ).parent
    out = tmp_path / "nodes"
    out.mkdir()
    port = free_port()
    nodes = [
        torchrun.start("train_envddp.py", "--out", str(out), "--batch-size", "4", nnodes=2, node_rank=n, port=port)
        for n in (0, 1)
    ]
    for node in nodes:
        check(finish(node, timeout=240))
    seen = {(r["rank"], r["local_rank"], r["node_rank"], r["world_size"], r["num_nodes"]) for r in reports(out)}
    assert seen == {(0, 0, 0, 4, 2), (1, 1, 0, 4, 2), (2, 0, 1, 4, 2), (3, 1, 1, 4, 2)}
    assert max_abs_difference(weights(recipe4), weights(out)) <= TOLERANCE


def free_slurm_job_id() -> str:
    """A SLURM_JOB_ID whose default port (15000 + its last four digits, Lightning's rule) is free here."""
    for job_id in range(4710000, 4720000):
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 15000 + job_id % 10000))
        except OSError:
            continue
        return str(job_id)
    raise AssertionError("no free port between 15000 and 24999")


def simulated_launcher(launcher: str, rank: int, job_id: str, port: int) -> dict[str, str]:
    """What `srun --nodes=2 --ntasks-per-node=1` or `mpirun -np 2 -x MASTER_PORT` (one node) exports to `rank`."""
    if launcher == "srun":
        # Two "nodes" of one task each, both 127.0.0.1, inside a bigger allocation (the job's variables differ).
        return {
            "SLURM_JOB_ID": job_id,
            "SLURM_JOB_NAME": "train",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": str(rank),
            "SLURM_NTASKS": "8",
            "SLURM_NTASKS_PER_NODE": "4",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.2",
            "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2",
        }
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": str(rank),
        "MASTER_PORT": str(port),
    }


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_srun_and_mpirun_ranks_end_with_the_recipes_weights(
    recipe: Path, launcher: str, preloaded: Preloaded, tmp_path: Path
) -> None:
    job_id, port = free_slurm_job_id(), free_port()
    variables = [simulated_launcher(launcher, rank, job_id, port) for rank in (0, 1)]
    preloaded.run("train_envddp.py", "--out", str(tmp_path), "--batch-size", "4", log=tmp_path, env=variables).check()
    seen = {(r["rank"], r["local_rank"], r["node_rank"], r["world_size"], r["launcher"]) for r in reports(tmp_path)}
    if launcher == "srun":
        assert seen == {(0, 0, 0, 2, "srun"), (1, 0, 1, 2, "srun")}
    else:
        assert seen == {(0, 0, 0, 2, "mpirun"), (1, 1, 0, 2, "mpirun")}
    assert max_abs_difference(weights(recipe), weights(tmp_path)) <= TOLERANCE


def test_plain_python_with_two_devices_starts_its_own_ranks_and_ends_with_the_recipes_weights(
    recipe: Path, tmp_path: Path
) -> None:
    # `python train.py` with Trainer(devices=2): torchrun's engine re-runs the script on 2 ranks.
    script = str(WORKERS / "train_envddp.py")
    result = check(finish(start_python(script, "--out", str(tmp_path), "--batch-size", "4", "--devices", "2"), 240))
    started = f"starting the ranks as `torchrun --standalone --nproc-per-node=2 --max-restarts=0 {script} --out"
    assert started in result.stdout
    assert result.stdout.count("starting the ranks as") == 1  # the ranks do not start ranks again
    # One line per fact: the agent says what it starts, rank 0 who started the ranks (nothing contradicts it).
    said = [line for line in result.stdout.splitlines() if line.startswith("envddp:")]
    assert said == [
        f"envddp: no launcher variables and 2 devices: {started.split(' --out')[0]} --out {tmp_path} --batch-size 4"
        " --devices 2`",
        "envddp: 2 ranks on 1 node(s), backend gloo, started by the script itself, through torchrun (self-launch)",
    ]
    seen = {(r["rank"], r["world_size"], r["launcher"]) for r in reports(tmp_path)}
    assert seen == {(0, 2, "self-launch"), (1, 2, "self-launch")}
    assert max_abs_difference(weights(recipe), weights(tmp_path)) <= TOLERANCE
    # The agent leaves the objects it imported to its exit, not to a last garbage collection (~1 s); the ranks,
    # whose script goes on after the fit, are left alone.
    exits = sorted(line for line in result.stdout.splitlines() if line.startswith("exit of "))
    assert exits == ["exit of 0: gc frozen False", "exit of 1: gc frozen False", "exit of agent: gc frozen True"], (
        result.stdout[-3000:]
    )


def test_plain_python_trains_as_one_process(preloaded: Preloaded, tmp_path: Path) -> None:
    command = ("train_envddp.py", "--out", str(tmp_path), "--batch-size", "4", "--epochs", "1")
    preloaded.run(*command, log=tmp_path, nproc=1, env=[{}]).check()  # no launcher's variables
    (report,) = reports(tmp_path)
    assert (report["world_size"], report["num_devices"]) == (1, 1)
    assert sorted(report["train_indices"]["0"]) == list(range(64))


def test_bad_launcher_variable_stops_the_process_without_waiting_for_peers(
    preloaded: Preloaded, tmp_path: Path
) -> None:
    # Nothing listens on this port: a process that tried to rendezvous before validating would hang here.
    env = {
        "RANK": "2",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    ranks = preloaded.run(
        "train_envddp.py", "--out", str(tmp_path), "--batch-size", "4", log=tmp_path, nproc=1, env=[env], timeout=60
    )
    assert ranks.returncodes == [1]
    assert "LauncherEnvironmentError: RANK='2': it must be below WORLD_SIZE=2" in ranks.logs[0]


def test_finished_runs_exit_zero_every_time(torchrun: Torchrun, tmp_path: Path) -> None:
    codes = []
    started = time.monotonic()
    for attempt in range(10):
        out = tmp_path / str(attempt)
        out.mkdir()
        result = torchrun.run("train_envddp.py", "--out", str(out), "--batch-size", "8", "--epochs", "1")
        codes.append(result.returncode)
        assert result.returncode == 0, f"run {attempt} exited {result.returncode}:\n{result.stdout[-4000:]}"
        assert "terminate called" not in result.stdout
    print(f"10 runs in {time.monotonic() - started:.0f}s, exit codes {codes}")
