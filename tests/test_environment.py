"""read_topology: what each launcher leaves behind, and a clear error for every bad value."""

from __future__ import annotations

import subprocess
import sys

import lightning as L
import pytest
from conftest import worker_env

from lightning_ddp_amp import LauncherEnvironmentError, Topology, read_topology

TORCHRUN_RANK_1_OF_2 = {
    "RANK": "1",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}


def test_no_launcher_variables_is_a_single_process() -> None:
    assert read_topology({}, []) == Topology()
    assert not Topology().is_distributed


def test_torchrun_variables_are_read() -> None:
    topology = read_topology(TORCHRUN_RANK_1_OF_2, [])
    assert topology == Topology(
        rank=1,
        local_rank=1,
        world_size=2,
        local_world_size=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
        launcher="torchrun",
    )


def test_second_node_of_a_two_node_torchrun_job() -> None:
    env = {**TORCHRUN_RANK_1_OF_2, "RANK": "3", "WORLD_SIZE": "4", "GROUP_RANK": "1"}
    topology = read_topology(env, [])
    assert (topology.rank, topology.local_rank, topology.node_rank, topology.num_nodes) == (3, 1, 1, 2)


def test_node_rank_is_derived_when_the_launcher_does_not_export_it() -> None:
    env = {**TORCHRUN_RANK_1_OF_2, "RANK": "3", "WORLD_SIZE": "4"}
    del env["GROUP_RANK"]
    assert read_topology(env, []).node_rank == 1


def test_lightning_style_node_rank_is_accepted() -> None:
    env = {**TORCHRUN_RANK_1_OF_2, "RANK": "3", "WORLD_SIZE": "4", "NODE_RANK": "1"}
    del env["GROUP_RANK"]
    assert read_topology(env, []).node_rank == 1


# The pre-elastic `torch.distributed.launch` without --use_env: no LOCAL_RANK, no LOCAL_WORLD_SIZE in the
# environment; the local rank arrives on the command line.
OLD_LAUNCHER = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "argv",
    [["--local-rank=1"], ["--local_rank=1"], ["--local_rank", "1"], ["--lr", "0.1", "--local-rank", "1", "data/"]],
)
def test_old_launcher_passes_local_rank_on_the_command_line(argv: list[str]) -> None:
    before = list(argv)
    topology = read_topology(OLD_LAUNCHER, argv)
    assert (topology.local_rank, topology.local_world_size, topology.launcher) == (1, 2, "torch.distributed.launch")
    assert argv == before, "the user's argv must reach their own argparse untouched"


def test_old_launcher_with_use_env_is_read_from_the_environment() -> None:
    topology = read_topology({**OLD_LAUNCHER, "LOCAL_RANK": "1"}, [])
    assert (topology.rank, topology.local_rank, topology.world_size) == (1, 1, 2)


