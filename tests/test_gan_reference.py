"""NVIDIA apex's DCGAN example by hand against the same script under Fabric and under the Trainer, to the bit
(workers/gan_pairs.py, apex through its CPU double).

The example is where apex's API is at its widest: two models and two optimizers in one ``amp.initialize``, each
model in its own DDP, three losses with a loss scaler each, and a loss (errG) that reaches both models' parameters
but must step only the generator's optimizer. Each converted door must end with the classic script's parameters,
rank 0's buffers (DDP broadcasts rank 0's, then each rank's BatchNorm updates its own), fp32 master weights, loss
scalers and skipped steps, with a difference of 0.0; an overflow is injected into errD_real and into errG (O1, O2),
so each optimizer skips a step. Two-rank runs start each rank from other weights (``--seed-per-rank``): DDP's
broadcast makes them one, and every rank ends equal. The ranks are forked from a preloaded interpreter
(conftest.Preloaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Preloaded, needs_cpu_fp16

pytestmark = pytest.mark.multiprocess

#: Half precision: each model's first layer computes in it, in every door.
HALF = {"netD": ["torch.float16"], "netG": ["torch.float16"]}
#: Adam moves the weights by about its learning rate (2e-3) a step; a run whose weights moved less did not train.
MOVED = 1e-3


@dataclass(frozen=True)
class Case:
    """One level on a number of ranks, run by the classic script and by each door converted from it."""

    nproc: int
    level: str
    options: tuple[str, ...] = ()
    doors: tuple[str, ...] = ("fabric", "trainer")


SEED_PER_RANK = ("--seed-per-rank",)
CASES = {
    "1-rank-O1": Case(1, "O1"),
    "1-rank-O2": Case(1, "O2"),
    "1-rank-O3": Case(1, "O3"),
    "2-ranks-O1": Case(2, "O1", SEED_PER_RANK),
    "2-ranks-O2": Case(2, "O2", SEED_PER_RANK),
    # The Trainer's one DDP around the LightningModule cannot be apex's (three backward calls a forward).
    "2-ranks-O2-apex-ddp": Case(2, "O2", (*SEED_PER_RANK, "--ddp-impl", "apex"), doors=("fabric",)),
}


def runs_of(classic: bool = False, nproc: int | None = None, level: str | None = None) -> list[Any]:
    """(case, door) parameters: each case's converted doors (and its classic run); on ``nproc`` ranks, at ``level``."""
    return [
        pytest.param(case, door, id=f"{door}-{case}", marks=needs_cpu_fp16)
        for case, spec in CASES.items()
        if nproc in (None, spec.nproc) and level in (None, spec.level)
        for door in (("classic",) if classic else ()) + spec.doors
    ]


PAIRS = runs_of()


class Runs:
    """Each (case, door) run once, the first time a test asks for it: what each rank saved."""

    def __init__(self, preloaded: Preloaded, root: Path) -> None:
        self.preloaded = preloaded
        self.root = root
        self.saved: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def __call__(self, case: str, door: str) -> list[dict[str, Any]]:
        if (case, door) not in self.saved:
            spec = CASES[case]
            out = self.root / f"{door}-{case}"
            args = ("gan_pairs.py", "--door", door, "--level", spec.level, *spec.options)
            if door == "classic":  # judged by what it saved, as conftest.run_reference says
                self.preloaded.reference(*args, out=out, saves=f"rank{spec.nproc - 1}.pt", nproc=spec.nproc)
            else:
                out.mkdir()
                self.preloaded.run(*args, "--out", str(out), log=out / "logs", nproc=spec.nproc).check()
            self.saved[case, door] = [torch.load(out / f"rank{rank}.pt") for rank in range(spec.nproc)]
        return self.saved[case, door]


