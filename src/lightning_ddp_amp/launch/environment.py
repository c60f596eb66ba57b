"""Read and validate the topology a launcher left in the environment.

torchrun (any ``--nnodes``) and ``python -m torch.distributed.launch --use_env`` export RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT. Without ``--use_env`` the old launcher
passes the local rank as ``--local-rank=N`` (``--local_rank N`` before torch 2.0) on the command line instead.
``srun`` exports SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS, the tasks per node, SLURM_NODEID and the node
list; Open MPI's ``mpirun`` exports OMPI_COMM_WORLD_RANK, _LOCAL_RANK, _SIZE and _LOCAL_SIZE. When several
launchers' variables are present, the one closest to the process wins: torchrun's (torchrun started by ``srun`` on
every node), then mpirun's (``mpirun`` inside a SLURM job), then srun's. No launcher variables at all means a plain
``python train.py``: one process, world size 1.

Everything is checked here, before any network call, so a bad value stops the process at once with a message
that names the variable, its value and the fix. This module imports nothing from Lightning, so the package can
check the variables before Lightning's own import-time parsing of RANK and LOCAL_RANK fails with a bare
``int()`` error (see :func:`check_rank_variables`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_ddp_amp.errors import LauncherEnvironmentError

#: Variables whose presence means torchrun or torch.distributed.launch started this process; they win.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
#: Open MPI's variables, read when none of torchrun's are set.
MPIRUN_VARIABLES = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)
#: What Lightning and torch use when MASTER_PORT is not set: SLURM 15000 + the job id's last four digits.
SLURM_BASE_PORT = 15000
DEFAULT_MASTER_PORT = 29500

#: Process counts exported by launchers envddp does not read (MPICH / Intel MPI, MVAPICH, LSF's jsrun).
OTHER_LAUNCHER_SIZES = ("PMI_SIZE", "MV2_COMM_WORLD_SIZE", "JSM_NAMESPACE_SIZE")
#: Set by EnvDDPStrategy for the ranks it starts itself (:mod:`lightning_ddp_amp.launch.selflaunch`).
SELF_LAUNCH_VARIABLE = "LIGHTNING_DDP_AMP_SELF_LAUNCHED"

_LAUNCH_HINT = "launch with `torchrun --nproc-per-node=N train.py`, which sets every launcher variable for you"
_SRUN_HINT = "launch with `srun --ntasks-per-node=N python train.py`, which sets every SLURM variable for you"
_MPIRUN_HINT = "launch with `mpirun -np N -x MASTER_ADDR -x MASTER_PORT python train.py`"
#: srun's own variables: present in the tasks srun starts, absent from the batch script and from `salloc`'s shell.
SRUN_VARIABLES = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_FIRST_OF_RANGE = re.compile(r"\[([^\]\-,]+)[^\]]*\]")
_SLURM_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")
# The step's real layout first; SLURM_NTASKS_PER_NODE is what the job asked for, inherited from sbatch.
SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")


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
        launcher: What started the process: ``"torchrun"``, ``"self-launch"`` (torchrun, started by the strategy
            from a plain ``python train.py``), ``"torch.distributed.launch"``, ``"srun"``, ``"mpirun"``,
            ``"environment"`` (torchrun's variables set by hand or another tool), ``"none"``, or the class name of
            the Lightning ``ClusterEnvironment`` the topology was read from (``"KubeflowEnvironment"``).
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


def started_by(launcher: str) -> str:
    """Who started the processes, in words, for the one start-up line and the env report: ``"started by torchrun"``.

    Only asked under a launcher: without one, the strategy and the env report say what happens instead.
    """
    if launcher == "self-launch":
        return "started by the script itself, through torchrun (self-launch)"
    if launcher == "environment":
        return "started with launcher variables set by hand (RANK, WORLD_SIZE, MASTER_ADDR, ...)"
    return f"started by {launcher}"


def detect_launcher(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> str:
    """Which launcher's variables :func:`read_topology` reads, without validating them.

    Returns:
        ``"torch.distributed.launch"`` (``--local-rank`` on the command line), ``"torchrun"``, ``"self-launch"``
        (torchrun started by EnvDDPStrategy itself) or ``"environment"`` (RANK / LOCAL_RANK / WORLD_SIZE set by
        hand), ``"mpirun"``, ``"srun"``, or ``"none"``.

    Raises:
        LauncherEnvironmentError: ``--local-rank`` is the last argument, with no value.
    """
    env = os.environ if environ is None else environ
    if _local_rank_from_argv(sys.argv[1:] if argv is None else argv) is not None:
        return "torch.distributed.launch"
    if any(name in env for name in LAUNCHER_VARIABLES):
        if "TORCHELASTIC_RUN_ID" not in env:
            return "environment"
        return "self-launch" if SELF_LAUNCH_VARIABLE in env else "torchrun"
    if any(name in env for name in MPIRUN_VARIABLES):
        return "mpirun"
    if all(name in env for name in SRUN_VARIABLES):
        # Not SLURM_NTASKS alone: the batch script and `salloc`'s shell export it too, and a `python train.py`
        # run there is one process, not rank 0 of SLURM_NTASKS.
        return "srun"
    return "none"


def other_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """``"PMI_SIZE='4'"`` when a launcher envddp does not read started several processes, else None."""
    env = os.environ if environ is None else environ
    for name in OTHER_LAUNCHER_SIZES:
        if env.get(name, "1").strip() not in ("1", ""):
            return f"{name}={env[name]!r}"
    return None


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
    launcher = detect_launcher(env, args)
    if launcher == "none":
        return Topology()
    if launcher == "srun":
        return _read_srun(env)
    if launcher == "mpirun":
        return _read_mpirun(env)
    argv_local_rank = _local_rank_from_argv(args)

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
        if world_size > 1 and argv_local_rank is None and "LOCAL_RANK" not in env:
            raise _no_local_variables(rank, world_size)
        local_world_size = _single_node_local_world_size(env, world_size)
    _check_whole_nodes(
        world_size,
        ("WORLD_SIZE", "LOCAL_WORLD_SIZE"),
        local_world_size,
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
        launcher=launcher,
    )


def _read_srun(env: Mapping[str, str]) -> Topology:
    world_size = _required_int(env, "SLURM_STEP_NUM_TASKS", _SRUN_HINT, minimum=1)
    rank = _required_int(env, "SLURM_PROCID", _SRUN_HINT, minimum=0, below=(world_size, "SLURM_STEP_NUM_TASKS"))
    local_world_size, per_node_name = _slurm_tasks_per_node(env)
    _check_whole_nodes(
        world_size,
        ("SLURM_STEP_NUM_TASKS", per_node_name),
        local_world_size,
        "run the same number of tasks on every node (`srun --ntasks-per-node=N`)",
    )
    local_rank = _required_int(env, "SLURM_LOCALID", _SRUN_HINT, minimum=0, below=(local_world_size, per_node_name))
    num_nodes = world_size // local_world_size
    node_rank = _read_int(env, "SLURM_NODEID", minimum=0, below=(num_nodes, "the number of nodes"), hint=_SRUN_HINT)
    nodes = next((name for name in SLURM_NODELISTS if env.get(name, "").strip()), None)
    job_id = env.get("SLURM_JOB_ID", "").strip()
    master_addr, master_port = _master(
        env,
        required=world_size > 1,
        default_addr=_first_slurm_host(env[nodes]) if nodes else None,
        default_port=SLURM_BASE_PORT + int(job_id[-4:]) if job_id[-4:].isdigit() else None,
        hint=_SRUN_HINT,
    )
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=rank // local_world_size if node_rank is None else node_rank,
        master_addr=master_addr,
        master_port=master_port,
        launcher="srun",
    )


def _slurm_tasks_per_node(env: Mapping[str, str]) -> tuple[int, str]:
    """Tasks per node from the first of SLURM's variables that is set; every node must run as many."""
    for name in SLURM_TASKS_PER_NODE:
        raw = env.get(name)
        if raw is None:
            continue
        counts = _expand_slurm_counts(name, raw)
        if len(set(counts)) > 1:
            raise LauncherEnvironmentError(
                name,
                raw,
                "the nodes run different numbers of tasks, but DDP ranks are laid out as whole nodes",
                "run the same number of tasks on every node (`srun --ntasks-per-node=N`)",
            )
        return counts[0], name
    raise LauncherEnvironmentError(
        "SLURM_STEP_TASKS_PER_NODE",
        None,
        "neither it nor SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE is set",
        _SRUN_HINT,
    )


