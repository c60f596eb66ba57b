"""Shared fixtures: a clean launcher environment for in-process tests, and real torchrun launches."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from lightning_ddp_amp.amp import native_backend

sys.path.insert(0, str(Path(__file__).parents[1] / "build_backend"))
from pytorch_lightning_flavour import write_flavour

PACKAGE = "lightning_ddp_amp"

WORKERS = Path(__file__).parent / "workers"
#: Holds the CPU test double of NVIDIA apex (see doubles/README.md).
DOUBLES = Path(__file__).parent / "doubles"

#: Everything a launcher or a cluster may export; in-process tests start without any of it.
LAUNCHER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "PL_GLOBAL_SEED",
    # srun's and mpirun's: without these, a CI job that itself runs under SLURM or MPI is not mistaken for one.
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        # The pytorch_lightning flavour is written when the package is built; a checkout's editable install has the
        # one of its last build, so the tests write it again from today's sources (only what changed).
        write_flavour()
    # Under pytest-xdist (`-n 2`), the controller rebuilds each warning a worker recorded by importing its category's
    # module: the apex double's own categories need the double importable there. The controller runs no test.
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        sys.path.append(str(DOUBLES))


@pytest.fixture(autouse=True)
def clean_launcher_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In-process tests see no launcher variables unless they set them, and leave rank-zero state as found."""
    from lightning.pytorch.utilities import rank_zero_only

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    rank = getattr(rank_zero_only, "rank", 0)
    standalone = sys.modules.get("pytorch_lightning.utilities")
    standalone_rank = getattr(getattr(standalone, "rank_zero_only", None), "rank", 0)
    yield
    rank_zero_only.rank = rank
    if standalone is not None:
        standalone.rank_zero_only.rank = standalone_rank


@dataclass(frozen=True)
class Flavour:
    """Lightning as a user imports it (``lightning.pytorch`` or ``pytorch_lightning``), and this package's plugins
    for it (``lightning_ddp_amp`` or ``lightning_ddp_amp.pytorch_lightning``)."""

    name: str
    pl: ModuleType
    plugins: ModuleType


@pytest.fixture(params=["lightning", "pytorch_lightning"])
def flavour(request: pytest.FixtureRequest) -> Flavour:
    """Each namespace in turn; the standalone one is skipped when ``pytorch_lightning`` is not installed."""
    if request.param == "lightning":
        return Flavour("lightning", importlib.import_module("lightning.pytorch"), importlib.import_module(PACKAGE))
    pl = pytest.importorskip("pytorch_lightning")
    return Flavour("pytorch_lightning", pl, importlib.import_module(f"{PACKAGE}.pytorch_lightning"))


def _forget_apex(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def apex_double(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The apex test double as ``apex``, freshly imported, returned as ``apex.amp``.

    Like apex, the double's O1 patches torch for the rest of the process; at teardown its test-only
    ``unpatch_torch_for_tests()`` puts torch back (every copy's patches, if the test imported the double again), and
    torch's attention fast path is set back as it was.
    """
    _forget_apex(monkeypatch)
    monkeypatch.syspath_prepend(str(DOUBLES))
    mha = getattr(torch.backends, "mha", None)  # torch 2.3 and later; AmpPrecision turns it off under apex O1
    fast_path = mha is None or mha.get_fastpath_enabled()
    import apex.amp

    yield apex.amp
    apex.amp.unpatch_torch_for_tests()
    if mha is not None:
        mha.set_fastpath_enabled(fast_path)
    _forget_apex(monkeypatch)


def cpu_fp16_missing() -> str | None:
    """Why this torch cannot compute in float16 on the CPU, or None when it can (torch 2.3 and later).

    The package's own probe (:func:`lightning_ddp_amp.amp.native_backend.cpu_fp16_missing`), which
    ``test_torch_features.py`` checks against the torch releases known to have it.
    """
    missing = native_backend.cpu_fp16_missing()
    if not missing:
        return None
    return f"this torch ({torch.__version__}) lacks CPU float16: {', '.join(missing)}; torch 2.3 and later have it"


CPU_FP16_MISSING = cpu_fp16_missing()
#: For tests that compute in float16 on the CPU: the apex double's O1/O2/O3, native fp16 AMP.
needs_cpu_fp16 = pytest.mark.skipif(CPU_FP16_MISSING is not None, reason=CPU_FP16_MISSING or "")


@pytest.fixture
def no_apex(monkeypatch: pytest.MonkeyPatch) -> None:
    """apex cannot be imported, whatever is installed."""
    _forget_apex(monkeypatch)
    monkeypatch.setitem(sys.modules, "apex", None)  # type: ignore[arg-type]


@pytest.fixture
def apex_without_amp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An ``apex`` package without ``apex.amp``: a release after 25.05, or PyPI's unrelated 'apex'."""
    _forget_apex(monkeypatch)
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))


#: Ports handed out start here, below the kernel's ephemeral range (32768 and up on Linux), so that no connection's
#: own port takes one between the check and the use; each pytest-xdist worker has its own block of PORTS_PER_WORKER,
#: so two workers never hand out the same port (the OS's "any free port" can: EADDRINUSE in CI, once).
FIRST_PORT, PORTS_PER_WORKER = 20000, 2000
_port_count = itertools.count()


def free_port() -> int:
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = FIRST_PORT + (worker % 6) * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        port = first + next(_port_count) % PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or in TIME_WAIT from an earlier run
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORTS_PER_WORKER - 1}")