@pytest.fixture(scope="module")
def runs(preloaded: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(preloaded, tmp_path_factory.mktemp("gan"))


def apart(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each tensor of ``mine`` whose dtype or values are not exactly ``theirs``: its largest absolute difference."""
    assert mine.keys() == theirs.keys()
    found: dict[str, Any] = {}
    for name, tensor in theirs.items():
        if mine[name].dtype != tensor.dtype:
            found[name] = f"dtype {mine[name].dtype}, classic {tensor.dtype}"
            continue
        difference = (mine[name].double() - tensor.double()).abs().max().item() if tensor.numel() else 0.0
        if difference != 0.0:  # NaN included
            found[name] = difference
    return found


def masters(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{opt}[{index}]": p for opt, params in state["masters"].items() for index, p in enumerate(params)}


@pytest.mark.parametrize(("case", "door"), PAIRS)
def test_every_parameter_on_every_rank_is_the_classic_scripts(runs: Runs, case: str, door: str) -> None:
    for rank, (mine, theirs) in enumerate(zip(runs(case, door), runs(case, "classic"), strict=True)):
        assert apart(mine["parameters"], theirs["parameters"]) == {}, f"rank {rank}"


@pytest.mark.parametrize(("case", "door"), PAIRS)
def test_rank_zeros_buffers_are_the_classic_scripts(runs: Runs, case: str, door: str) -> None:
    assert apart(runs(case, door)[0]["buffers"], runs(case, "classic")[0]["buffers"]) == {}


@pytest.mark.parametrize(("case", "door"), PAIRS)
def test_every_fp32_master_weight_is_the_classic_scripts(runs: Runs, case: str, door: str) -> None:
    for rank, (mine, theirs) in enumerate(zip(runs(case, door), runs(case, "classic"), strict=True)):
        assert apart(masters(mine), masters(theirs)) == {}, f"rank {rank}"


@pytest.mark.parametrize(("case", "door"), PAIRS)
def test_every_loss_scaler_ends_at_the_classic_scripts_scale_and_count(runs: Runs, case: str, door: str) -> None:
    for mine, theirs in zip(runs(case, door), runs(case, "classic"), strict=True):
        assert list(theirs["amp"]) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
        assert mine["amp"] == theirs["amp"]


@pytest.mark.parametrize(("case", "door"), PAIRS)
def test_each_optimizer_skips_the_steps_the_classic_script_skips(runs: Runs, case: str, door: str) -> None:
    for mine, theirs in zip(runs(case, door), runs(case, "classic"), strict=True):
        assert mine["skipped"] == theirs["skipped"]


@pytest.mark.parametrize("case", [pytest.param(c, marks=needs_cpu_fp16) for c, s in CASES.items() if s.level != "O3"])
def test_the_injected_overflows_skip_a_step_of_each_optimizer_and_lower_their_scales(runs: Runs, case: str) -> None:
    for state in runs(case, "classic"):
        for optimizer, step in state["overflow_at"].items():
            assert step in state["skipped"][optimizer], (optimizer, state["skipped"])
        # errD_real's scaler (0) and errG's (2) backed off from apex's first dynamic scale.
        assert state["amp"]["loss_scaler0"]["loss_scale"] < 2.0**16
        assert state["amp"]["loss_scaler2"]["loss_scale"] < 2.0**16


@needs_cpu_fp16
def test_o3_skips_no_step_and_keeps_every_loss_scale_at_one(runs: Runs) -> None:
    (state,) = runs("1-rank-O3", "classic")
    assert state["skipped"] == {"optD": [], "optG": []}
    assert [scaler["loss_scale"] for scaler in state["amp"].values()] == [1.0] * 3


@pytest.mark.parametrize(("case", "door"), runs_of(classic=True))
def test_every_run_computes_in_float16_and_moves_its_weights(runs: Runs, case: str, door: str) -> None:
    for state in runs(case, door):
        assert state["dtypes"] == HALF
        moved = max(
            (state["parameters"][name].double() - start.double()).abs().max().item()
            for name, start in state["initial"].items()
        )
        assert MOVED < moved < float("inf")


@pytest.mark.parametrize(("case", "door"), runs_of(classic=True, level="O2"))
def test_o2_casts_the_convolutions_to_fp16_keeps_batchnorm_fp32_and_steps_fp32_masters(
    runs: Runs, case: str, door: str
) -> None:
    for state in runs(case, door):
        for name, parameter in state["parameters"].items():  # 4-D: a convolution's weight; 1-D: BatchNorm's
            assert parameter.dtype == (torch.float16 if parameter.dim() == 4 else torch.float32), name
        assert {master.dtype for master in masters(state).values()} == {torch.float32}


@pytest.mark.parametrize(("case", "door"), runs_of(classic=True, nproc=2))
def test_ranks_that_start_from_other_weights_end_with_the_same_weights_and_masters(
    runs: Runs, case: str, door: str
) -> None:
    first, second = runs(case, door)
    weights = {name for name in first["initial"] if name.endswith(".weight")}  # biases start at 0 on every rank
    assert apart(first["initial"], second["initial"]).keys() == weights  # --seed-per-rank
    assert apart(second["parameters"], first["parameters"]) == {}
    assert apart(masters(second), masters(first)) == {}


def test_the_trainer_door_refuses_apex_ddp_saying_why(preloaded: Preloaded, tmp_path: Path) -> None:
    args = ("--door", "trainer", "--level", "O2", "--ddp-impl", "apex", "--out", str(tmp_path))
    ranks = preloaded.run("gan_pairs.py", *args, log=tmp_path / "logs", nproc=1)
    assert ranks.returncode == 2
    assert "takes one backward per forward, and this training_step makes three" in ranks.logs[0]


@needs_cpu_fp16
def test_the_trainer_door_without_the_unused_parameter_search_names_envddps_setting(
    preloaded: Preloaded, tmp_path: Path
) -> None:
    # One DDP around the LightningModule and three backward calls a step: DDP's error, with envddp's setting in place
    # of Lightning's advice (its own ddp, where apex cannot run).
    args = ("--door", "trainer", "--level", "O1", "--strategy", "envddp", "--out", str(tmp_path))
    ranks = preloaded.run("gan_pairs.py", *args, log=tmp_path / "logs", nproc=2)
    assert ranks.returncode != 0
    said = "".join(ranks.logs)
    assert 'Trainer(strategy="envddp_find_unused_parameters_true")' in said
    assert "strategy='ddp_find_unused_parameters_true'" not in said
