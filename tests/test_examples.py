"""The examples in examples/ run as the README says: `make demo`'s command and the two-node script under torchrun,
the others on ranks forked from the preloaded interpreter (conftest.Preloaded), which is not what they are about."""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import Preloaded, Torchrun, check, free_port, needs_cpu_fp16, worker_env

EXAMPLES = Path(__file__).parents[1] / "examples"

pytestmark = pytest.mark.multiprocess


def test_demo_trains_on_two_ranks_under_torchrun(torchrun: Torchrun) -> None:
    # `make demo`'s command, the one run of the demo (the README's blocks run the quickstart, under torchrun and as
    # one process; the wheel's tests import the installed package). Torchrun.start resolves scripts against tests/workers; an absolute path is taken as is.
    result = check(torchrun.run(str(EXAMPLES / "train_mlp.py")))
    assert "rank 0/2 (launched by torchrun" in result.stdout
    assert "rank 1/2 (launched by torchrun" in result.stdout
    assert "final loss" in result.stdout
    said = [line for line in result.stdout.splitlines() if line.startswith("envddp:")]
    assert said == ["envddp: 2 ranks on 1 node(s), backend gloo, started by torchrun"]


CLI = EXAMPLES / "cli"


@needs_cpu_fp16
def test_cli_config_with_amp_o1_trains_on_two_ranks(preloaded: Preloaded, tmp_path: Path) -> None:
    # lightning_ddp_amp.trainer.cli.LightningCLI: `trainer.precision: amp-O1` (native here: the ranks do not import the apex
    # double, which the fork server only puts on their path, unless their code asks for it).
    args = ("fit", "--config", str(CLI / "amp_o1.yaml"), "--trainer.default_root_dir", str(tmp_path))
    result = preloaded.run(str(CLI / "train.py"), *args, log=tmp_path / "logs", apex_double=False).check()
    assert "`Trainer.fit` stopped: `max_epochs=2` reached." in result.stdout
    assert "AmpPrecision: NVIDIA apex amp is not importable, so opt_level O1 runs on torch.amp" in result.stdout


