"""Starts ranks by forking an interpreter that has already imported torch, Lightning and this package.

For tests that need real ranks but not torchrun's agent (no restarts, exit statuses or signals): importing torch,
Lightning and torchmetrics costs about 6 s a process here, a launch under torchrun about 12 s, where the training of
a test run often takes 2 s. conftest.Preloaded drives this server.

The server computes nothing (no thread pool starts), so forking it is safe. It reads one JSON request a line on
standard input (it says ``{"ready": true}`` first, once its imports are done)::

    {"script": PATH, "args": [...], "nproc": 2, "port": 29500, "log": DIR, "env": [{...}, ...], "hide": [PATH]}

forks ``nproc`` ranks, each with torchrun's variables for one node (RANK, LOCAL_RANK, WORLD_SIZE, ...) or, where
the request has ``env``, with another launcher's variables from it, and its output in DIR/rank<RANK>.log, takes each path in ``hide`` off ``sys.path`` and PYTHONPATH, runs the script in each as ``__main__``, waits for them, and answers one JSON line
``{"returncodes": [...]}``. A rank ends as an interpreter ends (its atexit functions run), with the script's exit
status; as under torchrun, the first rank to fail ends the others.
"""

import atexit
import contextlib
import json
import os
import runpy
import signal
import sys
import traceback

import lightning  # noqa: F401 (preloaded for the ranks)
import lightning.fabric.utilities.rank_zero as fabric_rank_zero
import lightning.pytorch.utilities.rank_zero as lightning_rank_zero
import lightning_utilities.core.rank_zero as utilities_rank_zero
import torch  # noqa: F401
import torchmetrics  # noqa: F401

import lightning_ddp_amp  # noqa: F401


def run_rank(request: dict, rank: int) -> None:
    """In the forked child: become rank ``rank`` and run the script; never returns."""
    log = os.open(os.path.join(request["log"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(
        request["env"][rank]
        if "env" in request
        else {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(request["nproc"]),
            "LOCAL_WORLD_SIZE": str(request["nproc"]),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(request["port"]),
        }
    )
    # Lightning read RANK when the server imported it, before there was one: what it would have read here.
    for module in (lightning_rank_zero, fabric_rank_zero, utilities_rank_zero):
        module.rank_zero_only.rank = rank  # type: ignore[attr-defined]
    for hidden in request.get("hide", []):  # the apex double, for a run that must not find apex
        sys.path[:] = [entry for entry in sys.path if entry != hidden]
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        os.environ["PYTHONPATH"] = os.pathsep.join(entry for entry in paths if entry != hidden)
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)  # as the interpreter prints SystemExit("message")
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # reported as a crashed rank is
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    print(json.dumps({"ready": True}), flush=True)  # imported: a request's time is its run's alone
    for line in sys.stdin:
        request = json.loads(line)
        pids = []
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                run_rank(request, rank)
            pids.append(pid)
        print(json.dumps({"returncodes": wait_for(pids)}), flush=True)


def wait_for(pids: list[int]) -> list[int]:
    """Each rank's exit status; the first rank to fail ends the others (SIGKILL, -9), as torchrun's agent does."""
    returncodes: dict[int, int] = {}
    while len(returncodes) < len(pids):
        pid, status = os.wait()
        returncodes[pid] = os.waitstatus_to_exitcode(status)
        if returncodes[pid] != 0:
            for other in set(pids) - set(returncodes):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
    return [returncodes[pid] for pid in pids]


if __name__ == "__main__":
    main()
