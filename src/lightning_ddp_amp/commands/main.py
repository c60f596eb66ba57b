"""The ``lightning-ddp-amp`` command (also ``python -m lightning_ddp_amp``): ``env`` and ``compare``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lightning_ddp_amp.errors import nearest
from lightning_ddp_amp.versions import gathered

#: Every subcommand, with what it does.
COMMANDS = {
    "env": "report the launcher, devices, versions and apex, with fixes (lightning-ddp-amp env --help)",
    "compare": "train one command under several precisions and report how far apart they land\n"
    "            (lightning-ddp-amp compare --help)",
}
USAGE = "usage: lightning-ddp-amp {env,compare} ...   (or --version, --help)\n\n" + "\n".join(
    f"  {name:<8}  {what}" for name, what in COMMANDS.items()
)


def main(argv: Sequence[str] | None = None) -> int:
    """Hand the arguments after the subcommand to it; returns the exit status.

    No arguments, or a word that is no subcommand, prints every subcommand (the nearest one suggested) and returns 2,
    as a usage error does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argv[0] if argv else None
    if first in ("-h", "--help"):
        print(USAGE)
        return 0
    if first == "--version":
        print(version())
        return 0
    if first == "compare":
        from lightning_ddp_amp.commands.compare import command as compare

        return compare.main(argv[1:])
    if first == "env" or (first is not None and first.startswith("--local")):  # torch.distributed.launch's option
        from lightning_ddp_amp.commands.env import command as env_command

        return env_command.main(argv)
    if first is None:
        print(f"lightning-ddp-amp: name a command\n{USAGE}", file=sys.stderr)
        return 2
    near = nearest(first, COMMANDS)
    hint = f"; did you mean {near!r}?" if near else ""
    print(f"lightning-ddp-amp: {first!r} is not a command{hint}\n{USAGE}", file=sys.stderr)
    return 2


def version() -> str:
    """The package's version, with torch's and Lightning's."""
    found = gathered()
    package, lightning = found["lightning_ddp_amp"] or "not installed", found["lightning"] or "not installed"
    return f"lightning-ddp-amp {package} (torch {found['torch']}, lightning {lightning})"
