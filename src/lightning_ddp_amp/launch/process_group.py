"""Starting and ending the process group, and explaining how it fails.

A group the script started itself (a classic script's ``dist.init_process_group``, kept before the Trainer) is used
instead, once :func:`check_script_group` finds it is the group envddp would start; the script ends it, as it started it.

The group is started on a store of its own attempt: under ``torchrun --max-restarts``, a restarted group that met
on the launcher's store could read the addresses the previous attempt left there and fail to connect. Keys are
therefore namespaced by ``TORCHELASTIC_RESTART_COUNT`` (a ``PrefixStore`` over the launcher's ``TCPStore``).

torch releases from 2.1 on are supported. What an older one lacks is probed here, not read from its version number,
and done without: :func:`torch_gaps` names it.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import itertools
import os
import re
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module

from lightning_ddp_amp.errors import PeerError, StrategyConfigurationError, TopologyMismatchError
from lightning_ddp_amp.launch.environment import started_by
from lightning_ddp_amp.launch.topology import Topology

# What gloo and NCCL say when a peer process is gone.
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|EPIPE|Socket closed"
    r"|NCCL communicator was aborted|remote process exited|Timed out waiting .* for recv|Watchdog caught"
    r"|Application timeout caused pair closure"
)
_JOINED_KEY = "joined"
_EVERYONE_KEY = "everyone_joined"
# How often a start-up wait says what it waits for (a quarter of a shorter timeout).
_REPORT_EVERY_S = 30.0

#: Binding the group to the rank's CUDA device (``init_process_group(device_id=...)``, torch 2.3 and later) lets NCCL
#: connect eagerly; without it the group connects at its first collective, which works the same, only later.
BINDS_DEVICE = "device_id" in inspect.signature(dist.init_process_group).parameters
# What a store or a connection raises when peers do not arrive in time. torch 2.2 added DistError and its store and
# network subclasses; before, the store's timeout is their base class, RuntimeError ("Socket Timeout"), and a client
# that cannot reach the store raises TimeoutError.
_StoreError: type[Exception] = getattr(dist, "DistStoreError", RuntimeError)
_NetworkError: type[Exception] = getattr(dist, "DistNetworkError", TimeoutError)
#: How long the teardown lets the group's worker threads finish with the last collective, with the GIL released.
#: Until pytorch/pytorch#154976, a process group's destructor joins those threads while holding the GIL; a worker
#: that is still freeing the last collective's tensors needs the GIL to drop their Python objects, so the finished
#: process hangs at exit (seen on torch 2.1 with gloo, about one exit in three after a collective just before exit).
_WORKERS_LET_GO_S = 0.1
# The default group init_process_group started; any other default group was started by the script. Held weakly: its
# teardown at exit must not wait for this module's.
_started: weakref.ReferenceType[Any] | None = None
_DELETE_THE_LINE = (
    "delete the script's dist.init_process_group(...) line (envddp starts the group from the launcher's variables)"
)


def torch_gaps() -> list[str]:
    """What this torch lacks that the process group would use, and what is done instead; empty on torch >= 2.3."""
    if BINDS_DEVICE:
        return []
    return [
        f"torch {torch.__version__}'s init_process_group has no device_id, so the group is not bound to the rank's"
        " CUDA device (NCCL connects at the first collective instead)"
    ]


def init_process_group(topology: Topology, backend: str, timeout: timedelta, device: torch.device) -> None:
    """Join the job's process group, waiting at most ``timeout`` for every peer.

    While it waits, it says so about every 30 s (a quarter of a shorter timeout): rank 0 how many ranks joined at
    which address and how long until the timeout, every other rank that it waits for rank 0 there. A start where
    everyone arrives in time prints nothing.

    Raises:
        PeerError: not every rank arrived within ``timeout``.
    """
    assert topology.master_addr is not None and topology.master_port is not None
    if backend == "nccl":
        # NCCL errors and timeouts must raise instead of hanging the rank (torch's async error handling).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    wait = _Wait(topology, timeout)
    store = None
    try:
        # Rank 0 hosts the store (or torchrun's agent does, on its node), so only the others wait to reach it.
        with wait.reporting(lambda: None) if topology.rank != 0 else contextlib.nullcontext():
            store = dist.TCPStore(  # type: ignore[attr-defined]
                topology.master_addr,
                topology.master_port,
                topology.world_size,
                is_master=not agent_hosts_store and topology.rank == 0,
                timeout=timeout,
                wait_for_workers=False,  # the ranks are counted below, which says while it waits
                multi_tenant=not agent_hosts_store,
            )
        prefix = f"lightning_ddp_amp/attempt_{attempt}"
        attempt_store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        wait.for_every_rank(attempt_store, prefix)
        binding: dict[str, Any] = {"device_id": device} if BINDS_DEVICE and device.type == "cuda" else {}
        dist.init_process_group(
            backend, store=attempt_store, rank=topology.rank, world_size=topology.world_size, timeout=timeout, **binding
        )
    except (_StoreError, _NetworkError, dist.DistBackendError) as error:
        joined = _joined(store, attempt)
        raise _missing_peers(topology, timeout, error, wait.counted if joined is None else joined) from error
    global _started
    _started = weakref.ref(dist.group.WORLD) if dist.is_initialized() else None


class _Wait:
    """The start-up wait for the job's ranks, within one deadline, saying about every 30 s what it waits for."""

    def __init__(self, topology: Topology, timeout: timedelta) -> None:
        self.topology = topology
        self.deadline = time.monotonic() + timeout.total_seconds()
        self.every = min(_REPORT_EVERY_S, timeout.total_seconds() / 4)
        assert topology.master_addr is not None and topology.master_port is not None
        self.address, self.port = topology.master_addr, topology.master_port
        self.where = f"{self.address}:{self.port}"
        #: The joined ranks last counted while waiting, for the error when the count cannot be read at the end (rank
        #: 0, which hosts the store, gave up and left first).
        self.counted: int | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, joined: int | None) -> None:
        rank, world_size = self.topology.rank, self.topology.world_size
        until = f"{max(self.left(), 0):.0f}s until the timeout, EnvDDPStrategy(timeout=...)"
        if rank == 0 and joined is None:  # the count could not be read
            line = f"waiting at {self.where} for the other ranks ({until})"
        elif rank == 0:
            line = f"{joined} of {world_size} ranks joined at {self.where}; waiting for the others ({until})"
        elif joined is None:
            line = f"rank {rank} of {world_size} is waiting for rank 0 at {self.where} ({until})"
        else:
            line = (
                f"rank {rank} of {world_size} reached rank 0 at {self.where} and waits for the other ranks"
                f" ({joined} of {world_size} joined; {until})"
            )
        print(f"envddp: {line}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def reporting(self, joined: Callable[[], int | None]) -> Iterator[None]:
        """Say every ``self.every`` seconds, while the block runs, what this rank waits for (``joined()`` ranks)."""
        finished = threading.Event()

        def report() -> None:
            while not finished.wait(self.every):
                self.say(joined())

        reporter = threading.Thread(target=report, name="envddp-start-up-wait", daemon=True)
        reporter.start()
        try:
            yield
        finally:
            finished.set()
            reporter.join()

    def for_every_rank(self, store: Any, prefix: str) -> None:
        """Count this rank in, then wait until every rank is counted.

        Raises:
            DistStoreError: (RuntimeError before torch 2.2) the deadline passed first.
        """
        if store.add(_JOINED_KEY, 1) == self.topology.world_size:
            store.set(_EVERYONE_KEY, "1")  # the last to arrive lets everyone go on
        counter: list[Any] = []

        def joined() -> int | None:
            # Read on a connection of the reporter's own, opened only once a report is due: the waiting one is busy.
            try:
                if not counter:
                    client = dist.TCPStore(  # type: ignore[attr-defined]
                        self.address, self.port, is_master=False, timeout=timedelta(seconds=5)
                    )
                    counter.append(dist.PrefixStore(prefix, client))  # type: ignore[attr-defined]
                count: int = counter[0].add(_JOINED_KEY, 0)
            except (_StoreError, _NetworkError):
                return None
            self.counted = count
            return count

        with self.reporting(joined):
            store.wait([_EVERYONE_KEY], timedelta(seconds=max(self.left(), 0.001)))


def started_by_script() -> bool:
    """Whether a default process group exists that :func:`init_process_group` did not start: the script's own."""
    return dist.is_initialized() and (_started is None or dist.group.WORLD is not _started())


def check_script_group(topology: Topology, backend: str, device: torch.device, backend_given: bool) -> None:
    """Check that the group the script started is the one envddp would start: same rank, world size and backend.

    Args:
        topology: What the launcher started.
        backend: The backend envddp would start the group with.
        device: The device the rank trains on; the group's backend for its tensors is the one compared.
        backend_given: ``backend`` is the user's ``process_group_backend``, not envddp's choice for the device.

    Raises:
        TopologyMismatchError: The group's rank or world size is not the launcher's.
        StrategyConfigurationError: The group runs another backend for the device's tensors, or none.
    """
    group = "the process group the script started (its dist.init_process_group)"
    if topology.launcher != "none":
        launched, fix = f"launched by {topology.launcher}", _DELETE_THE_LINE
    else:
        # Deleting the line alone would leave each process training on its own.
        launched = "started without a launcher (no RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for envddp to read)"
        fix = f"start the script with torchrun (or srun, mpirun), which sets them, and {_DELETE_THE_LINE}"
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank != topology.rank:
        raise TopologyMismatchError(
            "rank",
            rank,
            f"{group} numbers this process {rank}, but it is rank {topology.rank} of {topology.world_size}, {launched}",
            fix,
        )
    if world_size != topology.world_size:
        raise TopologyMismatchError(
            "world_size",
            world_size,
            f"{group} has {world_size} rank(s), but the job has {topology.world_size}, {launched}",
            fix,
        )
    config = dist.get_backend_config()  # one backend per device type: "cpu:gloo,cuda:nccl"
    runs = dict(part.partition(":")[::2] for part in config.split(",")).get(device.type)
    if runs == backend:
        return
    runs_what = f"runs {runs} for {device.type} tensors" if runs else f"has no backend for {device.type} tensors"
    if backend_given:
        raise StrategyConfigurationError(
            "process_group_backend",
            backend,
            f"{group} {runs_what}",
            f"pass process_group_backend={runs!r} to train on the script's group, or {_DELETE_THE_LINE}"
            if runs
            else _DELETE_THE_LINE,
        )
    raise StrategyConfigurationError(
        "backend",
        config,
        f"{group} {runs_what}, where envddp would use {backend}",
        f"{_DELETE_THE_LINE}; or, to train on {runs}, pass EnvDDPStrategy(process_group_backend={runs!r})"
        if runs
        else f"{_DELETE_THE_LINE}, or start it with backend={backend!r}",
    )


def _joined(store: Any, attempt: str) -> int | None:
    if store is None:
        return None
    try:
        count: int = store.add(f"lightning_ddp_amp/attempt_{attempt}/{_JOINED_KEY}", 0)
    except (RuntimeError, _NetworkError):
        return None
    return count


def _missing_peers(topology: Topology, timeout: timedelta, error: Exception, joined: int | None) -> PeerError:
    count = f"only {joined} of {topology.world_size} ranks joined" if joined is not None else "not every rank arrived"
    return PeerError(
        "WORLD_SIZE",
        topology.world_size,
        f"rank {topology.rank} waited {timeout.total_seconds():g}s at {topology.master_addr}:{topology.master_port}"
        f" and {count} ({error})",
        "start every rank (check the missing ranks' logs, MASTER_ADDR and MASTER_PORT), or give them longer with"
        " EnvDDPStrategy(timeout=...)",
    )


def explain_peer_failure(exception: BaseException, timeout: timedelta) -> None:
    """If ``exception`` says a peer is gone, prepend what happened and what to do to its message (in place).

    Only a collective's error qualifies: the job must be distributed, and an ``OSError`` (a broken stdout pipe,
    a failed download) is something else.
    """
    text = str(exception)
    if not dist.is_initialized() or isinstance(exception, OSError) or not exception.args:
        return
    if not _PEER_GONE.search(text) or text.startswith("A peer rank is gone"):
        return
    exception.args = (
        "A peer rank is gone or stopped responding: another process of this job crashed, was killed or hangs,"
        " so this rank stops (it never waits longer than"
        f" EnvDDPStrategy(timeout={timeout.total_seconds():g}s)). Look for the first error in the other ranks'"
        " logs. To recover automatically, launch with `torchrun --max-restarts=N` and"
        f" EnvDDPStrategy(auto_resume=True). Original error: {text}",
        *exception.args[1:],
    )


def join_or_start(
    topology: Topology, backend: str, backend_given: bool, timeout: timedelta, device: torch.device
) -> str | None:
    """The process group this process trains in: the one the script started (checked), one an earlier Trainer or
    Fabric of this process started, or one started here (and ended at exit). The Trainer's and Fabric's envddp both
    start theirs here.

    Args:
        topology: What the launcher started.
        backend: The backend envddp runs (the user's ``process_group_backend`` or its choice for the device).
        backend_given: Whether the user named the backend.
        timeout: How long collectives, and the wait for every peer, may take.
        device: The rank's device.

    Returns:
        How the group came to be, for the line rank 0 says (", using the process group the script created", or
        what this torch lacks); None when this process trains alone, with no group.

    Raises:
        StrategyConfigurationError: The script's group runs another backend than ``backend``.
        TopologyMismatchError: The script's group has another rank or world size than the launcher's.
        PeerError: A peer did not join within ``timeout``.
    """
    script_group = started_by_script()
    if script_group:
        # A classic script's dist.init_process_group, kept before the Trainer or Fabric: trained on if it is the
        # group envddp would start.
        check_script_group(topology, backend, device, backend_given)
        return ", using the process group the script created" if topology.is_distributed else None
    if not topology.is_distributed:
        return None
    if dist.is_initialized():
        return ", using the process group an earlier Trainer or Fabric started"
    init_process_group(topology, backend, timeout, device)
    # Only the group started here is ended here: the script ends its own, perhaps in an atexit handler of its own
    # that would fail on a group already gone.
    atexit.register(destroy_process_group)
    # What this torch lacks for the group (device binding before torch 2.3) only matters on CUDA.
    return "".join(f"; {gap}" for gap in (torch_gaps() if device.type == "cuda" else []))


def group_line(topology: Topology, backend: str, how: str) -> str:
    """The line rank 0 says once the group is up: "envddp: 2 ranks on 1 node(s), backend gloo, started by torchrun"."""
    return (
        f"envddp: {topology.world_size} ranks on {topology.num_nodes} node(s), backend {backend},"
        f" {started_by(topology.launcher)}{how}"
    )


def destroy_process_group() -> None:
    """Tear the group down at exit, so gloo's threads never outlive the interpreter and abort a finished run."""
    if not dist.is_initialized():
        return
    # A Ctrl+C must not interrupt the teardown halfway (Lightning's own teardown guards it the same way).
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        time.sleep(_WORKERS_LET_GO_S)
        dist.destroy_process_group()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def resolve_timeout(timeout: timedelta | float | None) -> timedelta:
    """``EnvDDPStrategy(timeout=...)`` as a ``timedelta``: seconds or a ``timedelta``; None is torch's default.

    Raises:
        StrategyConfigurationError: ``timeout`` is a bool, not a duration, too large, or not positive.
    """
    if timeout is None:
        return default_pg_timeout
    if isinstance(timeout, bool):
        raise StrategyConfigurationError("timeout", timeout, "it is a bool, not a duration", "e.g. timeout=1800")
    if not isinstance(timeout, timedelta):
        try:
            timeout = timedelta(seconds=float(timeout))
        except (TypeError, ValueError):
            raise StrategyConfigurationError(
                "timeout", timeout, "it is neither a timedelta nor a number of seconds", "e.g. timeout=1800"
            ) from None
        except OverflowError:
            raise StrategyConfigurationError(
                "timeout", timeout, "it is too large to be a duration", "e.g. timeout=86400 for a day"
            ) from None
    if timeout.total_seconds() <= 0:
        raise StrategyConfigurationError(
            "timeout", timeout, "it must be positive", "e.g. timeout=1800 (30 minutes, torch's default)"
        )
    return timeout


def broadcast_module_states(module: Module) -> None:
    """Every rank takes rank 0's parameters and buffers, as DDP's constructor does."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        dist.broadcast(tensor.detach(), src=0)


def mean_of_integers(tensor: torch.Tensor, group: Any | None = None) -> torch.Tensor:
    """The mean across ranks of an integer (or bool) tensor, keeping its fraction.

    Lightning averages integer tensors in place, truncating ``(19 + 18) / 2`` to 18; its epoch-level means divide two
    such averages (sum of values / number of samples), so with uneven shards a logged mean came out wrong. Here the
    sum is exact in int64 (no overflow of small types, bools counted) and the mean is a float of torch's default
    dtype, as ``torch.mean`` of a float tensor would be: not float64, which apex O1 refuses to mix with the float32
    sum it divides (``{'FloatTensor', 'DoubleTensor'}``) and some accelerators (MPS) lack.
    """
    total = tensor.to(torch.int64, copy=True)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.to(torch.get_default_dtype()) / dist.get_world_size(group)
