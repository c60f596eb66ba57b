"""`the env report`: what this process would train with, and what stands in the way.

The report covers the launcher and topology this rank reads, its devices, the versions of torch, Lightning, CUDA,
cuDNN and NCCL, the process-group backends, and NVIDIA apex: whether it is installed at all, whether it is the
impostor from PyPI, whether ``apex.amp`` is still there, and whether its compiled extensions load with this torch.
Each problem comes with its fix in one line.

It starts no process group and writes nothing, so it is safe on any rank of a running job and on a machine without
a GPU. apex's compiled extensions are loaded in a child process: one built for another torch can crash the
interpreter that imports it (the segmentation fault users meet in ``scaled_loss.backward()``).
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import platform
import socket
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.amp import native_backend
from lightning_ddp_amp.amp.apex_loader import APEX_INSTALL, NATIVE_ALTERNATIVES, installation
from lightning_ddp_amp.errors import LightningDDPAmpError
from lightning_ddp_amp.launch import process_group
from lightning_ddp_amp.launch.devices import select_devices
from lightning_ddp_amp.launch.environment import (
    LAUNCHER_VARIABLES,
    MPIRUN_VARIABLES,
    SLURM_NODELISTS,
    SLURM_TASKS_PER_NODE,
    SRUN_VARIABLES,
    Topology,
    detect_launcher,
    other_launcher,
    read_topology,
    started_by,
)
from lightning_ddp_amp.versions import installed

#: The oldest torch release the package supports (pyproject.toml: torch>=2.1; CI runs 2.1.2, 2.13.0 and the newest).
OLDEST_TORCH = Version("2.1")

#: apex's compiled extensions: what each one is for, as the report says it.
APEX_EXTENSIONS = {
    "amp_C": "fused multi-tensor kernels of apex.amp and apex.optimizers",
    "apex_C": "flatten/unflatten of apex.parallel.DistributedDataParallel",
    "syncbn": "apex.parallel.SyncBatchNorm",
    "fused_layer_norm_cuda": "apex.normalization.FusedLayerNorm",
}
_APEX_TIMEOUT_S = 120

# The environment a launcher leaves, shown as is so that a report can be compared across ranks: every variable
# read_topology reads, and the other launchers' families, so that the report can say why they were ignored.
_SHOWN = (
    *LAUNCHER_VARIABLES,
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "CUDA_VISIBLE_DEVICES",
    *SRUN_VARIABLES,
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
    *SLURM_TASKS_PER_NODE,
    *SLURM_NODELISTS,
)
_SHOWN_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_", "MV2_COMM_WORLD_", "JSM_NAMESPACE_")
#: The widest line of the text report, and the column its facts start in.
WIDTH = 100
LABEL = 13


def report(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Everything the env report knows, as plain JSON-compatible data.

    Args:
        environ: The environment to read; ``os.environ`` when None.
        argv: The training command line to search for ``--local-rank``; none when None (the env report's own
            arguments are not a training script's).

    Returns:
        A dict with the sections ``launcher``, ``devices``, ``versions``, ``backends`` and ``apex``, and
        ``problems``: a list of ``{"problem": ..., "fix": ...}``, empty when nothing stands in the way.
    """
    env = os.environ if environ is None else environ
    problems: list[dict[str, str]] = []
    launcher, topology = _launcher(env, [] if argv is None else list(argv), problems)
    return {
        "launcher": launcher,
        "devices": _devices(env, topology, problems),
        "versions": _versions(problems),
        "backends": _backends(problems),
        "apex": _apex(problems),
        "problems": problems,
    }