def test_world_size_one_needs_no_master_address() -> None:
    topology = read_topology({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, [])
    assert topology.world_size == 1 and not topology.is_distributed


BAD_ENVIRONMENTS = [
    # (id, overrides applied to a valid torchrun environment (None deletes), argv, variable, words in the message)
    ("rank-not-int", {"RANK": "one"}, [], "RANK", "not an integer"),
    ("rank-negative", {"RANK": "-1"}, [], "RANK", "at least 0"),
    ("rank-too-big", {"RANK": "2"}, [], "RANK", "below WORLD_SIZE=2"),
    ("local-rank-not-int", {"LOCAL_RANK": "1.0"}, [], "LOCAL_RANK", "not an integer"),
    ("local-rank-too-big", {"LOCAL_RANK": "2"}, [], "LOCAL_RANK", "below LOCAL_WORLD_SIZE=2"),
    ("local-rank-negative", {"LOCAL_RANK": "-3"}, [], "LOCAL_RANK", "at least 0"),
    ("world-size-missing", {"WORLD_SIZE": None}, [], "WORLD_SIZE", "not set"),
    ("world-size-zero", {"WORLD_SIZE": "0"}, [], "WORLD_SIZE", "at least 1"),
    ("world-size-not-int", {"WORLD_SIZE": "two"}, [], "WORLD_SIZE", "not an integer"),
    ("rank-missing", {"RANK": None}, [], "RANK", "not set"),
    ("uneven-nodes", {"WORLD_SIZE": "3"}, [], "LOCAL_WORLD_SIZE", "whole number of nodes"),
    ("local-world-size-zero", {"LOCAL_WORLD_SIZE": "0"}, [], "LOCAL_WORLD_SIZE", "at least 1"),
    ("group-rank-too-big", {"GROUP_RANK": "1"}, [], "GROUP_RANK", "below WORLD_SIZE/LOCAL_WORLD_SIZE=1"),
    (
        "several-nodes-without-local-world-size",
        {"LOCAL_WORLD_SIZE": None, "GROUP_RANK": None, "NODE_RANK": "1", "RANK": "3", "WORLD_SIZE": "4"},
        [],
        "LOCAL_WORLD_SIZE",
        "NODE_RANK='1' says the job spans several nodes",
    ),
    ("argv-without-value", {"LOCAL_RANK": None}, ["--epochs", "3", "--local-rank"], "--local-rank", "no value"),
    ("port-not-int", {"MASTER_PORT": "http"}, [], "MASTER_PORT", "between 1 and 65535"),
    ("port-zero", {"MASTER_PORT": "0"}, [], "MASTER_PORT", "between 1 and 65535"),
    ("port-too-big", {"MASTER_PORT": "70000"}, [], "MASTER_PORT", "between 1 and 65535"),
    ("port-missing", {"MASTER_PORT": None}, [], "MASTER_PORT", "not set"),
    ("addr-missing", {"MASTER_ADDR": None}, [], "MASTER_ADDR", "not set"),
    ("addr-empty", {"MASTER_ADDR": " "}, [], "MASTER_ADDR", "empty"),
    ("argv-disagrees", {}, ["--local-rank=0"], "LOCAL_RANK", "--local-rank=0"),
    ("argv-not-int", {"LOCAL_RANK": None}, ["--local_rank=x"], "--local-rank", "not an integer"),
    ("local-rank-missing", {"LOCAL_RANK": None}, [], "LOCAL_RANK", "not set"),
]


def _environment(overrides: dict[str, str | None]) -> dict[str, str]:
    env = dict(TORCHRUN_RANK_1_OF_2)
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


@pytest.mark.parametrize(
    ("overrides", "argv", "variable", "words"),
    [case[1:] for case in BAD_ENVIRONMENTS],
    ids=[case[0] for case in BAD_ENVIRONMENTS],
)
def test_bad_environment_names_the_variable_its_value_and_the_fix(
    overrides: dict[str, str | None], argv: list[str], variable: str, words: str
) -> None:
    env = _environment(overrides)
    with pytest.raises(LauncherEnvironmentError) as raised:
        read_topology(env, argv)
    error = raised.value
    assert error.field == variable
    message = str(error)
    assert message.startswith(f"{variable}=")
    assert words in message
    assert "Fix: " in message


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [({"RANK": "5"}, "RANK"), ({"MASTER_PORT": "99999"}, "MASTER_PORT"), ({"WORLD_SIZE": None}, "WORLD_SIZE")],
)
def test_trainer_construction_stops_on_a_bad_environment(
    monkeypatch: pytest.MonkeyPatch, overrides: dict[str, str | None], variable: str
) -> None:
    for name, value in _environment(overrides).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LauncherEnvironmentError, match=f"^{variable}="):
        L.Trainer(strategy="envddp", accelerator="cpu", logger=False)


def test_malformed_rank_is_explained_before_lightning_parses_it() -> None:
    # `import lightning` itself parses RANK with a bare int(); importing this package first gives our message.
    result = subprocess.run(
        [sys.executable, "-c", "import lightning_ddp_amp"],
        env=worker_env({"RANK": "zero", "WORLD_SIZE": "2"}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("lightning_ddp_amp.errors.LauncherEnvironmentError: RANK='zero': it is not an integer")
