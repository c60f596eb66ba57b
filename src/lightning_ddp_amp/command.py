"""The ``lightning-ddp-amp`` command (also ``python -m lightning_ddp_amp``): ``env`` and ``compare``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: lightning-ddp-amp {env,compare} ...

  env       report the launcher, devices, versions and apex, with fixes (lightning-ddp-amp env --help)
  compare   train one command under several precisions and report how far apart they land
            (lightning-ddp-amp compare --help)"""


def main(argv: Sequence[str] | None = None) -> int:
    """Hand the arguments after the subcommand to it; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        from lightning_ddp_amp import compare

        return compare.main(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    from lightning_ddp_amp import doctor

    return doctor.main(argv)
