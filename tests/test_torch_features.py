"""torch releases from 2.1 on: what the package does where a release lacks a feature it uses (probed, done without,
named), and the clear error where a user asks for what this torch cannot do."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from conftest import free_port, worker_env
from packaging.version import Version
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp import AmpPrecision, PeerError, PrecisionConfigurationError
from lightning_ddp_amp.amp import native_backend
from lightning_ddp_amp.commands.env import command as env_report
from lightning_ddp_amp.commands.env import text as env_text
from lightning_ddp_amp.launch import process_group
from lightning_ddp_amp.launch.topology import Topology

TORCH_RELEASE = Version(torch.__version__).release


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_on_the_cpu(precision: AmpPrecision) -> L.Trainer:
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[precision],
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), data)
    return trainer


@pytest.fixture
def torch_without_cpu_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch, as the package sees one without CPU float16 (torch before 2.3)."""
    monkeypatch.setattr(native_backend, "cpu_fp16_missing", lambda: ("fp16 linear", 'torch.autocast("cpu", ...)'))


def test_cpu_fp16_probe_agrees_with_the_releases_known_to_have_it() -> None:
    # CPU float16 matmuls, CPU fp16 autocast and torch.amp.GradScaler all arrived in torch 2.3.
    assert bool(native_backend.cpu_fp16_missing()) == (TORCH_RELEASE < (2, 3))


def test_native_fp16_on_a_cpu_without_fp16_is_an_error_naming_what_torch_lacks(torch_without_cpu_fp16: None) -> None:
    expected = (
        r"^dtype='float16': torch \S+ cannot train in float16 on the CPU: it lacks fp16 linear,"
        r' torch.autocast\("cpu", ...\). Fix: use dtype="bfloat16"'
    )
    with pytest.raises(PrecisionConfigurationError, match=expected):
        fit_on_the_cpu(AmpPrecision(backend="native", opt_level="O1"))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_every_fp16_level_is_refused_on_a_cpu_without_fp16(torch_without_cpu_fp16: None, level: str) -> None:
    with pytest.raises(PrecisionConfigurationError, match="cannot train in float16 on the CPU"):
        fit_on_the_cpu(AmpPrecision(backend="native", opt_level=level))


@pytest.mark.parametrize("precision", [{"dtype": "bfloat16"}, {"opt_level": "O0"}])
def test_bfloat16_and_fp32_train_on_a_cpu_without_fp16(torch_without_cpu_fp16: None, precision: Any) -> None:
    assert fit_on_the_cpu(AmpPrecision(backend="native", **precision)).global_step == 2


@pytest.mark.skipif(not native_backend.cpu_fp16_missing(), reason="this torch has CPU float16 (torch 2.3 and later)")
def test_this_torch_refuses_native_fp16_on_the_cpu() -> None:
    with pytest.raises(PrecisionConfigurationError, match=r"cannot train in float16 on the CPU.*install torch>=2.3"):
        fit_on_the_cpu(AmpPrecision(backend="native"))


def test_cuda_scaler_falls_back_to_torch_cuda_amp_where_torch_amp_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.amp, "GradScaler", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available" here; deprecated on torch that has torch.amp's
        amp = native_backend.NativeAmp("O1", torch.float16, "cuda", None, None, 2.0**24)
    assert isinstance(amp.scaler, torch.cuda.amp.GradScaler)


@pytest.fixture
def recorded_init(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """init_process_group's keyword arguments; the store and the group are doubles, no peer exists."""
    recorded: dict[str, Any] = {}

    class StoreDouble:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def add(self, key: str, amount: int) -> int:
            return amount

        def set(self, key: str, value: str) -> None:
            pass

        def wait(self, keys: list[str], timeout: timedelta) -> None:
            pass  # every rank has joined

    monkeypatch.setattr(dist, "TCPStore", StoreDouble)
    monkeypatch.setattr(dist, "PrefixStore", StoreDouble)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: recorded.update(kwargs))
    return recorded


TWO_RANKS = Topology(
    rank=0, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=29500, launcher="torchrun"
)


@pytest.mark.parametrize("binds", [True, False])
def test_group_is_bound_to_the_cuda_device_only_where_torch_can(
    recorded_init: dict[str, Any], monkeypatch: pytest.MonkeyPatch, binds: bool
) -> None:
    monkeypatch.setattr(process_group, "BINDS_DEVICE", binds)
    process_group.init_process_group(TWO_RANKS, "gloo", timedelta(seconds=5), torch.device("cuda", 1))
    assert recorded_init.get("device_id") == (torch.device("cuda", 1) if binds else None)
    assert ("device_id" in recorded_init) == binds


def test_cpu_groups_are_never_bound_to_a_device(recorded_init: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # Even where torch can bind a group to a device (2.3 and later), a CPU group is not bound.
    monkeypatch.setattr(process_group, "BINDS_DEVICE", True)
    process_group.init_process_group(TWO_RANKS, "gloo", timedelta(seconds=5), torch.device("cpu"))
    assert "device_id" not in recorded_init


def test_device_binding_is_probed_from_init_process_groups_signature() -> None:
    # device_id arrived in torch 2.3; the package reads the signature, this test the release.
    assert (TORCH_RELEASE >= (2, 3)) == process_group.BINDS_DEVICE


def test_what_torch_lacks_for_the_group_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process_group, "BINDS_DEVICE", True)
    assert process_group.torch_gaps() == []
    monkeypatch.setattr(process_group, "BINDS_DEVICE", False)
    (gap,) = process_group.torch_gaps()
    assert "init_process_group has no device_id" in gap


