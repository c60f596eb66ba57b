"""Which launcher started this process, and the topology it left in the environment, read and validated.

torchrun (any ``--nnodes``) and ``python -m torch.distributed.launch --use_env`` export RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT. Without ``--use_env`` the old launcher
passes the local rank as ``--local-rank=N`` (``--local_rank N`` before torch 2.0) on the command line instead.
``srun`` exports SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS, the tasks per node, SLURM_NODEID and the node
list; Open MPI's ``mpirun`` exports OMPI_COMM_WORLD_RANK, _LOCAL_RANK, _SIZE and _LOCAL_SIZE. When several
launchers' variables are present, the one closest to the process wins: torchrun's (torchrun started by ``srun`` on
every node), then mpirun's (``mpirun`` inside a SLURM job), then srun's. No launcher variables at all means a plain
``python train.py``: one process, world size 1. srun's and mpirun's variables are read by
:mod:`~lightning_ddp_amp.launch.slurm` and :mod:`~lightning_ddp_amp.launch.mpirun`, torchrun's here.

Everything is checked here, before any network call, so a bad value stops the process at once with a message
that names the variable, its value and the fix. This module imports nothing from Lightning, so the package can
check the variables before Lightning's own import-time parsing of RANK and LOCAL_RANK fails with a bare
``int()`` error (see :func:`check_rank_variables`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from lightning_ddp_amp.errors import LauncherEnvironmentError
from lightning_ddp_amp.launch.mpirun import MPIRUN_VARIABLES, read_mpirun
from lightning_ddp_amp.launch.slurm import SRUN_VARIABLES, read_srun
from lightning_ddp_amp.launch.topology import Topology
from lightning_ddp_amp.launch.variables import LAUNCH_HINT, check_whole_nodes, read_int, read_master, to_int

#: Variables whose presence means torchrun or torch.distributed.launch started this process; they win.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
#: Process counts exported by launchers envddp does not read (MPICH / Intel MPI, MVAPICH, LSF's jsrun).
OTHER_LAUNCHER_SIZES = ("PMI_SIZE", "MV2_COMM_WORLD_SIZE", "JSM_NAMESPACE_SIZE")
#: Set by EnvDDPStrategy for the ranks it starts itself (:mod:`lightning_ddp_amp.launch.selflaunch`).
SELF_LAUNCH_VARIABLE = "LIGHTNING_DDP_AMP_SELF_LAUNCHED"


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
        return read_srun(env)
    if launcher == "mpirun":
        return read_mpirun(env)
    argv_local_rank = _local_rank_from_argv(args)

    world_size = read_int(env, "WORLD_SIZE", minimum=1)
    if world_size is None:
        present = ", ".join(f"{n}={env[n]!r}" for n in LAUNCHER_VARIABLES if n in env) or "--local-rank"
        raise LauncherEnvironmentError(
            "WORLD_SIZE", None, f"it is not set although {present} is", LAUNCH_HINT + ", or unset them all"
        )
    rank = read_int(env, "RANK", minimum=0, below=(world_size, "WORLD_SIZE"))
    if rank is None:
        if world_size > 1:
            raise LauncherEnvironmentError("RANK", None, f"it is not set although WORLD_SIZE={world_size}", LAUNCH_HINT)
        rank = 0
    local_world_size = read_int(env, "LOCAL_WORLD_SIZE", minimum=1)
    if local_world_size is None:
        if world_size > 1 and argv_local_rank is None and "LOCAL_RANK" not in env:
            raise _no_local_variables(rank, world_size)
        local_world_size = _single_node_local_world_size(env, world_size)
    check_whole_nodes(
        world_size,
        ("WORLD_SIZE", "LOCAL_WORLD_SIZE"),
        local_world_size,
        "start the same number of processes on every node (`torchrun --nproc-per-node`)",
    )
    local_rank = _local_rank(env, argv_local_rank, local_world_size)
    node_rank = _node_rank(env, default=rank // local_world_size, num_nodes=world_size // local_world_size)
    master_addr, master_port = read_master(env, required=world_size > 1)
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
        " or EnvDDPStrategy(cluster_environment=KubeflowEnvironment())); with several, " + LAUNCH_HINT,
    )


def _single_node_local_world_size(env: Mapping[str, str], world_size: int) -> int:
    # The pre-elastic launcher did not export LOCAL_WORLD_SIZE; without it only a one-node job is unambiguous.
    for name in ("GROUP_RANK", "NODE_RANK"):
        if env.get(name, "0").strip() not in ("0", ""):
            raise LauncherEnvironmentError(
                "LOCAL_WORLD_SIZE",
                None,
                f"it is not set, but {name}={env[name]!r} says the job spans several nodes",
                "export LOCAL_WORLD_SIZE=<processes per node>, or " + LAUNCH_HINT,
            )
    return world_size


def _local_rank_from_argv(argv: Sequence[str]) -> str | None:
    """The value of ``--local-rank=N`` / ``--local_rank N``, as the old launcher appends it, or None."""
    found = None
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag not in ("--local-rank", "--local_rank"):
            continue
        if not equals:
            if index + 1 >= len(argv):
                raise LauncherEnvironmentError(flag, None, "it has no value", LAUNCH_HINT)
            value = argv[index + 1]
        found = value
    return found


def _local_rank(env: Mapping[str, str], argv_local_rank: str | None, local_world_size: int) -> int:
    below = (local_world_size, "LOCAL_WORLD_SIZE")
    local_rank = read_int(env, "LOCAL_RANK", minimum=0, below=below)
    if argv_local_rank is not None:
        from_argv = to_int("--local-rank", argv_local_rank, minimum=0, below=below)
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
                LAUNCH_HINT + " (or add --use-env to torch.distributed.launch)",
            )
        local_rank = 0
    return local_rank


def _node_rank(env: Mapping[str, str], *, default: int, num_nodes: int) -> int:
    # torchrun exports GROUP_RANK; NODE_RANK is Lightning's and SLURM-style scripts' name for the same thing.
    for name in ("GROUP_RANK", "NODE_RANK"):
        if name in env:
            value = read_int(env, name, minimum=0, below=(num_nodes, "WORLD_SIZE/LOCAL_WORLD_SIZE"))
            assert value is not None
            return value
    return default


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
        read_int(env, name, minimum=0)