def _launcher(
    env: Mapping[str, str], argv: list[str], problems: list[dict[str, str]]
) -> tuple[dict[str, Any], Topology | None]:
    variables = {
        name: value for name, value in sorted(env.items()) if name in _SHOWN or name.startswith(_SHOWN_PREFIXES)
    }
    section: dict[str, Any] = {"variables": variables}
    try:
        section["name"] = detect_launcher(env, argv)
        topology = read_topology(env, argv)
    except LightningDDPAmpError as error:
        problems.append({"problem": f"{error.field}={error.value!r}: {error.problem}", "fix": error.fix})
        section["error"] = str(error)
        return section, None
    section["decision"] = _decision(topology, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    ignored = _ignored_launchers(env, topology.launcher)
    if ignored:
        section["ignored"] = ignored
    foreign = other_launcher(env)
    if topology.launcher == "none" and foreign is not None:
        problems.append(
            {
                "problem": f"a launcher envddp does not read started this process ({foreign}: MPICH, Intel MPI,"
                " MVAPICH or jsrun), so every process would train alone",
                "fix": "launch with torchrun, srun or Open MPI's mpirun, or export RANK, LOCAL_RANK, WORLD_SIZE,"
                " LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process",
            }
        )
    problems.extend(_rendezvous_problems(env, topology))
    section["topology"] = {
        "rank": topology.rank,
        "local_rank": topology.local_rank,
        "world_size": topology.world_size,
        "local_world_size": topology.local_world_size,
        "node_rank": topology.node_rank,
        "num_nodes": topology.num_nodes,
        "master_addr": topology.master_addr,
        "master_port": topology.master_port,
    }
    return section, topology


def _rendezvous_problems(env: Mapping[str, str], topology: Topology) -> list[dict[str, str]]:
    """The classic multi-node mistakes: rank 0's address on loopback, or its port already taken on its node."""
    found = []
    address, port = topology.master_addr, topology.master_port
    if topology.num_nodes > 1 and address is not None and _is_loopback(address):
        found.append(
            {
                "problem": f"MASTER_ADDR={address!r} with {topology.num_nodes} nodes: a loopback address is every"
                " node's own, so the other nodes' ranks would look for rank 0 on themselves and the job can only hang",
                "fix": "set MASTER_ADDR to the hostname or IP address of rank 0's node, the same on every node"
                " (torchrun --master-addr=node0)",
            }
        )
    # Under torchrun the agent already holds the port for its store: only a rank 0 that opens it itself is checked.
    opens_the_store = topology.node_rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if port is not None and topology.world_size > 1 and opens_the_store and _port_taken(port):
        found.append(
            {
                "problem": f"MASTER_PORT={port}: another process on this node (rank 0's) already listens on it, so"
                " rank 0 cannot open the job's store there",
                "fix": f"pick a free port (MASTER_PORT, or torchrun --master-port), or stop the process holding {port}"
                f" (`ss -ltnp 'sport = :{port}'`)",
            }
        )
    return found


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address.lower() in ("localhost", "localhost.localdomain", "ip6-localhost")


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def _decision(topology: Topology, gpus: int) -> str:
    """Who started the ranks, or that envddp would start them, or a single process: what envddp does here."""
    ranks = f"{topology.world_size} rank(s) on {topology.num_nodes} node(s)"
    if topology.launcher == "none" and gpus > 1:
        return (
            f'self-launch: no launcher variables and {gpus} GPUs, so Trainer(strategy="envddp") starts {gpus} ranks'
            " itself through torchrun (devices=1 trains alone)"
        )
    if topology.launcher == "none":
        return (
            "single process: no launcher variables, so one process trains on the default device;"
            ' Trainer(strategy="envddp", devices=N) with N > 1 would start N ranks itself through torchrun'
        )
    return f"{ranks}, {started_by(topology.launcher)}"


def _ignored_launchers(env: Mapping[str, str], used: str) -> list[str]:
    """Other launchers' variables in this environment, and why they were not read."""
    found = []
    if used in ("torchrun", "environment", "torch.distributed.launch") and any(n in env for n in MPIRUN_VARIABLES):
        found.append("mpirun (OMPI_COMM_WORLD_*): torchrun's variables win")
    if used != "srun" and all(name in env for name in SRUN_VARIABLES):
        found.append(f"srun (SLURM_PROCID, SLURM_STEP_NUM_TASKS): {used}'s variables win")
    elif used != "srun" and "SLURM_NTASKS" in env:
        found.append(
            "SLURM's job variables (SLURM_NTASKS without srun's SLURM_STEP_NUM_TASKS): the batch script or salloc's"
            " shell, not a task srun started; start one task per rank with `srun`"
        )
    return found


def _devices(env: Mapping[str, str], topology: Topology | None, problems: list[dict[str, str]]) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    section: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cuda_available": cuda,
        "cuda_device_count": count,
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "cuda_devices": [
            {
                "index": index,
                "name": torch.cuda.get_device_name(index),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(index))),
            }
            for index in range(count)
        ],
        "bf16_supported": torch.cuda.is_bf16_supported() if cuda else None,
    }
    if topology is not None:
        try:
            device = select_devices("cuda" if cuda else "cpu", topology, count)[topology.local_rank]
        except LightningDDPAmpError as error:
            problems.append({"problem": f"{error.field}={error.value!r}: {error.problem}", "fix": error.fix})
        else:
            section["this_rank_device"] = str(device)
    return section