@needs_cpu_fp16
def test_lightnings_own_cli_takes_the_plugin_in_trainer_plugins(preloaded: Preloaded, tmp_path: Path) -> None:
    args = ["fit", "--config", str(CLI / "plugins.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    script = str(CLI / "train_lightning_cli.py")
    result = preloaded.run(script, *args, log=tmp_path / "logs", nproc=1, env=[{}], apex_double=False).check()
    assert "AmpPrecision: NVIDIA apex amp is not importable, so opt_level O1 runs on torch.amp" in result.stdout


@needs_cpu_fp16
def test_cli_config_with_apex_o1_runs_with_the_apex_double(preloaded: Preloaded, tmp_path: Path) -> None:
    # The apex config as written needs a GPU; the CPU test double of apex stands in, on the CPU.
    args = ["fit", "--config", str(CLI / "apex_o1.yaml"), "--trainer.accelerator", "cpu"]
    args += ["--trainer.default_root_dir", str(tmp_path)]
    result = preloaded.run(str(CLI / "train.py"), *args, log=tmp_path / "logs", nproc=1, env=[{}]).check()
    assert "`Trainer.fit` stopped: `max_epochs=2` reached." in result.stdout
    assert "not importable" not in result.stdout  # apex (the double) ran, not the native fallback


@needs_cpu_fp16
def test_two_models_one_optimizer_trains_on_two_ranks_with_amp_o1(preloaded: Preloaded, tmp_path: Path) -> None:
    script, args = str(EXAMPLES / "two_models_one_optimizer.py"), ("--epochs", "1", "--checkpoints", str(tmp_path))
    result = preloaded.run(script, *args, log=tmp_path / "logs", apex_double=False).check()
    assert "trained under native amp O1 on 2 rank(s); final loss" in result.stdout


@needs_cpu_fp16
def test_the_migrated_script_ends_in_the_classic_scripts_weights(
    torchrun: Torchrun, preloaded: Preloaded, tmp_path: Path
) -> None:
    # The README's before and after under the same command, on 2 ranks (the CPU test double of apex stands in for
    # apex, and runs on the CPU): the classic script's DDP, DistributedSampler and amp.scale_loss by hand against
    # envddp and the migrated script's default precision="amp-O1", which is apex O1 where apex runs.
    classic, migrated = tmp_path / "classic.pt", tmp_path / "migrated"
    # The classic script stays on torchrun: forked, its DDP models' teardown when main() returns can deadlock in
    # ProcessGroupGloo's destructor (its runloop thread waits for the GIL the destructor holds; seen 2 runs in 6).
    check(torchrun.run(str(EXAMPLES / "classic" / "train.py"), "--checkpoint", str(classic), apex_double=True))
    script = str(EXAMPLES / "two_models_one_optimizer.py")
    result = preloaded.run(script, "--checkpoints", str(migrated), log=tmp_path / "logs").check()
    assert "trained under apex amp O1 on 2 rank(s); final loss" in result.stdout
    before = torch.load(classic, weights_only=False)
    (checkpoint,) = migrated.glob("*.ckpt")
    after = torch.load(checkpoint, weights_only=False)
    weights = {f"{model}.{name}": value for model in ("model_a", "model_b") for name, value in before[model].items()}
    assert weights.keys() == after["state_dict"].keys()
    differences = {name: (after["state_dict"][name] - value).abs().max().item() for name, value in weights.items()}
    assert max(differences.values()) == 0.0, differences
    # Trained, not merely equal at the start: the first layer moved from its initial weights (the scripts' seed, data
    # drawn, then Encoder's first Linear).
    torch.manual_seed(0)
    torch.randn(1024, 32)
    initial = torch.nn.Linear(32, 128).weight
    assert (initial - weights["model_a.layers.0.weight"]).abs().max() > 1e-3


def documented_cpu_command(script: Path) -> list[str]:
    """The command ``script``'s docstring shows for a CPU machine: its line commented ``# on the CPU``."""
    docstring = ast.get_docstring(ast.parse(script.read_text())) or ""
    (line,) = [line for line in docstring.splitlines() if "# on the CPU" in line]
    return shlex.split(line, comments=True)


@needs_cpu_fp16
def test_the_fabric_example_runs_on_the_cpu_as_its_documented_command_says(tmp_path: Path) -> None:
    # The command as docs/fabric.md shows it, word for word from a folder that holds examples/ (as the repository's
    # root does) on a machine without apex: amp-O1, the default, trains on torch's AMP, and the checkpoint goes under
    # runs/, which the repository ignores.
    command = documented_cpu_command(EXAMPLES / "fabric" / "train.py")
    assert command == ["torchrun", "--nproc-per-node=2", "examples/fabric/train.py"]
    (tmp_path / "examples").symlink_to(EXAMPLES)
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--master-port={free_port()}"]
    result = subprocess.run(
        [*torchrun, *command[1:]], cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    said = result.stdout + result.stderr
    assert "AmpPrecision: NVIDIA apex amp is not importable, so opt_level O1 runs on torch.amp" in said
    assert "envddp: 2 ranks on 1 node(s), backend gloo, started by torchrun" in said
    assert [line.split(":")[0] for line in result.stdout.splitlines() if line.startswith("epoch ")] == [
        "epoch 0",
        "epoch 1",
    ]
    saved = torch.load(tmp_path / "runs" / "fabric" / "checkpoint.pt", weights_only=False)
    assert saved["epoch"] == 2  # the epochs done, as the classic script counts them
    assert saved["amp"]["backend"] == "native"


def test_multinode_example_runs_two_local_nodes() -> None:
    result = subprocess.run(
        ["bash", str(EXAMPLES / "multinode.sh"), "--local"],
        env=worker_env({"PYTHON": sys.executable}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(4):
        assert f"rank {rank}/4 (launched by torchrun" in result.stdout