@dataclass
class Torchrun:
    """Starts a worker script under ``python -m torch.distributed.run`` on gloo, one node per call."""

    def start(
        self,
        script: str,
        *args: str,
        nproc: int = 2,
        nnodes: int = 1,
        node_rank: int = 0,
        port: int | None = None,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        apex_double: bool = False,
    ) -> subprocess.Popen[str]:
        command = [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port or free_port()}",
            *extra,
            str(WORKERS / script),
            *args,
        ]
        return start_python(*command, env=env, apex_double=apex_double)

    def run(self, script: str, *args: str, timeout: float = 180, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """Run to completion; a hang becomes a test failure after ``timeout`` seconds."""
        process = self.start(script, *args, **kwargs)  # type: ignore[arg-type]
        return finish(process, timeout)


def start_python(*args: str, env: dict[str, str] | None = None, apex_double: bool = False) -> subprocess.Popen[str]:
    """``python *args`` in the background, stdout and stderr merged; :func:`finish` collects it.

    The process leads a session of its own, so that :func:`kill` also ends what it started (torchrun's ranks).
    """
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=worker_env(env, apex_double),
        start_new_session=True,
    )


def kill(process: subprocess.Popen[str]) -> None:
    """SIGKILL ``process`` and every process it started: a rank left behind would hold the output pipe open."""
    with contextlib.suppress(ProcessLookupError):  # the whole group has ended
        os.killpg(process.pid, signal.SIGKILL)


