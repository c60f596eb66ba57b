"""The env report as text for people: a header naming the rank, one fact per label, then the problems with their
fixes."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from typing import Any

#: The widest line of the text report, and the column its facts start in.
WIDTH = 100
LABEL = 13


def render(data: Mapping[str, Any]) -> str:
    """The report as text; every line within :data:`WIDTH` columns (only a single word longer than that, such as a
    path, is not broken).

    Args:
        data: What :func:`~lightning_ddp_amp.commands.env.command.report` returned.
    """
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
    lines += _apex(data["apex"])
    lines.append("")
    problems = data["problems"]
    if not problems:
        lines.append("No problems found.")
    for problem in problems:
        lines += _wrap(f"PROBLEM: {problem['problem']}", " " * 9) + _wrap(f"    fix: {problem['fix']}", " " * 9)
    return "\n".join(lines)


def _apex(apex: Mapping[str, Any]) -> list[str]:
    if not apex["installed"]:
        return _fact("apex", f"not installed: {apex['note']}")
    kind = "TEST DOUBLE" if apex.get("test_double") else "NVIDIA apex" if apex["nvidia"] else "not NVIDIA apex"
    lines = _fact("apex", f"{kind} {apex['version'] or ''} at {apex['location']}".replace("  ", " "))
    if apex["nvidia"]:
        lines.append(f"  apex.amp   {'present' if apex['amp'] else 'removed (apex > 25.05)'}")
        for name, state in apex["extensions"].items():
            lines += _wrap(f"  {name:<22} {state['state']}: {state['detail']}", " " * 27)
    if "note" in apex:
        lines += _wrap(f"  {apex['note']}", "    ")
    return lines


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
