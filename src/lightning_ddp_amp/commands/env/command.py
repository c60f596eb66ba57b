"""The ``env`` command: its arguments, the report's sections gathered into one JSON-ready dict, printed."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_ddp_amp.commands.env.apex import apex_section
from lightning_ddp_amp.commands.env.launcher import launcher_section
from lightning_ddp_amp.commands.env.machine import backends_section, devices_section, versions_section
from lightning_ddp_amp.commands.env.text import render


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
    launcher, topology = launcher_section(env, [] if argv is None else list(argv), problems)
    return {
        "launcher": launcher,
        "devices": devices_section(env, topology, problems),
        "versions": versions_section(problems),
        "backends": backends_section(problems),
        "apex": apex_section(problems),
        "problems": problems,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """The ``lightning-ddp-amp env`` command. Returns 0 when the report lists no problems, else 1."""
    parser = argparse.ArgumentParser(
        prog="lightning-ddp-amp",
        description="lightning-ddp-amp env: what this process would train with, and what stands in the way.",
    )
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
