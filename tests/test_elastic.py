"""Elastic resume with real processes (forked from the preloaded interpreter, conftest.Preloaded): a checkpoint saved mid-epoch on W ranks continues on W' ranks through
``Trainer.fit`` (workers/train_elastic.py), each remaining sample trained once, counted per sample index.

The pad rule these tests count with (docs/resume.md, "On another number of ranks"): the rest of the epoch is padded to a multiple of W' with
the epoch's first samples, as ``DistributedSampler`` pads an epoch; those pad samples are trained a second time.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Preloaded, Ranks, max_abs_difference

pytestmark = [pytest.mark.multiprocess]

SCRIPT = "train_elastic.py"
#: Reductions over another number of ranks add in another order: float32 rounding, not a sample more or less.
#: Measured: about 1e-7 after 12 steps; one batch off moves the weights by about 1e-2.
WEIGHTS_TOLERANCE = 1e-5


def run(preloaded: Preloaded, out: Path, ranks: int, *args: str, plain: bool = False, check: bool = True) -> Ranks:
    """One start of the worker on ``ranks`` ranks with torchrun's variables, or as a plain one-process
    ``python train.py`` (no launcher's variables), forked from the preloaded interpreter."""
    out.mkdir(parents=True, exist_ok=True)
    env = [{}] if plain else None
    ranks_run = preloaded.run(
        SCRIPT, "--out", str(out), *args, nproc=ranks, env=env, log=out / "logs" / args[args.index("--tag") + 1]
    )
    return ranks_run.check() if check else ranks_run


def lines(out: Path, tag: str) -> list[dict[str, Any]]:
    """Every training batch the start ``tag`` recorded, on every rank, each with its rank."""
    found = []
    for path in sorted((out / "trained").glob(f"{tag}-rank*.jsonl")):
        rank = int(path.stem.rsplit("rank", 1)[1])
        found += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines()]
    return found


def trained(records: list[dict[str, Any]]) -> Counter[int]:
    return Counter(index for record in records for index in record["indices"])


def first_samples(records: list[dict[str, Any]], ranks: int, count: int) -> list[int]:
    """The first ``count`` samples of the epoch's order, read off the first batch of each of ``ranks`` ranks
    (rank r's j-th sample is the order's (j * ranks + r)-th)."""
    firsts = {r["rank"]: r["indices"] for r in records if r["epoch"] == 0 and r["batch_idx"] == 0}
    order = [firsts[rank][j] for j in range(len(firsts[0])) for rank in range(ranks)]
    return order[:count]


def report(out: Path, kind: str, tag: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"{kind}-{tag}-rank{rank}.json").read_text())  # type: ignore[no-any-return]


