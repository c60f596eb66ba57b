"""``python -m lightning_ddp_amp env`` / ``compare``: the ``lightning-ddp-amp`` command (:mod:`lightning_ddp_amp.commands.main`)."""

import sys

from lightning_ddp_amp.commands.main import main

if __name__ == "__main__":
    sys.exit(main())