def _versions(problems: list[dict[str, str]]) -> dict[str, Any]:
    section: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "lightning_ddp_amp": installed("lightning_ddp_amp"),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
        "nccl": _nccl_version(),
        "lightning": installed("lightning"),
        "pytorch_lightning": installed("pytorch_lightning"),
    }
    # What this torch lacks, probed, and what the package does without it.
    section["torch_gaps"] = process_group.torch_gaps() + native_backend.torch_gaps()
    if Version(torch.__version__).release < OLDEST_TORCH.release:
        problems.append(
            {
                "problem": f"torch {torch.__version__} is older than the releases lightning-ddp-amp supports",
                "fix": f"pip install 'torch>={OLDEST_TORCH}'",
            }
        )
    low, high = _lightning.TESTED_LIGHTNING
    for name in ("lightning", "pytorch_lightning"):
        found = section[name]
        if found is not None and not low <= Version(found) < high:
            problems.append(
                {
                    "problem": f"{name} {found} is outside the releases lightning-ddp-amp is tested with",
                    "fix": f"pip install '{name.replace('_', '-')}>={low},<{high}'",
                }
            )
    return section


def _cudnn_version() -> int | None:
    if not torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
        return None
    version: int | None = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    return version


def _nccl_version() -> str | None:
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        return None
    return ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]


def _backends(problems: list[dict[str, str]]) -> dict[str, Any]:
    if not dist.is_available():
        problems.append(
            {
                "problem": "this torch build has no torch.distributed",
                "fix": "install a torch build with distributed support (every official Linux build has it)",
            }
        )
        return {"distributed": False}
    section: dict[str, Any] = {
        "distributed": True,
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
        "ucc": dist.is_ucc_available(),
        "default": "nccl" if torch.cuda.is_available() else "gloo",
    }
    if torch.cuda.is_available() and not section["nccl"]:
        problems.append(
            {
                "problem": "CUDA is available but this torch build has no NCCL",
                "fix": 'install a torch build with NCCL, or pass EnvDDPStrategy(process_group_backend="gloo")',
            }
        )
    return section


