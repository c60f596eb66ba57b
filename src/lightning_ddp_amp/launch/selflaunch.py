"""``python train.py`` with ``Trainer(strategy="envddp", devices=N)``: the script starts its own N ranks.

The ranks are started by torchrun itself (``torch.distributed.run.main``, the function behind the ``torchrun``
command), re-running the script with the same arguments, so the run is the one
``torchrun --standalone --nproc-per-node=N train.py ...`` would make: same environment, same elastic agent, same
``--max-restarts``. The process that was started with ``python`` becomes torchrun's agent when ``fit`` begins
(:mod:`lightning_ddp_amp.ddp.launcher`): it supervises the ranks and, when they finish, exits with their status, so
code after ``fit`` runs in the ranks only, as under torchrun. Code before ``fit`` has run once more, in that
process: keep expensive set-up (downloads, CUDA work) in the LightningModule's hooks. This module imports nothing
from Lightning.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any, NoReturn

from lightning_ddp_amp.errors import StrategyConfigurationError, whole_number
from lightning_ddp_amp.launch.environment import SELF_LAUNCH_VARIABLE, other_launcher
from lightning_ddp_amp.launch.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, PREEMPTION_REPORT_VARIABLE


def script_command(main: ModuleType | None = None, argv: Sequence[str] | None = None) -> list[str]:
    """torchrun's trailing arguments that run this program again: the script (or ``-m module``) and its arguments.

    Args:
        main: The ``__main__`` module; ``sys.modules["__main__"]`` when None.
        argv: The command line; ``sys.argv`` when None.

    Raises:
        StrategyConfigurationError: Python is not running a script (an interactive session, a notebook,
            ``python -c``), or it is running pytest, whose whole session would run again on every rank.
    """
    main = sys.modules["__main__"] if main is None else main
    argv = sys.argv if argv is None else argv
    spec = getattr(main, "__spec__", None)
    module = spec.name.removesuffix(".__main__") if spec is not None and spec.name != "__main__" else None
    path = getattr(main, "__file__", None)
    if module in ("pytest", "_pytest") or (path and os.path.basename(argv[0] or "") in ("pytest", "py.test")):
        raise StrategyConfigurationError(
            "devices",
            "N > 1",
            "envddp starts the ranks by running the program again, and the program is pytest: every rank would"
            " run the whole test session",
            "in tests, start the ranks with torchrun (or set devices=1), and let the test launch the training script",
        )
    if module is not None:  # python -m package.module
        return ["-m", module, *argv[1:]]
    if path and os.path.isfile(path):
        return [os.path.abspath(path), *argv[1:]]
    if path and argv and os.path.isfile(argv[0]) and os.path.abspath(path).startswith(os.path.abspath(argv[0])):
        return [os.path.abspath(argv[0]), *argv[1:]]  # a zipapp: __main__.py inside the archive
    raise StrategyConfigurationError(
        "devices",
        "N > 1",
        "envddp starts the ranks by running this script again, but Python is not running a script file"
        " (interactive session, notebook or `python -c`)",
        "put the training in a script and run `python train.py`, or `torchrun --nproc-per-node=N train.py`",
    )


def check_max_restarts(max_restarts: object) -> int:
    """``EnvDDPStrategy(max_restarts=...)`` (the Trainer's and Fabric's): how often torchrun may restart a self-launch.

    Raises:
        StrategyConfigurationError: not a whole number, 0 or more.
    """
    return whole_number(
        StrategyConfigurationError,
        "max_restarts",
        max_restarts,
        "it must be a whole number of restarts, 0 or more",
        "pass e.g. 3",
        minimum=0,
    )


def plan(nproc: int, max_restarts: int) -> list[str]:
    """The torchrun arguments (without ``torchrun``) that start ``nproc`` ranks of this program.

    Raises:
        StrategyConfigurationError: This process must not start ranks: it is itself a rank of a self-launch, a
            launcher envddp does not read started it (each of its processes would start a job of its own), or
            there is no script to run again (see :func:`script_command`).
    """
    if SELF_LAUNCH_VARIABLE in os.environ:
        # A rank of a self-launch that lost torchrun's variables must not start ranks of its own.
        raise StrategyConfigurationError(
            "devices",
            nproc,
            f"this process was started by a self-launch ({SELF_LAUNCH_VARIABLE} is set) but has no launcher"
            " variables, so starting ranks again would never end",
            f"unset {SELF_LAUNCH_VARIABLE}, or launch with `torchrun --nproc-per-node={nproc} train.py`",
        )
    foreign = other_launcher()
    if foreign is not None:
        raise StrategyConfigurationError(
            "devices",
            nproc,
            f"a launcher envddp does not read started this process ({foreign}), so every one of its processes"
            f" would start {nproc} ranks of its own",
            "launch with torchrun, srun or Open MPI's mpirun, or export RANK, LOCAL_RANK, WORLD_SIZE,"
            " LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process",
        )
    return ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", *script_command()]


def launch(arguments: Sequence[str]) -> NoReturn:
    """Run torchrun with ``arguments`` (from :func:`plan`) in this process, then exit with the ranks' status.

    Exits 0 when every rank finished; 143 after a preemption (the ranks saved a checkpoint on SIGTERM), 130 after a
    Ctrl-C that they saved on, with one line naming the checkpoint instead of torchrun's failure summary; with the exit status of the first rank that
    failed (128 + the signal number for a rank killed by a signal, as a shell reports it), after torchrun's summary
    of the failure; with 128 + the signal number when this process is signalled (torchrun has then stopped the
    ranks, which save a checkpoint on the way out with ``auto_resume``: the same one line names it); with 1 when
    torchrun itself fails. It never returns, so no code after ``fit`` runs in this process.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ[SELF_LAUNCH_VARIABLE] = "1"
    # Where rank 0 writes the checkpoint it saved on preemption (Preemption.saved): only the ranks know its path.
    handle, report = tempfile.mkstemp(prefix="envddp-preemption-", suffix=".txt")
    os.close(handle)
    os.environ[PREEMPTION_REPORT_VARIABLE] = report
    try:
        torchrun(list(arguments))
    except ChildFailedError as error:
        saved = preempted_checkpoint(report, error.failures.values())
        if saved is not None:
            # The ranks exit 143 after a SIGTERM and 130 after a Ctrl-C (a peer torchrun stopped first dies of its
            # SIGTERM): a rank that exited 143 makes it a SIGTERM, as the ranks agree on.
            statuses = {failure.exitcode for failure in error.failures.values()}
            interrupted = INTERRUPTED_EXIT_CODE in statuses and PREEMPTED_EXIT_CODE not in statuses
            by = signal.SIGINT if interrupted else signal.SIGTERM
            _say_preempted(by.name, saved)
            raise SystemExit(128 + by) from None
        failure = _first_failure(error.failures.values())
        print(str(error), file=sys.stderr)
        status = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        raise SystemExit(status or 1) from None
    except SignalException as error:
        saved = preempted_checkpoint(report, [])
        if saved is not None:
            _say_preempted(signal.Signals(error.sigval).name, saved)
        raise SystemExit(128 + int(error.sigval)) from None
    except Exception:
        traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        with contextlib.suppress(OSError):  # the exit status matters more than a leftover temporary file
            os.remove(report)
        # The agent imported torch, Lightning and the script to build its Trainer. Python's last garbage collection
        # at exit walks all of those objects, about 1.3 s on 2 CPU cores (benchmarks/startup.py), after the ranks
        # have ended. Frozen, they are left to the exit itself: the script's own finally blocks and atexit
        # handlers still run, and the objects made from here on are still collected.
        gc.freeze()
    raise SystemExit(0)


