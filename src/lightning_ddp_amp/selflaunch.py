"""``python train.py`` with ``Trainer(strategy="envddp", devices=N)``: the script starts its own N ranks.

The ranks are started by torchrun itself (``torch.distributed.run.main``, the function behind the ``torchrun``
command), re-running the script with the same arguments, so the run is the one
``torchrun --standalone --nproc-per-node=N train.py ...`` would make: same environment, same elastic agent, same
``--max-restarts``. The process that was started with ``python`` becomes torchrun's agent: it supervises the ranks
and, when they finish, exits with their status, so code after the Trainer runs in the ranks only, as under
torchrun. This module imports nothing from Lightning.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from lightning_ddp_amp.environment import SELF_LAUNCH_VARIABLE
from lightning_ddp_amp.errors import StrategyConfigurationError


def script_command(main: ModuleType | None = None, argv: Sequence[str] | None = None) -> list[str]:
    """torchrun's trailing arguments that run this program again: the script (or ``-m module``) and its arguments.

    Args:
        main: The ``__main__`` module; ``sys.modules["__main__"]`` when None.
        argv: The command line; ``sys.argv`` when None.

    Raises:
        StrategyConfigurationError: Python is not running a script (an interactive session, a notebook,
            ``python -c``), so there is nothing to re-run.
    """
    main = sys.modules["__main__"] if main is None else main
    argv = sys.argv if argv is None else argv
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # python -m package.module
        return ["-m", spec.name.removesuffix(".__main__"), *argv[1:]]
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        raise StrategyConfigurationError(
            "devices",
            "N > 1",
            "envddp starts the ranks by running this script again, but Python is not running a script file"
            " (interactive session, notebook or `python -c`)",
            "put the training in a script and run `python train.py`, or `torchrun --nproc-per-node=N train.py`",
        )
    return [os.path.abspath(path), *argv[1:]]


def torchrun_arguments(nproc: int, max_restarts: int, command: Sequence[str]) -> list[str]:
    """The torchrun command line of a self-launch, without the ``torchrun`` itself."""
    return ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", *command]


def launch(nproc: int, max_restarts: int) -> NoReturn:
    """Run this script on ``nproc`` ranks through torchrun, then exit with their status.

    Exits 0 when every rank finished, else with the exit status of the first rank that failed (128 + the signal
    number for a rank killed by a signal, as a shell reports it), after torchrun's summary of the failure.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if SELF_LAUNCH_VARIABLE in os.environ:
        # A rank of a self-launch that lost torchrun's variables must not start ranks of its own.
        raise StrategyConfigurationError(
            "devices",
            nproc,
            f"this process was started by a self-launch ({SELF_LAUNCH_VARIABLE} is set) but has no launcher"
            " variables, so starting ranks again would never end",
            f"unset {SELF_LAUNCH_VARIABLE}, or launch with `torchrun --nproc-per-node={nproc} train.py`",
        )
    arguments = torchrun_arguments(nproc, max_restarts, script_command())
    os.environ[SELF_LAUNCH_VARIABLE] = "1"
    try:
        torchrun(arguments)
    except ChildFailedError as error:
        _, failure = error.get_first_failure()
        print(str(error), file=sys.stderr)
        status = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        raise SystemExit(status or 1) from None
    raise SystemExit(0)