def launcher_variables(rank: int, port: int | str, world_size: int = 2) -> dict[str, str]:
    """What torchrun exports to ``rank`` of a one-node job, for ranks a test starts by hand (no supervisor)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def worker_env(extra: dict[str, str] | None = None, apex_double: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    if apex_double:
        env["PYTHONPATH"] = os.pathsep.join([str(DOUBLES), *filter(None, [env.get("PYTHONPATH")])])
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update(extra or {})
    return env


def finish(process: subprocess.Popen[str], timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(process)
        output, _ = process.communicate()
        pytest.fail(f"{process.args} did not finish within {timeout}s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, output, None)


def check(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout[-6000:]}"
    return result


def run_reference(
    torchrun: Torchrun,
    script: str,
    *args: str,
    out: Path,
    saves: str = "reference.pt",
    timeout: float = 180,
    **kwargs: object,
) -> Path:
    """Run a hand-written reference worker with ``--out out`` and return the file it saves there.

    A reference is judged by what it saved, not by how it exits: torch's gloo teardown can abort a process after
    its work is done ("terminate called without an active exception"), and on torch 2.1 the recipe's plain
    ``destroy_process_group()`` can hang it (pytorch/pytorch#154976). The workers write ``saves`` atomically, so its
    presence means it is complete; without it, the run failed. The package's own runs stay strict: ``check``.
    """
    out.mkdir(parents=True, exist_ok=True)
    saved = out / saves
    process = torchrun.start(script, "--out", str(out), *args, **kwargs)  # type: ignore[arg-type]
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(process)
        output, _ = process.communicate()
        if not saved.exists():
            pytest.fail(f"{script} did not finish within {timeout}s and saved no {saves}:\n{output[-6000:]}")
    if not saved.exists():
        pytest.fail(f"{script} saved no {saves} (exit code {process.returncode}):\n{output[-6000:]}")
    return saved


@pytest.fixture(scope="session")
def torchrun() -> Torchrun:
    return Torchrun()


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def drop_loader_positions(checkpoint: Path) -> None:
    """Rewrite ``checkpoint`` as lightning_ddp_amp wrote it in one process before it recorded the training
    DataLoader's position: without the positions Lightning keeps in its fit loop's entry."""
    saved = torch.load(checkpoint, weights_only=False)
    del saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    torch.save(saved, checkpoint)


@dataclass
class Ranks:
    """What one run of :class:`Preloaded` left: each rank's exit status and output."""

    returncodes: list[int]
    logs: list[str]

    @property
    def returncode(self) -> int:
        """The first failing rank's exit status, or 0: what torchrun's agent ends with, roughly."""
        return next((code for code in self.returncodes if code != 0), 0)

    @property
    def stdout(self) -> str:
        """Every rank's output, rank by rank."""
        return "\n".join(self.logs)

    def check(self) -> Ranks:
        assert self.returncodes == [0] * len(self.returncodes), "\n".join(
            f"--- rank {rank} exited {code}:\n{log[-4000:]}"
            for rank, (code, log) in enumerate(zip(self.returncodes, self.logs, strict=True))
        )
        return self


class Preloaded:
    """Ranks forked from an interpreter that already imported torch, Lightning and this package
    (workers/fork_server.py): for tests that need real ranks but not torchrun's agent. A run costs its training, not
    the ~12 s of a torchrun launch. The apex test double is on the ranks' path; they import it only if they ask.
    """

    def __init__(self) -> None:
        self.server = self._start()

    @staticmethod
    def _start() -> subprocess.Popen[str]:
        """Start the server and wait for its imports, so that a run's timeout is the run's own."""
        server = subprocess.Popen(
            [sys.executable, str(WORKERS / "fork_server.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=worker_env(apex_double=True),
            start_new_session=True,
        )
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], 180)
        if not ready or json.loads(server.stdout.readline() or "{}") != {"ready": True}:
            kill(server)
            pytest.fail(f"the fork server did not start within 180 s (exit code {server.poll()})")
        return server

    def run(
        self,
        script: str,
        *args: str,
        log: Path,
        nproc: int = 2,
        timeout: float = 180,
        env: Sequence[dict[str, str]] | None = None,
        apex_double: bool = True,
    ) -> Ranks:
        """Run ``script *args`` on ``nproc`` ranks of one node; their output goes to ``log``/rank<N>.log.

        Each rank gets torchrun's variables, or, given ``env``, rank N gets ``env[N]`` (another launcher's). Without
        ``apex_double`` the ranks cannot import apex (the server never imports it), as on a machine without it.
        """
        log.mkdir(parents=True, exist_ok=True)
        request: dict[str, Any] = {"script": str(WORKERS / script), "args": list(args), "nproc": nproc}
        request["port"] = free_port()
        if env is not None:
            request["env"] = list(env)
        if not apex_double:
            request["hide"] = [str(DOUBLES)]
        if self.server.poll() is not None:  # closed after an earlier run hung
            self.server = self._start()
        assert self.server.stdin is not None and self.server.stdout is not None
        self.server.stdin.write(json.dumps({**request, "log": str(log)}) + "\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        answer = self.server.stdout.readline() if ready else ""
        logs = [(log / f"rank{r}.log").read_text() if (log / f"rank{r}.log").exists() else "" for r in range(nproc)]
        if not answer:
            self.close()
            said = "\n".join(f"--- rank {rank}:\n{text[-3000:]}" for rank, text in enumerate(logs))
            why = f"did not finish within {timeout}s" if not ready else "lost its fork server"
            pytest.fail(f"{script} {' '.join(args)} {why}:\n{said}")
        return Ranks(json.loads(answer)["returncodes"], logs)

    def reference(
        self, script: str, *args: str, out: Path, saves: str = "reference.pt", nproc: int = 2, timeout: float = 120
    ) -> Path:
        """Run a hand-written reference worker with ``--out out``; judged by what it saved, as :func:`run_reference`.

        A reference that saved and then hung in the recipe's plain teardown (torch 2.1) is ended with the server.
        """
        out.mkdir(parents=True, exist_ok=True)
        saved = out / saves
        try:
            ranks = self.run(script, "--out", str(out), *args, log=out / "logs", nproc=nproc, timeout=timeout)
        except pytest.fail.Exception:
            if not saved.exists():
                raise
        else:
            if not saved.exists():
                pytest.fail(f"{script} saved no {saves} (exit codes {ranks.returncodes}):\n{ranks.logs[0][-6000:]}")
        return saved

    def close(self) -> None:
        kill(self.server)
        self.server.communicate()


@pytest.fixture(scope="session")
def preloaded() -> Iterator[Preloaded]:
    server = Preloaded()
    yield server
    server.close()
