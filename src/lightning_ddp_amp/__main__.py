"""``python -m lightning_ddp_amp env``: the environment doctor (:mod:`lightning_ddp_amp.doctor`)."""

import sys

from lightning_ddp_amp.doctor import main

if __name__ == "__main__":
    sys.exit(main())