def _apex(problems: list[dict[str, str]]) -> dict[str, Any]:
    found = installation()
    if found is None:
        return {
            "installed": False,
            "note": 'precision="apex-O*" is unavailable; "amp-O*" runs the same O-levels on native torch AMP',
        }
    root = Path(found["location"])
    section: dict[str, Any] = {"installed": True, "location": found["location"], "version": found["version"]}
    if found["namespace"]:
        # A directory named apex without __init__.py, found on the path: typically the folder holding a clone of
        # NVIDIA/apex, when the command runs next to it.
        section["nvidia"] = False
        problems.append(
            {
                "problem": f"'apex' resolves to the directory {root}, which is not an installed package (a source"
                " checkout on the path?) and shadows any installed apex",
                "fix": "run from another directory, or install NVIDIA apex: " + APEX_INSTALL,
            }
        )
        return section
    if found["test_double"]:
        section["test_double"] = True
    if not any((root / sub).is_dir() for sub in ("amp", "parallel", "optimizers", "normalization")):
        section["nvidia"] = False
        problems.append(
            {
                "problem": f"the 'apex' installed at {root} is not NVIDIA apex (the apex on PyPI is a web toolkit)",
                "fix": "pip uninstall apex, then " + APEX_INSTALL,
            }
        )
        return section
    section["nvidia"] = True
    section["amp"] = (root / "amp").is_dir()
    if not section["amp"]:
        problems.append(
            {
                "problem": "this NVIDIA apex has no apex.amp: it was removed after release 25.05",
                "fix": APEX_INSTALL,
            }
        )
    section["extensions"] = extensions = {name: _load_extension(name) for name in APEX_EXTENSIONS}
    for name, state in extensions.items():
        if state["state"] in ("fails", "crashes"):
            problems.append(
                {
                    "problem": f"apex's {name} ({APEX_EXTENSIONS[name]}) {state['state']} on import with torch"
                    f" {torch.__version__}: {state['detail']}; apex was built for another torch or CUDA, the"
                    " usual cause of segmentation faults in scaled_loss.backward()",
                    "fix": "pip uninstall apex, then rebuild it against this torch: " + APEX_INSTALL,
                }
            )
    if section["amp"] and extensions["amp_C"]["state"] == "missing" and not section.get("test_double"):
        problems.append(
            {
                "problem": "apex was built without its CUDA extensions (amp_C is missing): apex.amp falls back to"
                " slow Python loops and apex's fused optimizers do not exist",
                "fix": APEX_INSTALL,
            }
        )
    if section["amp"] and not torch.cuda.is_available():
        section["note"] = "apex amp needs CUDA; on this machine " + NATIVE_ALTERNATIVES
    return section


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _load_extension(name: str) -> dict[str, str]:
    """Whether apex's compiled module ``name`` loads next to this torch, tried in a child process."""
    if importlib.util.find_spec(name) is None:
        return {"state": "missing", "detail": "not built"}
    # The child searches exactly this interpreter's path, so it loads what an import here would load.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, sys.path))}
    try:
        child = subprocess.run(
            [sys.executable, "-c", f"import torch, {name}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=_APEX_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"state": "fails", "detail": f"the import did not finish within {_APEX_TIMEOUT_S} s"}
    if child.returncode == 0:
        return {"state": "loads", "detail": "built for this torch"}
    if child.returncode < 0:
        return {"state": "crashes", "detail": f"the importing process died of signal {-child.returncode}"}
    last_line = (child.stderr.strip().splitlines() or ["no message"])[-1]
    return {"state": "fails", "detail": last_line}


def render(data: Mapping[str, Any]) -> str:
    """The report as text for people: a header naming the rank, one fact per label, then the problems with their
    fixes; every line within :data:`WIDTH` columns (only a single word longer than that, such as a path, is not
    broken)."""
    launcher = data["launcher"]
    lines = _wrap(f"lightning-ddp-amp {data['versions']['lightning_ddp_amp']} environment report{_whose(launcher)}")
    lines.append("")
    lines += _fact("launcher", launcher.get("name", "?"))
    if "decision" in launcher:
        lines += _fact("decision", launcher["decision"])
    topology = launcher.get("topology")
    if topology:
        lines += _fact(
            "topology",
            f"rank {topology['rank']} of {topology['world_size']}, local rank {topology['local_rank']}"
            f" of {topology['local_world_size']}, node {topology['node_rank']} of {topology['num_nodes']}"
            + (f", master {topology['master_addr']}:{topology['master_port']}" if topology["master_addr"] else ""),
        )
    for ignored in launcher.get("ignored", []):
        lines += _fact("ignored", ignored)
    for name, value in launcher["variables"].items():
        lines += _wrap(f"  {name}={value}", "    ")
    devices = data["devices"]
    lines += _fact("devices", f"{devices['cpu_count']} CPU(s), {devices['cuda_device_count']} CUDA device(s)")
    for device in devices["cuda_devices"]:
        lines += _wrap(f"  cuda:{device['index']} {device['name']} (compute capability {device['capability']})", "    ")
    if "this_rank_device" in devices:
        lines += _fact("this rank", f"trains on {devices['this_rank_device']}")
    versions = data["versions"]
    lines += _fact(
        "versions",
        ", ".join(
            f"{name} {versions[name] or '-'}"
            for name in ("python", "torch", "torch_cuda", "cudnn", "nccl", "lightning", "pytorch_lightning")
        ),
    )
    for gap in versions.get("torch_gaps", []):
        lines += _wrap(f"  without    {gap}", " " * LABEL)
    backends = data["backends"]
    if backends["distributed"]:
        available = [name for name in ("gloo", "nccl", "mpi", "ucc") if backends[name]]
        lines += _fact("backends", f"{', '.join(available) or 'none'}; envddp would use {backends['default']}")
    apex = data["apex"]
    if not apex["installed"]:
        lines += _fact("apex", f"not installed: {apex['note']}")
    else:
        kind = "TEST DOUBLE" if apex.get("test_double") else "NVIDIA apex" if apex["nvidia"] else "not NVIDIA apex"
        lines += _fact("apex", f"{kind} {apex['version'] or ''} at {apex['location']}".replace("  ", " "))
        if apex["nvidia"]:
            lines.append(f"  apex.amp   {'present' if apex['amp'] else 'removed (apex > 25.05)'}")
            for name, state in apex["extensions"].items():
                lines += _wrap(f"  {name:<22} {state['state']}: {state['detail']}", " " * 27)
        if "note" in apex:
            lines += _wrap(f"  {apex['note']}", "    ")
    lines.append("")
    problems = data["problems"]
    if not problems:
        lines.append("No problems found.")
    for problem in problems:
        lines += _wrap(f"PROBLEM: {problem['problem']}", " " * 9) + _wrap(f"    fix: {problem['fix']}", " " * 9)
    return "\n".join(lines)


def _whose(launcher: Mapping[str, Any]) -> str:
    """Which rank the report is of, for the header: reports from every rank of a job look alike otherwise."""
    topology = launcher.get("topology")
    if topology and launcher.get("name") != "none":
        return f" for rank {topology['rank']} of {topology['world_size']} (local rank {topology['local_rank']})"
    variables = launcher["variables"]
    given = [f"{name}={variables[name]}" for name in ("RANK", "LOCAL_RANK") if name in variables]
    return f" for {', '.join(given)}" if given else ""


def _fact(label: str, text: str) -> list[str]:
    """One labelled fact, its continuation lines under the text."""
    return _wrap(f"{label:<{LABEL - 1}} {text}", " " * LABEL)


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``lightning-ddp-amp`` command. Returns 0 when the report lists no problems, else 1."""
    parser = argparse.ArgumentParser(prog="lightning-ddp-amp", description=__doc__.split("\n")[0].replace("``", ""))
    # What `python -m torch.distributed.launch` without --use-env puts before the command, so the env report runs
    # under it too.
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser(
        "env",
        help="report the launcher, devices, versions and apex, with fixes",
        description="Report the launcher, topology, devices, versions, process-group backends and NVIDIA apex this"
        " process would train with, and each problem with its fix. Run it on every node (or rank) of the job: it"
        " starts no process group. Exits 1 when it finds a problem.",
    )
    env.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    data = report(argv=[] if args.local_rank is None else [f"--local-rank={args.local_rank}"])
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 1 if data["problems"] else 0