def weights(out: Path, tag: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights-{tag}.pt")  # type: ignore[no-any-return]


def expect_once_each(n: int, saved: list[dict[str, Any]], resumed: list[dict[str, Any]], pad: list[int]) -> None:
    """Epoch 0 over both starts: every sample once, the pad samples twice; nothing else."""
    before = [r for r in saved if r["epoch"] == 0]
    after = [r for r in resumed if r["epoch"] == 0]
    expected = Counter(range(n)) + Counter(pad)
    assert trained(before) + trained(after) == expected
    assert not set(trained(before)) & set(trained(after)) - set(pad), "a trained sample was trained again"


# --- each remaining sample once, on another number of ranks (without split_batches) ------------------------

N = 43  # not a multiple of any world size here, nor of the batch of 4
BATCH = 4
ONE_CYCLE = ("--onecycle", "22")


def batches(samples: int, ranks: int) -> int:
    """Each rank's batches of ``BATCH`` when ``samples`` are shared out over ``ranks``, padded as DistributedSampler
    pads."""
    return math.ceil(math.ceil(samples / ranks) / BATCH)


@pytest.fixture(scope="module")
def saved_by(tmp_path_factory: pytest.TempPathFactory, preloaded: Preloaded) -> dict[int, Path]:
    """Runs of 2 and of 4 ranks that stopped at steps 3 and 2 of the first of 2 epochs, each with its checkpoint.

    Their OneCycleLR is sized for 2 epochs on one process (22 steps), which every resume here stays within.
    """
    runs = {}
    for ranks, steps in ((2, 3), (4, 2)):
        out = tmp_path_factory.mktemp(f"saved-by-{ranks}")
        stop = ("--every", str(steps), "--max-steps", str(steps))
        run(preloaded, out, ranks, "--tag", "saved", *stop, "--epochs", "2", *ONE_CYCLE)
        runs[ranks] = out
    return runs


@pytest.mark.parametrize(
    ("saved_ranks", "ranks"),
    [(2, 1), (2, 3), (4, 2)],
    ids=["2-to-1", "2-to-3", "4-to-2"],
)
def test_a_mid_epoch_checkpoint_continues_on_another_number_of_ranks_training_each_remaining_sample_once(
    saved_by: dict[int, Path], preloaded: Preloaded, saved_ranks: int, ranks: int
) -> None:
    source = saved_by[saved_ranks]
    (ckpt,) = (source / "checkpoints").glob("*.ckpt")
    out = source / f"on-{ranks}"
    tag = f"on{ranks}"
    resume = ("--tag", tag, "--ckpt", str(ckpt), "--epochs", "2", "--val-every", "2", *ONE_CYCLE)
    result = run(preloaded, out, ranks, *resume, plain=ranks == 1)
    saved, resumed = lines(source, "saved"), lines(out, tag)
    saved_steps = len({r["step"] for r in saved})
    left = N - saved_steps * BATCH * saved_ranks  # the samples the saved steps did not train
    expect_once_each(N, saved, resumed, pad=first_samples(saved, saved_ranks, -left % ranks))
    # Lightning's counters: the resumed epoch takes the batch indices of the last batches of an uninterrupted epoch
    # on `ranks` ranks, so it ends there; the steps and the epochs continue; the next epoch is whole.
    epoch_batches, left_batches = batches(N, ranks), batches(left, ranks)
    indices = sorted({r["batch_idx"] for r in resumed if r["epoch"] == 0})
    assert indices == list(range(epoch_batches - left_batches, epoch_batches))
    start = report(out, "start", tag)
    assert (start["global_step"], start["epoch"], start["num_training_batches"]) == (saved_steps, 0, epoch_batches)
    assert report(out, "end", tag)["global_step"] == saved_steps + left_batches + epoch_batches
    # Epoch 1 as an uninterrupted run on `ranks` ranks trains it: DistributedSampler's permutation and padding.
    epoch1 = torch.randperm(N, generator=torch.Generator().manual_seed(1)).tolist()
    assert trained([r for r in resumed if r["epoch"] == 1]) == Counter(range(N)) + Counter(epoch1[: -N % ranks])
    # Validation every 2 batches runs where that uninterrupted run runs it: after batch indices 1, 3, 5, ...
    validated = (out / f"validated-{tag}-rank0").read_text().splitlines()
    assert [v for v in validated if v.startswith("0 ")] == [f"0 {i}" for i in indices if (i + 1) % 2 == 0]
    if ranks != saved_ranks:
        assert (
            f"the rest of the epoch trains {BATCH * ranks} samples per step (each remaining sample once). The"
            " learning rate is left as it was" in " ".join(result.stdout.split())
        )


def test_the_rest_of_the_epoch_follows_the_order_of_a_sampler_and_batch_sampler_of_the_script(
    preloaded: Preloaded, tmp_path: Path
) -> None:
    # A sampler of the script's own under a BatchSampler subclass: on 2 ranks envddp shards it with
    # DistributedSamplerWrapper; one process continuing it gets one replica of the wrapper, which yields its order.
    run(preloaded, tmp_path, 2, "--tag", "saved", "--order", "custom", "--every", "3", "--max-steps", "3")
    ckpt = str(tmp_path / "checkpoints" / "epoch=0-step=3.ckpt")
    run(preloaded, tmp_path, 1, "--tag", "alone", "--order", "custom", "--ckpt", ckpt, "--epochs", "2", plain=True)
    saved, resumed = lines(tmp_path, "saved"), lines(tmp_path, "alone")
    order = sorted(range(N), key=lambda i: (i % 3, -i))  # the script's sampler's order
    assert first_samples(saved, 2, 2 * BATCH) == order[: 2 * BATCH]
    expect_once_each(N, saved, resumed, pad=[])
    assert [i for r in resumed if r["epoch"] == 0 for i in r["indices"]] == order[3 * BATCH * 2 :]
    assert [i for r in resumed if r["epoch"] == 1 for i in r["indices"]] == order  # the next epoch is whole


# --- split_batches: the same global batches, the same weights -----------------------------------------------------

#: Two epochs of 8 global batches of 8, two to each optimizer step: 4 steps an epoch.
SPLIT = ("--split", "--samples", "64", "--batch", "8", "--accumulate", "2", "--epochs", "2")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, preloaded: Preloaded) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    run(preloaded, out, 2, "--tag", "whole", *SPLIT)
    return out


def global_batches(records: list[dict[str, Any]]) -> dict[int, set[int]]:
    """The samples of each optimizer step (its accumulated batches), over all ranks."""
    batches: dict[int, set[int]] = {}
    for record in records:
        batches.setdefault(record["step"], set()).update(record["indices"])
    return batches


