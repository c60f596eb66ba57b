"""Read and validate the topology a launcher left in the environment.

torchrun (any ``--nnodes``) and ``python -m torch.distributed.launch --use_env`` export RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT. Without ``--use_env`` the old launcher
passes the local rank as ``--local-rank=N`` (``--local_rank N`` before torch 2.0) on the command line instead.
No launcher variables at all means a plain ``python train.py``: one process, world size 1.

Everything is checked here, before any network call, so a bad value stops the process at once with a message
that names the variable, its value and the fix. This module imports nothing from Lightning, so the package can
check the variables before Lightning's own import-time parsing of RANK and LOCAL_RANK fails with a bare
``int()`` error (see :func:`check_rank_variables`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_ddp_amp.errors import LauncherEnvironmentError

#: Variables whose presence means a launcher started this process.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")

_LAUNCH_HINT = "launch with `torchrun --nproc-per-node=N train.py`, which sets every launcher variable for you"


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job.

    Args:
        rank: Global rank, 0 ≤ rank < world_size.
        local_rank: Rank on this node, 0 ≤ local_rank < local_world_size.
        world_size: Number of processes in the job.
        local_world_size: Number of processes on each node.
        node_rank: Index of this node, 0 ≤ node_rank < num_nodes.
        master_addr: Address of rank 0's rendezvous store (None for a single process).
        master_port: Port of rank 0's rendezvous store (None for a single process).
        launcher: What started the process: ``"torchrun"``, ``"torch.distributed.launch"``,
            ``"environment"`` (variables set by hand or another tool) or ``"none"``.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "none"

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def is_distributed(self) -> bool:
        """Whether there are peers to talk to; a world of one needs no process group."""
        return self.world_size > 1


def read_topology(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> Topology:
    """Read and validate the launcher's topology.

    Args:
        environ: The environment to read; ``os.environ`` when None.
        argv: The command line to search for ``--local-rank``; ``sys.argv[1:]`` when None. It is only read,
            never changed, so the script's own argparse sees exactly what the launcher passed.

    Raises:
        LauncherEnvironmentError: A variable is missing, not an integer, or out of range.
    """
    env = os.environ if environ is None else environ
    args = sys.argv[1:] if argv is None else argv
    argv_local_rank = _local_rank_from_argv(args)
    if argv_local_rank is None and not any(name in env for name in LAUNCHER_VARIABLES):
        return Topology()

    world_size = _read_int(env, "WORLD_SIZE", minimum=1)
    if world_size is None:
        present = ", ".join(f"{n}={env[n]!r}" for n in LAUNCHER_VARIABLES if n in env) or "--local-rank"
        raise LauncherEnvironmentError(
            "WORLD_SIZE", None, f"it is not set although {present} is", _LAUNCH_HINT + ", or unset them all"
        )
    rank = _read_int(env, "RANK", minimum=0, below=(world_size, "WORLD_SIZE"))
    if rank is None:
        if world_size > 1:
            raise LauncherEnvironmentError(
                "RANK", None, f"it is not set although WORLD_SIZE={world_size}", _LAUNCH_HINT
            )
        rank = 0
    local_world_size = _read_int(env, "LOCAL_WORLD_SIZE", minimum=1)
    if local_world_size is None:
        local_world_size = _single_node_local_world_size(env, world_size)
    if local_world_size > world_size or world_size % local_world_size:
        raise LauncherEnvironmentError(
            "LOCAL_WORLD_SIZE",
            str(local_world_size),
            f"WORLD_SIZE={world_size} is not a whole number of nodes of {local_world_size} processes",
            "start the same number of processes on every node (`torchrun --nproc-per-node`)",
        )
    local_rank = _local_rank(env, argv_local_rank, local_world_size)
    node_rank = _node_rank(env, default=rank // local_world_size, num_nodes=world_size // local_world_size)
    master_addr, master_port = _master(env, required=world_size > 1)
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        launcher=_launcher_name(env, argv_local_rank),
    )


def _single_node_local_world_size(env: Mapping[str, str], world_size: int) -> int:
    # The pre-elastic launcher did not export LOCAL_WORLD_SIZE; without it only a one-node job is unambiguous.
    for name in ("GROUP_RANK", "NODE_RANK"):
        if env.get(name, "0").strip() not in ("0", ""):
            raise LauncherEnvironmentError(
                "LOCAL_WORLD_SIZE",
                None,
                f"it is not set, but {name}={env[name]!r} says the job spans several nodes",
                "export LOCAL_WORLD_SIZE=<processes per node>, or " + _LAUNCH_HINT,
            )
    return world_size


def _read_int(env: Mapping[str, str], name: str, *, minimum: int, below: tuple[int, str] | None = None) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    return _to_int(name, raw, minimum=minimum, below=below)


def _to_int(name: str, raw: str, *, minimum: int, below: tuple[int, str] | None = None) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise LauncherEnvironmentError(name, raw, "it is not an integer", _LAUNCH_HINT) from None
    if value < minimum:
        raise LauncherEnvironmentError(name, raw, f"it must be at least {minimum}", _LAUNCH_HINT)
    if below is not None and value >= below[0]:
        limit, limit_name = below
        raise LauncherEnvironmentError(
            name,
            raw,
            f"it must be below {limit_name}={limit} (valid values are 0..{limit - 1})",
            f"check how the launcher set {name} and {limit_name}, or {_LAUNCH_HINT}",
        )
    return value


def _local_rank_from_argv(argv: Sequence[str]) -> str | None:
    """The value of ``--local-rank=N`` / ``--local_rank N``, as the old launcher appends it, or None."""
    found = None
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag not in ("--local-rank", "--local_rank"):
            continue
        if not equals:
            if index + 1 >= len(argv):
                raise LauncherEnvironmentError(flag, None, "it has no value", _LAUNCH_HINT)
            value = argv[index + 1]
        found = value
    return found


def _local_rank(env: Mapping[str, str], argv_local_rank: str | None, local_world_size: int) -> int:
    below = (local_world_size, "LOCAL_WORLD_SIZE")
    local_rank = _read_int(env, "LOCAL_RANK", minimum=0, below=below)
    if argv_local_rank is not None:
        from_argv = _to_int("--local-rank", argv_local_rank, minimum=0, below=below)
        if local_rank is not None and local_rank != from_argv:
            raise LauncherEnvironmentError(
                "LOCAL_RANK",
                env["LOCAL_RANK"],
                f"the command line says --local-rank={argv_local_rank}",
                "let one launcher set the local rank: use torchrun, or torch.distributed.launch with --use-env",
            )
        local_rank = from_argv
    if local_rank is None:
        if local_world_size > 1:
            raise LauncherEnvironmentError(
                "LOCAL_RANK",
                None,
                "it is not set, nor passed as --local-rank, with several processes per node",
                _LAUNCH_HINT + " (or add --use-env to torch.distributed.launch)",
            )
        local_rank = 0
    return local_rank


def _node_rank(env: Mapping[str, str], *, default: int, num_nodes: int) -> int:
    # torchrun exports GROUP_RANK; NODE_RANK is Lightning's and SLURM-style scripts' name for the same thing.
    for name in ("GROUP_RANK", "NODE_RANK"):
        if name in env:
            value = _read_int(env, name, minimum=0, below=(num_nodes, "WORLD_SIZE/LOCAL_WORLD_SIZE"))
            assert value is not None
            return value
    return default


def _master(env: Mapping[str, str], *, required: bool) -> tuple[str | None, int | None]:
    addr = env.get("MASTER_ADDR")
    if addr is not None and not addr.strip():
        raise LauncherEnvironmentError(
            "MASTER_ADDR", addr, "it is empty", "set it to the host name or IP address of the node running rank 0"
        )
    raw_port = env.get("MASTER_PORT")
    port = None
    if raw_port is not None:
        try:
            port = int(raw_port.strip())
        except ValueError:
            port = None
        if port is None or not 1 <= port <= 65535:
            raise LauncherEnvironmentError(
                "MASTER_PORT",
                raw_port,
                "it is not a port number between 1 and 65535",
                "pick a free port, e.g. `torchrun --master-port=29500`",
            )
    if required and addr is None:
        raise LauncherEnvironmentError(
            "MASTER_ADDR",
            None,
            "it is not set, but ranks need it to find each other",
            "export MASTER_ADDR=<host of rank 0>, or " + _LAUNCH_HINT,
        )
    if required and port is None:
        raise LauncherEnvironmentError(
            "MASTER_PORT",
            None,
            "it is not set, but ranks need it to find each other",
            "export MASTER_PORT=<free port>, or " + _LAUNCH_HINT,
        )
    return (addr.strip() if addr else None), port


def _launcher_name(env: Mapping[str, str], argv_local_rank: str | None) -> str:
    if argv_local_rank is not None:
        return "torch.distributed.launch"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    return "environment"


def check_rank_variables(environ: Mapping[str, str] | None = None) -> None:
    """Check the variables Lightning itself parses with ``int()`` when it is imported.

    ``import lightning`` reads RANK and LOCAL_RANK to set up its rank-zero utilities, and a malformed value
    fails there with ``invalid literal for int()``. ``import lightning_ddp_amp`` calls this first, so the user
    sees which variable is wrong and what to do; the full check runs when the strategy is built.

    Raises:
        LauncherEnvironmentError: RANK or LOCAL_RANK is set but is not a non-negative integer.
    """
    env = os.environ if environ is None else environ
    for name in ("RANK", "LOCAL_RANK"):
        _read_int(env, name, minimum=0)