def _expand_slurm_counts(name: str, raw: str) -> list[int]:
    # SLURM writes per-node counts compressed: "2(x3),1" means 2, 2, 2, 1.
    counts: list[int] = []
    for part in raw.split(","):
        match = _SLURM_COUNT.fullmatch(part.strip())
        if match is None or int(match[1]) < 1:
            raise LauncherEnvironmentError(
                name, raw, "it is not SLURM's list of tasks per node (e.g. '4' or '4(x2)')", _SRUN_HINT
            )
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _first_slurm_host(nodes: str) -> str:
    """The host of rank 0: the first of SLURM's compressed node list.

    ``"gpu[07-09,12],cpu01"`` -> ``"gpu07"``; ``"rack[1-2]-node[01-04]"`` -> ``"rack1-node01"`` (zero padding kept).
    """
    depth, end = 0, len(nodes)
    for index, char in enumerate(nodes):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth == 0 and char in ", ":
            end = index
            break
    return _FIRST_OF_RANGE.sub(r"\1", nodes[:end].strip())


def _read_mpirun(env: Mapping[str, str]) -> Topology:
    world_size = _required_int(env, "OMPI_COMM_WORLD_SIZE", _MPIRUN_HINT, minimum=1)
    rank = _required_int(
        env, "OMPI_COMM_WORLD_RANK", _MPIRUN_HINT, minimum=0, below=(world_size, "OMPI_COMM_WORLD_SIZE")
    )
    local_world_size = _required_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", _MPIRUN_HINT, minimum=1)
    _check_whole_nodes(
        world_size,
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        local_world_size,
        "run the same number of processes on every node (`mpirun --map-by ppr:N:node`)",
    )
    local_rank = _required_int(
        env,
        "OMPI_COMM_WORLD_LOCAL_RANK",
        _MPIRUN_HINT,
        minimum=0,
        below=(local_world_size, "OMPI_COMM_WORLD_LOCAL_SIZE"),
    )
    num_nodes = world_size // local_world_size
    # Not OMPI_COMM_WORLD_NODE_RANK: Open MPI defines it as the process's rank on its node across all jobs, not
    # the node's index. Ranks are laid out by node (`--map-by ppr:N:node`), so the node is rank // per-node count.
    # mpirun exports no rendezvous address: one node can meet on the loopback, several need MASTER_ADDR.
    master_addr, master_port = _master(
        env,
        required=world_size > 1,
        default_addr="127.0.0.1" if num_nodes == 1 else None,
        default_port=DEFAULT_MASTER_PORT,
        hint="pass it to every rank: `mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> ...`",
    )
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=rank // local_world_size,
        master_addr=master_addr,
        master_port=master_port,
        launcher="mpirun",
    )