def test_what_torch_lacks_for_native_amp_is_named(
    torch_without_cpu_fp16: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch.amp, "GradScaler", raising=False)
    scaler, cpu_fp16 = native_backend.torch_gaps()
    assert "has no torch.amp.GradScaler, so CUDA uses torch.cuda.amp.GradScaler" in scaler
    assert 'lacks fp16 linear, torch.autocast("cpu", ...), so native float16 AMP runs on CUDA only' in cpu_fp16


def test_native_amp_lacks_nothing_on_a_torch_with_cpu_fp16_and_torch_amp_grad_scaler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(native_backend, "cpu_fp16_missing", lambda: ())
    monkeypatch.setattr(torch.amp, "GradScaler", object, raising=False)  # a stand-in: only its presence is read
    assert native_backend.torch_gaps() == []


def test_a_rank_alone_is_a_peer_error_counting_the_ranks_that_joined() -> None:
    # The store's timeout is DistStoreError where torch has it, its base class before torch 2.2.
    alone = Topology(
        rank=0, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=free_port(), launcher="torchrun"
    )
    with pytest.raises(PeerError, match=r"^WORLD_SIZE=2: rank 0 waited 1s .* only 1 of 2 ranks joined"):
        process_group.init_process_group(alone, "gloo", timedelta(seconds=1), torch.device("cpu"))


#: One rank of a job of four, joining on the CPU with a 4-second timeout: argv is its rank and rank 0's port.
JOIN_ONE_OF_FOUR = """
import sys, torch
from datetime import timedelta
from lightning_ddp_amp.launch import process_group
from lightning_ddp_amp.launch.topology import Topology
rank, port = int(sys.argv[1]), int(sys.argv[2])
job = Topology(rank=rank, world_size=4, local_world_size=4, master_addr="127.0.0.1", master_port=port,
               launcher="environment")
process_group.init_process_group(job, "gloo", timedelta(seconds=4), torch.device("cpu"))
"""


def test_a_start_up_wait_says_what_it_waits_for_and_ends_in_the_same_peer_error() -> None:
    # WORLD_SIZE=4 and only ranks 0 and 1 started: each says, every second (a quarter of the timeout), what it
    # waits for, then stops with the PeerError a silent wait ended in.
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", JOIN_ONE_OF_FOUR, str(rank), port],
            env=worker_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    rank0, rank1 = (process.communicate(timeout=120)[0] for process in ranks)
    where = f"127.0.0.1:{port}"
    assert f"envddp: 2 of 4 ranks joined at {where}; waiting for the others (" in rank0
    assert "s until the timeout, EnvDDPStrategy(timeout=...))" in rank0
    assert f"PeerError: WORLD_SIZE=4: rank 0 waited 4s at {where} and only 2 of 4 ranks joined" in rank0
    # Rank 1 may find rank 0's store at once (then it waits for the others) or wait for it first.
    assert f"envddp: rank 1 of 4 reached rank 0 at {where} and waits for the other ranks (2 of 4 joined;" in rank1 or (
        f"envddp: rank 1 of 4 is waiting for rank 0 at {where}" in rank1
    )
    # Rank 0 gives up first when it started first, taking its store with it: rank 1 then names the count it last read
    # while waiting, or none if rank 0's store went before rank 1 ever counted (a start slower than the timeout).
    assert re.search(
        rf"PeerError: WORLD_SIZE=4: rank 1 waited 4s at {re.escape(where)} and"
        r" (only 2 of 4 ranks joined|not every rank arrived) \(",
        rank1,
    ), rank1


def test_a_rank_waiting_for_rank_zero_says_where_it_looks(capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens at rank 0's address: rank 1 says where it looks for rank 0, then gives up.
    job = Topology(
        rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=free_port(), launcher="torchrun"
    )
    with pytest.raises(PeerError, match=r"^WORLD_SIZE=2: rank 1 waited 2s"):
        process_group.init_process_group(job, "gloo", timedelta(seconds=2), torch.device("cpu"))
    assert f"envddp: rank 1 of 2 is waiting for rank 0 at 127.0.0.1:{job.master_port} (" in capsys.readouterr().err


def test_the_env_report_lists_what_this_torch_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process_group, "BINDS_DEVICE", False)
    data = env_report.report(argv=[])
    assert any("init_process_group has no device_id" in gap for gap in data["versions"]["torch_gaps"])
    assert "\n  without    torch " in env_text.render(data)


def test_the_env_report_flags_a_torch_older_than_2_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.0.1")
    problems = env_report.report(argv=[])["problems"]
    assert {
        "problem": "torch 2.0.1 is older than the releases lightning-ddp-amp supports",
        "fix": "pip install 'torch>=2.1'",
    } in problems
