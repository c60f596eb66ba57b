"""Real GPUs: NCCL, device pinning, and envddp against the hand-written recipes on CUDA, fp32 and AMP. Skipped
where no GPU is visible."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    WORKERS,
    Torchrun,
    check,
    finish,
    free_port,
    launcher_variables,
    max_abs_difference,
    run_reference,
    start_python,
    worker_env,
)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")


def report(out: Path, rank: int) -> dict[str, object]:
    return json.loads((out / f"rank{rank}.json").read_text())


def test_single_process_trains_on_cuda_0(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(WORKERS / "train_envddp.py"),
            "--out",
            str(tmp_path),
            "--batch-size",
            "4",
            "--accelerator",
            "cuda",
            "--devices",
            "1",  # "auto" would start one rank per GPU (test_auto_devices_start_one_rank_per_gpu)
            "--epochs",
            "1",
        ],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert report(tmp_path, 0)["device"] == "cuda:0"


@two_gpus
def test_auto_devices_start_one_rank_per_gpu(tmp_path: Path) -> None:
    # `python train.py` on a machine with several GPUs: envddp starts one rank per GPU itself, on NCCL.
    command = (str(WORKERS / "train_envddp.py"), "--out", str(tmp_path), "--batch-size", "4")
    check(finish(start_python(*command, "--accelerator", "cuda", "--epochs", "1"), timeout=300))
    for rank in range(GPUS):
        assert (report(tmp_path, rank)["device"], report(tmp_path, rank)["backend"]) == (f"cuda:{rank}", "nccl")
        assert report(tmp_path, rank)["launcher"] == "self-launch"


def test_env_reports_the_gpus_cuda_and_nccl() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ddp_amp", "env", "--json"],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(result.stdout)
    assert data["devices"]["cuda_device_count"] == GPUS
    assert data["devices"]["this_rank_device"] == "cuda:0"
    assert data["versions"]["torch_cuda"] == torch.version.cuda
    assert data["versions"]["nccl"] is not None
    assert data["backends"]["default"] == "nccl"
    assert data["launcher"]["decision"].startswith("self-launch" if GPUS > 1 else "single process")


@two_gpus
def test_nccl_ranks_pin_their_gpus_and_match_the_recipe(torchrun: Torchrun, tmp_path: Path) -> None:
    recipe, envddp = tmp_path / "recipe", tmp_path / "envddp"
    recipe.mkdir()
    envddp.mkdir()
    check(torchrun.run("train_recipe.py", "--out", str(recipe), "--batch-size", "4", "--cuda", timeout=300))
    check(
        torchrun.run("train_envddp.py", "--out", str(envddp), "--batch-size", "4", "--accelerator", "cuda", timeout=300)
    )
    for rank in (0, 1):
        assert report(envddp, rank)["device"] == f"cuda:{rank}"
        assert report(envddp, rank)["backend"] == "nccl"
        assert report(envddp, rank)["ddp"] == {"device_ids": [rank], "output_device": rank}
    weights = [torch.load(path / "weights.pt") for path in (recipe, envddp)]
    assert max_abs_difference(*weights) <= 1e-5


@two_gpus
def test_one_visible_gpu_per_process_uses_cuda_0(tmp_path: Path) -> None:
    # What a scheduler does: each process sees only its own GPU through CUDA_VISIBLE_DEVICES.
    port = free_port()
    command = (str(WORKERS / "train_envddp.py"), "--out", str(tmp_path), "--batch-size", "4")
    processes = [
        start_python(
            *command,
            *("--accelerator", "cuda", "--epochs", "1"),
            env={**launcher_variables(rank, port), "CUDA_VISIBLE_DEVICES": str(rank)},
        )
        for rank in (0, 1)
    ]
    for process in processes:
        check(finish(process, timeout=300))
    assert [report(tmp_path, rank)["device"] for rank in (0, 1)] == ["cuda:0", "cuda:0"]


def _real_apex() -> bool:
    try:
        import apex
        import apex.amp
    except ImportError:
        return False
    return not getattr(apex, "IS_TEST_DOUBLE", False)


real_apex = pytest.mark.skipif(not _real_apex(), reason="needs real NVIDIA apex with apex.amp")

#: Both runs of a pair use deterministic cuBLAS; the workers turn on torch's deterministic algorithms on CUDA.
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
#: envddp and the hand-written recipe run the same CUDA kernels on the same data in the same order, and with
#: deterministic algorithms the GPU's fp16 and bf16 kernels give the same bits on every run: the states should be
#: equal. 1e-6 is only a margin for fp32 rounding, well below one fp16 step of weights this size (6e-5 at 0.1,
#: 5e-4 for bf16); a lost or extra step, another loss scale or a cast in the wrong place shows far beyond it.
TOLERANCE = 1e-6


def leaves(state: Any, key: str = "") -> dict[str, Any]:
    """A saved state as ``{key path: value}``, through its dicts, lists and tuples (``model/model_b.weight``)."""
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, list | tuple):
        items = enumerate(state)
    else:
        return {key: state}
    return {path: leaf for k, v in items for path, leaf in leaves(v, f"{key}/{k}" if key else str(k)).items()}


def assert_same_state(mine_file: Path, reference_file: Path) -> None:
    """Every tensor within TOLERANCE, every other value (loss scales, skipped steps, dtypes) equal.

    Prints each tensor's largest absolute difference and each other value, which ``pytest -rP`` shows for passing
    tests too.
    """
    # Both files were written by this repository's workers, and amp states hold plain Python objects.
    mine, reference = (
        leaves(torch.load(f, map_location="cpu", weights_only=False)) for f in (mine_file, reference_file)
    )
    assert mine.keys() == reference.keys(), f"keys only in one file: {sorted(mine.keys() ^ reference.keys())}"
    print(f"envddp ({mine_file}) against the hand-written recipe ({reference_file}):")
    far: dict[str, Any] = {}
    for key, expected in reference.items():
        actual = mine[key]
        if isinstance(expected, torch.Tensor):
            assert isinstance(actual, torch.Tensor), f"{key}: {actual!r} is not a tensor"
            assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), f"{key}: dtype or shape differs"
            difference = (actual.double() - expected.double()).abs().max().item() if expected.numel() else 0.0
            print(f"  {key:<40} max |difference| {difference:.3g}")
            if not difference <= TOLERANCE:  # NaN included
                far[key] = difference
        else:
            print(f"  {key:<40} {actual!r} (recipe: {expected!r})")
            if actual != expected:
                far[key] = (actual, expected)
    assert far == {}, f"envddp differs from the hand-written recipe (tolerance {TOLERANCE:g}): {far}"


@dataclass(frozen=True)
class Pair:
    """Where a job of the hand-written recipe and one of train_amp.py (envddp) wrote their results."""

    out: Path
    overflow: bool
    level: str = ""

    @property
    def reference(self) -> Path:
        return self.out / "reference" / "reference.pt"

    @property
    def envddp(self) -> Path:
        return self.out / "envddp"

    def report(self) -> dict[str, Any]:
        return json.loads((self.envddp / "rank0.json").read_text())


#: Real fp16 overflows only while the dynamic scale settles; an injected one makes the skip path certain.
OVERFLOW = ("--overflow-at-step", "3")


def run_pair(
    torchrun: Torchrun,
    out: Path,
    recipe: Sequence[str],
    envddp: Sequence[str],
    overflow: bool,
    nproc: int = 1,
    level: str = "",
) -> Pair:
    """Train the recipe (``recipe[0]``, with ``--cuda``) and envddp (``train_amp.py``) on the same GPU(s)."""
    pair = Pair(out, overflow, level)
    both = OVERFLOW if overflow else ()
    script, *args = recipe
    on_cuda: dict[str, Any] = {"nproc": nproc, "env": DETERMINISTIC, "timeout": 300}
    run_reference(torchrun, script, *args, *both, "--cuda", out=pair.reference.parent, **on_cuda)
    pair.envddp.mkdir(parents=True)
    check(torchrun.run("train_amp.py", "--out", str(pair.envddp), *envddp, *both, "--accelerator", "cuda", **on_cuda))
    return pair


@pytest.fixture(scope="module", params=["O1", "O2", "O3"])
def apex_pair(request: pytest.FixtureRequest, torchrun: Torchrun, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """Each apex level trained once by the recipe and once by envddp, one rank on cuda:0, for the tests below."""
    level = request.param
    return run_pair(
        torchrun,
        tmp_path_factory.mktemp(f"apex-{level}"),
        ("train_apex_recipe.py", "--opt-level", level),
        ("--precision", f"apex-{level}", "--checkpoint"),
        overflow=level == "O1",  # O1 checks the skip path; at O3 the loss scale is a fixed 1 and skips nothing
        level=level,
    )


@pytest.mark.apex
@real_apex
def test_real_apex_matches_the_hand_written_recipe(apex_pair: Pair) -> None:
    assert_same_state(apex_pair.envddp / "amp_state.pt", apex_pair.reference)
    report = apex_pair.report()
    assert report["hidden_dtypes"] == ["torch.float16"]
    if apex_pair.overflow:
        assert report["skipped"] >= 1


@pytest.mark.apex
@real_apex
def test_real_apex_skips_the_lr_scheduler_with_a_skipped_step(apex_pair: Pair) -> None:
    report = apex_pair.report()
    assert report["scheduler_steps"] == report["global_step"] - report["skipped"]


@pytest.mark.apex
@real_apex
def test_real_apex_checkpoints_its_loss_scalers(apex_pair: Pair) -> None:
    saved = torch.load(apex_pair.envddp / "last.ckpt", weights_only=False)["AmpPrecision"]
    assert saved["loss_scalers"] == apex_pair.report()["precision_state"]["loss_scalers"]
    assert saved["backend"] == "apex"
    # O2's fp32 master weights travel with it; apex's own recipe leaves them out.
    assert [t.dtype for t in saved.get("master_weights", [])] == [torch.float32] * 4 * (apex_pair.level == "O2")


@pytest.mark.parametrize(
    ("dtype", "precision", "overflow"),
    [
        # "plugin" is AmpPrecision(backend="native"): "amp-O1" would pick apex wherever it is importable.
        ("float16", ("--precision", "plugin", "--dtype", "float16"), True),
        ("bfloat16", ("--precision", "plugin", "--dtype", "bfloat16"), False),  # no loss scaler to skip one
    ],
)
def test_native_amp_matches_the_hand_written_recipe(
    torchrun: Torchrun, tmp_path: Path, dtype: str, precision: tuple[str, ...], overflow: bool
) -> None:
    pair = run_pair(torchrun, tmp_path, ("train_native_recipe.py", "--dtype", dtype), precision, overflow)
    assert_same_state(pair.envddp / "amp_state.pt", pair.reference)
    report = pair.report()
    assert report["hidden_dtypes"] == [f"torch.{dtype}"]
    if overflow:
        assert report["skipped"] >= 1


@pytest.mark.apex
@real_apex
@two_gpus
def test_real_apex_ddp_on_two_gpus_matches_the_hand_written_recipe(torchrun: Torchrun, tmp_path: Path) -> None:
    apex_ddp = ("--ddp-impl", "apex")
    pair = run_pair(
        torchrun,
        tmp_path,
        ("train_apex_recipe.py", "--opt-level", "O1", *apex_ddp),
        ("--precision", "apex-O1", *apex_ddp),
        overflow=True,
        nproc=2,
    )
    assert_same_state(pair.envddp / "amp_state.pt", pair.reference)
    assert pair.report()["wrapper"].startswith("apex.parallel.")


@pytest.mark.apex
@real_apex
def test_real_apex_o1_runs_rnns_fed_fp16_in_fp16_on_cudnns_flat_weights_as_the_recipe(
    torchrun: Torchrun, tmp_path: Path
) -> None:
    # workers/rnn_pairs.py: an LSTM, a GRU and an nn.RNN (packed) fed by a Linear, the recipe with torch's RNN dtype
    # check lifted by hand against envddp's apex-O1, one rank on cuda:0.
    runs = {}
    for mode in ("classic", "lightning"):
        out = tmp_path / mode
        run_reference(
            torchrun, "rnn_pairs.py", "--mode", mode, "--cuda", out=out, saves="weights.pt", env=DETERMINISTIC
        )
        runs[mode] = out
    for mode, out in runs.items():
        dtypes = json.loads((out / "dtypes.json").read_text())
        assert dtypes == {"lstm": "torch.float16", "gru": "torch.float16", "rnn": "torch.float16"}, (mode, dtypes)
    assert_same_state(runs["lightning"] / "weights.pt", runs["classic"] / "weights.pt")


@pytest.mark.apex
@real_apex
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_real_apex_under_fabric_ends_in_the_classic_scripts_weights(
    level: str, torchrun: Torchrun, tmp_path: Path
) -> None:
    # examples/classic/train.py against examples/fabric/train.py (Fabric(strategy="envddp", precision="apex-O1"/"O2")),
    # one rank on cuda:0 with real apex: accumulation, clipping and an inf batch whose step apex skips.
    examples = Path(__file__).parents[1] / "examples"
    cases = ("--accumulate", "2", "--clip", "1.0", "--bad-batch", "3")
    classic, kept = tmp_path / "classic.pt", tmp_path / "fabric.pt"
    check(
        torchrun.run(
            str(examples / "classic" / "train.py"),
            "--opt-level",
            level,
            *cases,
            "--checkpoint",
            str(classic),
            nproc=1,
            env=DETERMINISTIC,
        )
    )
    check(
        torchrun.run(
            str(examples / "fabric" / "train.py"),
            "--precision",
            f"apex-{level}",
            *cases,
            "--checkpoint",
            str(kept),
            nproc=1,
            env=DETERMINISTIC,
        )
    )
    before, after = torch.load(classic, weights_only=False), torch.load(kept, weights_only=False)
    for model in ("model_a", "model_b"):
        for name, value in before[model].items():
            difference = max_abs_difference({name: after[model][name].float()}, {name: value.float()})
            print(f"  {model}.{name:<24} {difference:.3g}")
            assert difference <= TOLERANCE, f"{model}.{name}"
    print(f"  loss scalers {after['amp']['loss_scalers']} (classic: {before['amp']})")
    assert after["amp"]["loss_scalers"] == [before["amp"]["loss_scaler0"]]
    assert before["amp"]["loss_scaler0"]["loss_scale"] == 2.0**15  # the inf batch's step was skipped


@pytest.mark.apex
@real_apex
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_real_apex_dcgan_under_fabric_ends_in_the_classic_scripts_state(
    level: str, torchrun: Torchrun, tmp_path: Path
) -> None:
    # apex's DCGAN example (workers/gan_pairs.py: two models, two optimizers, three loss scalers, an overflow injected
    # into errD_real and errG) by hand and under Fabric, one rank on cuda:0 with real apex; test_gan_reference.py
    # runs the same pair on the double, on one and two CPU ranks, and the Trainer's door beside it.
    saved = {}
    for door in ("classic", "fabric"):
        out = tmp_path / door
        out.mkdir()
        args = ("--door", door, "--level", level, "--out", str(out), "--cuda")
        check(torchrun.run(str(WORKERS / "gan_pairs.py"), *args, nproc=1, env=DETERMINISTIC))
        saved[door] = torch.load(out / "rank0.pt", weights_only=False)
    classic, fabric = saved["classic"], saved["fabric"]
    for part in ("parameters", "buffers"):
        difference = max_abs_difference(
            {k: v.double() for k, v in fabric[part].items()}, {k: v.double() for k, v in classic[part].items()}
        )
        print(f"  {part}: largest |difference| {difference:.3g}")
        assert difference <= TOLERANCE, part
    for optimizer, masters in classic["masters"].items():
        for index, master in enumerate(masters):
            assert (fabric["masters"][optimizer][index].double() - master.double()).abs().max().item() <= TOLERANCE
    print(f"  skipped {fabric['skipped']} (classic: {classic['skipped']}), loss scalers {fabric['amp']}")
    assert (fabric["skipped"], fabric["amp"]) == (classic["skipped"], classic["amp"])
    assert all(step in classic["skipped"][name] for name, step in classic["overflow_at"].items())
