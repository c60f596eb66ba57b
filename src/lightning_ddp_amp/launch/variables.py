"""Reading one launcher variable, checked: an integer in its range, the rendezvous address and port, whole nodes.

Every bad value is a :class:`~lightning_ddp_amp.errors.LauncherEnvironmentError` that names the variable, its value
and the fix; ``hint`` is the launcher's own way to set it right, torchrun's unless a reader says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_ddp_amp.errors import LauncherEnvironmentError

LAUNCH_HINT = "launch with `torchrun --nproc-per-node=N train.py`, which sets every launcher variable for you"


def read_int(
    env: Mapping[str, str],
    name: str,
    *,
    minimum: int,
    below: tuple[int, str] | None = None,
    hint: str = LAUNCH_HINT,
) -> int | None:
    """The integer ``env[name]``, at least ``minimum`` and below ``below``'s limit; None when it is not set.

    Args:
        below: The limit and the name it is known by (``(world_size, "WORLD_SIZE")``), or None for no limit.
    """
    raw = env.get(name)
    if raw is None:
        return None
    return to_int(name, raw, minimum=minimum, below=below, hint=hint)


def required_int(
    env: Mapping[str, str],
    name: str,
    hint: str,
    *,
    minimum: int,
    below: tuple[int, str] | None = None,
    family: Sequence[str],
) -> int:
    """:func:`read_int` of a variable the launcher always sets; its absence names those of ``family`` that are set."""
    value = read_int(env, name, minimum=minimum, below=below, hint=hint)
    if value is None:
        seen = [key for key in family if key in env]
        raise LauncherEnvironmentError(name, None, f"it is not set, although {', '.join(seen)} are", hint)
    return value


def to_int(name: str, raw: str, *, minimum: int, below: tuple[int, str] | None = None, hint: str = LAUNCH_HINT) -> int:
    """``raw``, the value of ``name``, as an integer at least ``minimum`` and below ``below``'s limit."""
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


def check_whole_nodes(world_size: int, names: tuple[str, str], local_world_size: int, fix: str) -> None:
    """Refuse a world that is not a whole number of nodes of ``local_world_size`` processes.

    Args:
        names: What the launcher calls the world size and the processes per node.
    """
    if local_world_size > world_size or world_size % local_world_size:
        raise LauncherEnvironmentError(
            names[1],
            str(local_world_size),
            f"{names[0]}={world_size} is not a whole number of nodes of {local_world_size} processes",
            fix,
        )


def read_master(
    env: Mapping[str, str],
    *,
    required: bool,
    default_addr: str | None = None,
    default_port: int | None = None,
    hint: str = LAUNCH_HINT,
) -> tuple[str | None, int | None]:
    """Rank 0's rendezvous address and port: MASTER_ADDR and MASTER_PORT, else the launcher's defaults.

    Args:
        required: Several ranks must meet: a missing address or port is an error.
        default_addr: What the launcher implies without MASTER_ADDR (SLURM's first node), or None.
        default_port: What the launcher implies without MASTER_PORT, or None.
    """
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