def test_killed_on_two_ranks_and_restarted_on_one_a_split_batches_run_reaches_the_uninterrupted_weights(
    uninterrupted: Path, preloaded: Preloaded, tmp_path: Path
) -> None:
    # torchrun --nproc-per-node=2 with auto_resume, rank 1 killed after step 3 (the checkpoint is of step 2); then
    # the same command with --nproc-per-node=1.
    elastic = ("--auto-resume", "--every", "2", *SPLIT)
    killed = run(preloaded, tmp_path, 2, "--tag", "killed", *elastic, "--kill-at-step", "3", check=False)
    assert killed.returncode != 0
    ckpt = tmp_path / "checkpoints" / "epoch=0-step=2.ckpt"
    result = run(preloaded, tmp_path, 1, "--tag", "one", *elastic)
    assert f"envddp: auto_resume continues from {ckpt}" in result.stdout
    # The global batches after the checkpoint are the uninterrupted run's, accumulated into the same steps, to the
    # end of training: the rest of the first epoch, then the second, which one process draws from the sampler the
    # two ranks had, with one replica.
    whole = global_batches(lines(uninterrupted, "whole"))
    resumed = global_batches(lines(tmp_path, "one"))
    assert sorted(resumed) == list(range(2, 8))
    assert {step: whole[step] for step in resumed} == resumed
    difference = max_abs_difference(weights(uninterrupted, "whole"), weights(tmp_path, "one"))
    print(f"largest weight difference from the uninterrupted run: {difference:.2e}")
    assert difference <= WEIGHTS_TOLERANCE
    # The negative control: the same checkpoint, its position moved one batch on, misses that batch.
    moved = torch.load(ckpt, weights_only=False)
    (position,) = moved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    position["samples"] += 8
    torch.save(moved, tmp_path / "one-batch-off.ckpt")
    run(preloaded, tmp_path, 1, "--tag", "off", *SPLIT, "--ckpt", str(tmp_path / "one-batch-off.ckpt"), plain=True)
    assert max_abs_difference(weights(uninterrupted, "whole"), weights(tmp_path, "off")) > 100 * WEIGHTS_TOLERANCE


def test_killed_as_one_process_and_restarted_on_two_ranks_each_remaining_sample_trains_once(
    preloaded: Preloaded, tmp_path: Path
) -> None:
    # torchrun --nproc-per-node=1 (one process: the DataLoader keeps its own RandomSampler), killed after step 3 of
    # 11, then --nproc-per-node=2 with the same command: the rest of the RandomSampler's epoch, on two ranks.
    elastic = ("--auto-resume", "--every", "3", "--epochs", "2")
    killed = run(preloaded, tmp_path, 1, "--tag", "killed", *elastic, "--kill-at-step", "3", check=False)
    assert killed.returncode != 0
    result = run(preloaded, tmp_path, 2, "--tag", "two", *elastic)
    assert "continues from" in result.stdout
    saved = [r for r in lines(tmp_path, "killed") if r["step"] < 3]
    left = N - 3 * BATCH
    expect_once_each(N, saved, lines(tmp_path, "two"), pad=first_samples(saved, 1, -left % 2))
    assert report(tmp_path, "end", "two")["global_step"] == 3 + batches(left, 2) + batches(N, 2)


def test_a_schedule_sized_by_total_steps_that_the_resume_would_outrun_stops_it_before_a_sample(
    saved_by: dict[int, Path], preloaded: Preloaded
) -> None:
    # The 2-rank run's OneCycleLR has 19 of its 22 steps left; one process with 3 epochs takes 5 + 2 * 11 = 27.
    source = saved_by[2]
    ckpt = source / "checkpoints" / "epoch=0-step=3.ckpt"
    resume = ("--tag", "outrun", "--ckpt", str(ckpt), "--epochs", "3", *ONE_CYCLE)
    result = run(preloaded, source / "outrun", 1, *resume, plain=True, check=False)
    assert result.returncode != 0
    assert (
        f"CheckpointError: ckpt_path='{ckpt}': it was saved by 2 rank(s), and on 1 the rest of this fit takes 27"
        " optimizer steps, but its OneCycleLR(total_steps=22) has 19 left and would fail at step 23"
    ) in result.stdout, result.stdout[-3000:]
    assert "Fix: relaunch with 2 rank(s), or EnvDDPStrategy(split_batches=True)" in result.stdout
    assert "Trainer(max_steps=22) to end the fit where the schedule ends" in result.stdout
    assert lines(source / "outrun", "outrun") == []