def preempted_checkpoint(report: str, failures: Iterable[Any]) -> str | None:
    """The checkpoint the ranks saved when they were preempted, or None when they were not: a crash.

    Args:
        report: The file rank 0 writes the checkpoint's path to (:meth:`Preemption.saved
            <lightning_ddp_amp.launch.preemption.Preemption.saved>`), emptied when training starts.
        failures: torchrun's records of the ranks that failed. A preempted rank exits 143; a peer that torchrun
            stopped once the first rank had exited dies of its SIGTERM. Any other status is a crash, even after a
            save, and keeps torchrun's full report.
    """
    try:
        with open(report) as file:
            saved = file.read()
    except OSError:  # removed from under the agent (a cleaned /tmp): no checkpoint to name
        return None
    stopped = (PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE, -signal.SIGTERM, -signal.SIGINT)
    preempted = all(failure.exitcode in stopped for failure in failures)
    return saved if saved and preempted else None


def _say_preempted(signal_name: str, checkpoint: str) -> None:
    how = "stopped by Ctrl-C (SIGINT)" if signal_name == "SIGINT" else f"preempted ({signal_name})"
    print(
        f"envddp: the run was {how}; rank 0 saved {checkpoint}; start the same command again to resume from it",
        file=sys.stderr,
    )


def _first_failure(failures: Iterable[Any]) -> Any:
    """The rank failure that came first: the earliest, and within the same second a rank killed by a signal.

    torchrun's own choice (``ChildFailedError.get_first_failure``) compares timestamps in whole seconds, and a
    rank without an error file is stamped when torchrun notices it. A rank killed by a signal and the peers that
    then fail on its broken connections often share a second; the signal came first.
    """
    return min(failures, key=lambda failure: (failure.timestamp, failure.exitcode >= 0))