def _check_whole_nodes(world_size: int, names: tuple[str, str], local_world_size: int, fix: str) -> None:
    if local_world_size > world_size or world_size % local_world_size:
        raise LauncherEnvironmentError(
            names[1],
            str(local_world_size),
            f"{names[0]}={world_size} is not a whole number of nodes of {local_world_size} processes",
            fix,
        )


def _no_local_variables(rank: int, world_size: int) -> LauncherEnvironmentError:
    # What a Kubeflow PyTorchJob exports (one process per pod), and what a hand-written launch script may forget.
    return LauncherEnvironmentError(
        "LOCAL_RANK",
        None,
        f"neither LOCAL_RANK nor LOCAL_WORLD_SIZE is set (nor --local-rank passed), although RANK={rank} and"
        f" WORLD_SIZE={world_size} are, so envddp cannot tell how many of the {world_size} processes run on this"
        " node",
        "with one process per node or pod (a Kubeflow PyTorchJob), pass"
        ' `Trainer(strategy="envddp", plugins=[KubeflowEnvironment()])` (from lightning.pytorch.plugins.environments;'
        " or EnvDDPStrategy(cluster_environment=KubeflowEnvironment())); with several, " + _LAUNCH_HINT,
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


def _read_int(
    env: Mapping[str, str],
    name: str,
    *,
    minimum: int,
    below: tuple[int, str] | None = None,
    hint: str = _LAUNCH_HINT,
) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    return _to_int(name, raw, minimum=minimum, below=below, hint=hint)


def _required_int(
    env: Mapping[str, str], name: str, hint: str, *, minimum: int, below: tuple[int, str] | None = None
) -> int:
    value = _read_int(env, name, minimum=minimum, below=below, hint=hint)
    if value is None:
        seen = [key for key in (*SRUN_VARIABLES, "SLURM_LOCALID", *MPIRUN_VARIABLES) if key in env]
        raise LauncherEnvironmentError(name, None, f"it is not set, although {', '.join(seen)} are", hint)
    return value


def _to_int(
    name: str, raw: str, *, minimum: int, below: tuple[int, str] | None = None, hint: str = _LAUNCH_HINT
) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise LauncherEnvironmentError(name, raw, "it is not an integer", hint) from None
    if value < minimum:
        raise LauncherEnvironmentError(name, raw, f"it must be at least {minimum}", hint)
    if below is not None and value >= below[0]:
        limit, limit_name = below
        raise LauncherEnvironmentError(
            name,
            raw,
            f"it must be below {limit_name}={limit} (valid values are 0..{limit - 1})",
            f"check how the launcher set {name} and {limit_name}, or {hint}",
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


def _master(
    env: Mapping[str, str],
    *,
    required: bool,
    default_addr: str | None = None,
    default_port: int | None = None,
    hint: str = _LAUNCH_HINT,
) -> tuple[str | None, int | None]:
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
    addr = addr.strip() if addr else default_addr
    port = default_port if port is None else port
    if required and addr is None:
        raise LauncherEnvironmentError(
            "MASTER_ADDR",
            None,
            "it is not set, but ranks need it to find each other",
            "export MASTER_ADDR=<host of rank 0>, or " + hint,
        )
    if required and port is None:
        raise LauncherEnvironmentError(
            "MASTER_PORT",
            None,
            "it is not set, but ranks need it to find each other",
            "export MASTER_PORT=<free port>, or " + hint,
        )
    return addr, port


def check_rank_variables(environ: Mapping[str, str] | None = None) -> None:
    """Check the variables Lightning itself parses with ``int()`` when it is imported.

    ``import lightning`` reads RANK, LOCAL_RANK and SLURM_PROCID to set up its rank-zero utilities, and a malformed value
    fails there with ``invalid literal for int()``. ``import lightning_ddp_amp`` calls this first, so the user
    sees which variable is wrong and what to do; the full check runs when the strategy is built.

    Raises:
        LauncherEnvironmentError: RANK or LOCAL_RANK is set but is not a non-negative integer.
    """
    env = os.environ if environ is None else environ
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        _read_int(env, name, minimum=0)
