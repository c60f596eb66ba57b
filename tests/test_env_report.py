"""`lightning-ddp-amp env`: the report, its problems and fixes, and that it is safe on any rank.

The fake apex layouts below are TEST DOUBLES of what users have installed (PyPI's unrelated `apex`, an NVIDIA apex
after 25.05, one built for another torch): real NVIDIA apex cannot be installed here.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import check, finish, free_port, start_python, worker_env

from lightning_ddp_amp import versions
from lightning_ddp_amp.commands.env import apex as env_apex
from lightning_ddp_amp.commands.env import command as env_report
from lightning_ddp_amp.commands.env import launcher as env_launcher
from lightning_ddp_amp.commands.env import machine as env_machine
from lightning_ddp_amp.commands.env import text as env_text

SRUN_RANK_1 = {
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "node01",
}
TORCHRUN_RANK_1 = {
    "RANK": "1",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "x",
}


def run_env(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_ddp_amp", "env", *args],
        env=worker_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plain_machine_reports_a_single_process_and_no_problems() -> None:
    result = run_env("--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["launcher"]["name"] == "none"
    assert data["launcher"]["decision"].startswith("single process")
    assert data["versions"]["torch"] == torch.__version__
    assert data["backends"]["gloo"] is True
    assert data["backends"]["default"] == ("nccl" if torch.cuda.is_available() else "gloo")
    assert data["devices"]["this_rank_device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    if importlib.util.find_spec("apex") is None:
        assert data["apex"]["installed"] is False
    assert data["problems"] == []


def test_text_report_for_people() -> None:
    result = run_env(env=SRUN_RANK_1)
    assert result.returncode == 0, result.stderr
    assert "launcher     srun" in result.stdout
    assert "rank 1 of 2, local rank 1 of 2, node 0 of 1, master node01:15077" in result.stdout
    assert "No problems found." in result.stdout


def test_the_text_report_names_the_rank_it_is_of_in_its_first_line() -> None:
    # Run on every rank of a job, the reports look alike: the header tells them apart.
    header = f"lightning-ddp-amp {env_report.report({})['versions']['lightning_ddp_amp']} environment report"
    assert (
        env_text.render(env_report.report(TORCHRUN_RANK_1)).splitlines()[0]
        == f"{header} for rank 1 of 2 (local rank 1)"
    )
    assert env_text.render(env_report.report(SRUN_RANK_1)).splitlines()[0] == f"{header} for rank 1 of 2 (local rank 1)"
    # Without a topology (WORLD_SIZE missing), the variables as they are set.
    assert env_text.render(env_report.report({"RANK": "1", "LOCAL_RANK": "0"})).splitlines()[0] == (
        f"{header} for RANK=1, LOCAL_RANK=0"
    )
    assert env_text.render(env_report.report({})).splitlines()[0] == header  # one process, no launcher: no rank to name


def test_every_line_of_the_text_report_fits_100_columns_with_long_facts_and_problems() -> None:
    env = {**TWO_NODES_BY_HAND, "MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port()), "PMI_RANK": "0"}
    for data in (env_report.report({}), env_report.report(env), env_report.report({"RANK": "1", "LOCAL_RANK": "0"})):
        lines = env_text.render(data).splitlines()
        assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    # Wrapped, not cut: a fact's continuation sits under its text, a problem's under its words.
    decision = env_text.render(env_report.report({})).splitlines()[3:5]
    assert decision[0].startswith("decision     single process:") and decision[1].startswith(" " * 13 + "Trainer")
    text = env_text.render(env_report.report(env))
    problem = next(p for p in env_report.report(env)["problems"] if p["problem"].startswith("MASTER_ADDR="))
    assert " ".join(text.split()).count(" ".join(f"PROBLEM: {problem['problem']}".split())) == 1
    assert " ".join(f"fix: {problem['fix']}".split()) in " ".join(text.split())


def test_report_says_which_launcher_won() -> None:
    data = env_report.report({**SRUN_RANK_1, **TORCHRUN_RANK_1})
    assert data["launcher"]["name"] == "torchrun"
    assert data["launcher"]["topology"]["master_port"] == 29500
    assert data["launcher"]["ignored"] == ["srun (SLURM_PROCID, SLURM_STEP_NUM_TASKS): torchrun's variables win"]
    assert data["launcher"]["variables"]["SLURM_PROCID"] == "1"


def test_report_says_when_the_ranks_were_self_launched() -> None:
    env = {**TORCHRUN_RANK_1, "LIGHTNING_DDP_AMP_SELF_LAUNCHED": "1"}
    assert env_report.report(env)["launcher"]["decision"] == (
        "2 rank(s) on 1 node(s), started by the script itself, through torchrun (self-launch)"
    )
    assert env_report.report(TORCHRUN_RANK_1)["launcher"]["decision"] == "2 rank(s) on 1 node(s), started by torchrun"


def test_decision_without_a_launcher_on_a_machine_with_several_gpus() -> None:
    from lightning_ddp_amp import Topology

    assert env_launcher.decision(Topology(), gpus=4).startswith("self-launch: no launcher variables and 4 GPUs")
    assert env_launcher.decision(Topology(), gpus=1).startswith("single process")


def test_slurm_job_variables_without_srun_are_explained() -> None:
    batch_script = {k: v for k, v in SRUN_RANK_1.items() if not k.startswith("SLURM_STEP_")}
    launcher = env_report.report(batch_script)["launcher"]
    assert launcher["name"] == "none"
    (ignored,) = launcher["ignored"]
    assert ignored.startswith("SLURM's job variables (SLURM_NTASKS without srun's SLURM_STEP_NUM_TASKS)")


def test_other_mpis_are_a_problem() -> None:
    (problem,) = env_report.report({"PMI_RANK": "1", "PMI_SIZE": "4"})["problems"]
    assert problem["problem"].startswith("a launcher envddp does not read started this process (PMI_SIZE='4'")


def test_cuda_without_nccl_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CUDA machine whose torch build lacks NCCL: both facts stand in for hardware and builds this CPU lacks.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(env_machine.dist, "is_nccl_available", lambda: False)
    problems: list[dict[str, str]] = []
    assert env_machine.backends_section(problems)["default"] == "nccl"
    assert problems == [
        {
            "problem": "CUDA is available but this torch build has no NCCL",
            "fix": 'install a torch build with NCCL, or pass EnvDDPStrategy(process_group_backend="gloo")',
        }
    ]


def test_bad_environment_is_a_problem_with_its_fix_and_exit_status_one() -> None:
    result = run_env("--json", env={**TORCHRUN_RANK_1, "RANK": "2"})
    assert result.returncode == 1
    (problem,) = json.loads(result.stdout)["problems"]
    assert problem["problem"] == "RANK='2': it must be below WORLD_SIZE=2 (valid values are 0..1)"
    assert "torchrun" in problem["fix"]


def test_unsupported_lightning_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: "2.4.0" if name == "lightning" else real(name))
    problems = env_report.report({})["problems"]
    assert {"problem": "lightning 2.4.0 is outside the releases lightning-ddp-amp is tested with",
            "fix": "pip install 'lightning>=2.5.0,<2.7.0'"} in problems  # fmt: skip


def test_env_and_compare_json_name_each_installed_version_with_one_key() -> None:
    from lightning_ddp_amp.commands.compare.report import _versions
    from lightning_ddp_amp.commands.main import version

    env = env_report.report({})["versions"]
    compared = _versions()
    shared = {"python", "torch", "lightning", "pytorch_lightning", "lightning_ddp_amp"}
    assert shared <= env.keys() and shared <= compared.keys()
    assert {name: env[name] for name in shared} == {name: compared[name] for name in shared}
    assert env["lightning_ddp_amp"] is not None
    assert version().startswith(f"lightning-ddp-amp {env['lightning_ddp_amp']} (torch {env['torch']},")


def fake_apex(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def apex_report(monkeypatch: pytest.MonkeyPatch, root: Path) -> tuple[dict[str, Any], list[dict[str, str]]]:
    monkeypatch.syspath_prepend(str(root))
    for name in [n for n in sys.modules if n.split(".")[0] in ("apex", *env_apex.APEX_EXTENSIONS)]:
        monkeypatch.delitem(sys.modules, name)
    data = env_report.report({})
    return data["apex"], data["problems"]


def test_pypi_apex_is_named_as_the_impostor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = fake_apex(tmp_path, {"apex/__init__.py": "", "apex/views.py": "", "apex/models.py": ""})
    apex, problems = apex_report(monkeypatch, root)
    assert apex["nvidia"] is False
    (problem,) = problems
    assert "is not NVIDIA apex (the apex on PyPI is a web toolkit)" in problem["problem"]
    assert problem["fix"].startswith("pip uninstall apex, then build NVIDIA apex 25.05 or older from source")


def test_a_directory_named_apex_on_the_path_is_not_taken_for_an_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Running next to a clone of NVIDIA/apex: the clone's folder is a namespace package called apex.
    root = fake_apex(tmp_path, {"apex/setup.py": "", "apex/apex/__init__.py": ""})
    apex, problems = apex_report(monkeypatch, root)
    assert apex["nvidia"] is False
    (problem,) = problems
    assert "which is not an installed package (a source checkout on the path?)" in problem["problem"]
    assert problem["fix"].startswith("run from another directory")


def test_apex_after_25_05_has_no_amp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = fake_apex(tmp_path, {"apex/__init__.py": "", "apex/parallel/__init__.py": "", "amp_C.py": ""})
    apex, problems = apex_report(monkeypatch, root)
    assert (apex["nvidia"], apex["amp"]) == (True, False)
    assert [p["problem"] for p in problems] == ["this NVIDIA apex has no apex.amp: it was removed after release 25.05"]


def test_extensions_built_for_another_torch_are_found_without_crashing_the_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = fake_apex(
        tmp_path,
        {
            "apex/__init__.py": "",
            "apex/amp/__init__.py": "",
            # What an extension compiled against another torch does on import: a missing C++ symbol...
            "amp_C.py": "raise ImportError('amp_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')",
            # ... or a crash of the importing process.
            "apex_C.py": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
            "syncbn.py": "",
        },
    )
    apex, problems = apex_report(monkeypatch, root)
    extensions = apex["extensions"]
    assert extensions["amp_C"] == {"state": "fails", "detail": "ImportError: amp_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"}  # fmt: skip
    assert extensions["apex_C"]["state"] == "crashes"
    assert extensions["syncbn"]["state"] == "loads"
    assert extensions["fused_layer_norm_cuda"]["state"] == "missing"
    broken = [p for p in problems if "built for another torch" in p["problem"]]
    assert [p["problem"].split(" (")[0] for p in broken] == ["apex's amp_C", "apex's apex_C"]
    assert all(p["fix"].startswith("pip uninstall apex, then rebuild it against this torch") for p in broken)


def test_apex_without_compiled_extensions_is_a_problem(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = fake_apex(tmp_path, {"apex/__init__.py": "", "apex/amp/__init__.py": ""})
    _, problems = apex_report(monkeypatch, root)
    assert any("built without its CUDA extensions (amp_C is missing)" in p["problem"] for p in problems)


def test_the_apex_test_double_is_named_as_one(apex_double: object) -> None:
    apex = env_report.report({})["apex"]
    assert (apex["test_double"], apex["amp"]) == (True, True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["torch.distributed.run", "torch.distributed.launch"])
def test_safe_on_every_rank_under_a_real_launcher(launcher: str, tmp_path: Path) -> None:
    # torch.distributed.launch without --use-env appends --local-rank=N, which `lightning-ddp-amp env` accepts too.
    command = ["-m", launcher, "--nproc-per-node=2", f"--master-port={free_port()}", f"--log-dir={tmp_path}"]
    check(finish(start_python(*command, "--redirects=3", "-m", "lightning_ddp_amp", "env", "--json"), timeout=120))
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("**/stdout.log"))]
    ranks = {(r["launcher"]["name"], r["launcher"]["topology"]["rank"]) for r in reports}
    expected = "torchrun" if launcher == "torch.distributed.run" else "torch.distributed.launch"
    assert ranks == {(expected, 0), (expected, 1)}


def test_console_script_runs_the_env_report() -> None:
    # `pip install lightning-ddp-amp` puts `lightning-ddp-amp` next to the interpreter.
    script = Path(sys.executable).with_name("lightning-ddp-amp")
    result = subprocess.run([str(script), "env"], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("lightning-ddp-amp 0.1.0 environment report")


# --- the classic multi-node mistakes ----------------------------------------------------------------------------

TWO_NODES_BY_HAND = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}


@pytest.mark.parametrize("loopback", ["localhost", "127.0.0.1", "127.0.1.1", "::1"])
def test_several_nodes_meeting_on_a_loopback_address_is_a_problem_with_its_fix(loopback: str) -> None:
    env = {**TWO_NODES_BY_HAND, "MASTER_ADDR": loopback, "MASTER_PORT": str(free_port())}
    (problem,) = [p for p in env_report.report(env)["problems"] if p["problem"].startswith("MASTER_ADDR=")]
    assert problem["problem"].startswith(f"MASTER_ADDR={loopback!r} with 2 nodes: a loopback address is every node's")
    assert problem["fix"].startswith("set MASTER_ADDR to the hostname or IP address of rank 0's node")


def test_one_node_on_localhost_and_several_nodes_on_a_hostname_are_fine() -> None:
    one_node = {
        **TWO_NODES_BY_HAND,
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(free_port()),
    }
    two_nodes = {**TWO_NODES_BY_HAND, "MASTER_PORT": str(free_port())}
    for env in (one_node, two_nodes):
        assert not [
            p for p in env_report.report(env)["problems"] if p["problem"].startswith(("MASTER_ADDR", "MASTER_PORT"))
        ]


def test_a_master_port_already_in_use_on_rank_zeros_node_is_a_problem_with_its_fix() -> None:
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**TWO_NODES_BY_HAND, "MASTER_PORT": str(port)}
        (problem,) = [p for p in env_report.report(env)["problems"] if p["problem"].startswith("MASTER_PORT=")]
        # Under torchrun its agent holds the port for the ranks: not a problem there.
        under_torchrun = {**env, "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_USE_AGENT_STORE": "True"}
        assert not [p for p in env_report.report(under_torchrun)["problems"] if p["problem"].startswith("MASTER_PORT=")]
    assert problem["problem"] == (
        f"MASTER_PORT={port}: another process on this node (rank 0's) already listens on it, so rank 0 cannot open"
        " the job's store there"
    )
    assert problem["fix"].startswith("pick a free port (MASTER_PORT, or torchrun --master-port)")


@pytest.mark.parametrize("args", [["--help"], ["env", "--help"]])
def test_help_reads_as_plain_text(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        env_report.main(args)
    text = capsys.readouterr().out
    assert "lightning-ddp-amp" in text
    assert "``" not in text and ":class:" not in text
