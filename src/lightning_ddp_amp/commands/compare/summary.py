"""The numbers of ``lightning-ddp-amp compare``: how far one run is from the baseline, and the spread of the timings.

Definitions (``docs/compare.md`` explains how to read them):

* The loss of a step is the mean over ranks of what each rank gave to backward since its previous step.
* The *relative loss difference* of a step is ``|loss - baseline loss| / |baseline loss|``, over the steps both
  runs took. The *final loss* is the mean over the last tenth of those steps (at least one). With several
  ``loss_id`` (apex's ``num_losses``), each one's loss has the same numbers, over the steps where both runs gave it.
* The *weight distance* is ``‖w - w_baseline‖ / ‖w_baseline - w_start‖``: how far the candidate's final weights are
  from the baseline's, as a fraction of how far the baseline moved from the common start. It is 1 for a candidate
  that never moved (every step skipped), and about 0.1 for the same precision at a learning rate 10% off. Per
  submodule (the module that holds each parameter) the same ratio uses that submodule's own weights. Each run's
  recording measures it along the run too, at the snapshots.
* The *noise floor* (``--noise-floor``) is the baseline run again with every initial weight one ulp up: the
  distances of a run that differs by nothing that matters, beside which every candidate's are read.
* Step times leave out each run's first step (warm-up) and the steps slowed by rank 0 measuring weight distances;
  their *spread* is half the baseline's interquartile range over its median, or, when wider, how far the noise-floor
  run's median is from the baseline's. A step-time ratio within ``1 ± spread`` is not called faster or slower; the
  memory spread is how far the noise-floor run's peak is from the baseline's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

import torch

from lightning_ddp_amp.commands.compare.schema import (
    ABOVE,
    BELOW,
    WITHIN_THE_SPREAD,
    Call,
    CandidateEntry,
    Evaluation,
    LossSummary,
    MetricSummary,
    NoiseFloor,
    Overflow,
    ScaleTrend,
    Series,
    Spread,
    Stage,
    StepTimes,
    SubmoduleDistance,
    Summary,
)

#: A loss scale below this means the model overflows fp16 with its loss unscaled: not a rounding question.
MODEL_PROBLEM_SCALE = 1.0
#: The fewest timed steps (the first and the snapshot-slowed left out) whose quartiles make a step-time spread.
MIN_TIMED_STEPS = 4


def summarize(
    entry: CandidateEntry,
    base_entry: CandidateEntry,
    weights: dict[str, torch.Tensor],
    base_weights: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
) -> Summary:
    """A recorded run's numbers against the baseline's; sets the differences and the final distance in its series.

    The verdict's parts (``first_step_apart``, ``explanation``, the calls against the spread) are left for the report.
    """
    series, base = entry["series"], base_entry["series"]
    assert series is not None and base is not None
    loss, by_step = _loss(series["step"], series["loss"], base["step"], base["loss"])
    series["relative_loss_difference"] = [by_step.get(step) for step in series["step"]]
    skipped = [step for step, flag in zip(series["step"], series["skipped"], strict=True) if flag]
    submodules = _submodule_distances(weights, base_weights, start)
    distance = weight_distance(weights, base_weights, start)
    if series["step"]:
        series["weight_distance"].append([series["step"][-1] + 1, distance])
    times, base_times = step_times(series), step_times(base)
    memory = entry["peak_memory_bytes"]
    return {
        "final_loss": loss["final_loss"],
        "final_loss_relative_difference": loss["final_loss_relative_difference"],
        "max_relative_loss_difference": loss["max_relative_loss_difference"],
        "mean_relative_loss_difference": loss["mean_relative_loss_difference"],
        "loss_by_id": _loss_by_id(series, base),
        "first_step_apart": None,
        "explanation": None,
        "weight_distance": distance,
        "submodule_distances": sorted(submodules, key=lambda s: -_order(s["distance"]))[:3],
        "metrics": _metrics(entry["evaluations"], base_entry["evaluations"]),
        "skipped_steps": skipped,
        "final_loss_scale": series["loss_scale"][-1] if series["loss_scale"] else None,
        "scale_trend": _scale_trend(series, entry["overflows"]),
        "step_time_s": times,
        "median_step_time_s": times["median"] if times else None,
        "step_time_ratio": _ratio(times["median"], base_times["median"]) if times and base_times else None,
        "step_time_call": None,
        "peak_memory_bytes": memory,
        "peak_memory_ratio": _ratio(memory, base_entry["peak_memory_bytes"]),
        "peak_memory_call": None,
    }


def _loss(
    steps: list[int], losses: Sequence[float | None], base_steps: list[int], base_losses: Sequence[float | None]
) -> tuple[LossSummary, dict[int, float | None]]:
    """A loss against the baseline's over the steps where both runs have one (a None is none): its final loss (the
    mean of the last tenth of those steps, at least one) and the relative differences, each step's as well."""
    ours = {step: loss for step, loss in zip(steps, losses, strict=True) if loss is not None}
    theirs = {step: loss for step, loss in zip(base_steps, base_losses, strict=True) if loss is not None}
    common = [step for step in theirs if step in ours]  # in the baseline's order
    by_step = {step: _relative(ours[step], theirs[step]) for step in common}
    differences = [difference for difference in by_step.values() if difference is not None]
    tail = common[-max(1, len(common) // 10) :]
    final, base_final = _mean([ours[step] for step in tail]), _mean([theirs[step] for step in tail])
    return {
        "final_loss": final,
        "final_loss_relative_difference": _relative(final, base_final),
        "max_relative_loss_difference": max(differences, default=None),
        "mean_relative_loss_difference": _mean(differences) if differences else None,
    }, by_step


def _loss_by_id(series: Series, base: Series) -> dict[str, LossSummary]:
    """Each ``loss_id``'s loss against the baseline's, for runs that gave several; an id only one run gave has no
    step to compare (its final loss is NaN, its differences None)."""
    found: dict[str, LossSummary] = {}
    for loss_id in sorted(series["loss_by_id"].keys() | base["loss_by_id"].keys(), key=int):
        ours = series["loss_by_id"].get(loss_id, [None] * len(series["step"]))
        theirs = base["loss_by_id"].get(loss_id, [None] * len(base["step"]))
        found[loss_id] = _loss(series["step"], ours, base["step"], theirs)[0]
    return found


def weight_distance(
    weights: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor],
    names: Iterable[str] | None = None,
) -> float | None:
    """``‖w - w_baseline‖ / ‖w_baseline - w_start‖`` over ``names`` (default: all); None when none are shared."""
    names = [name for name in (weights if names is None else names) if name in base and name in start]
    if not names:
        return None
    apart = math.sqrt(sum(float((weights[n] - base[n]).double().square().sum()) for n in names))
    travel = math.sqrt(sum(float((base[n] - start[n]).double().square().sum()) for n in names))
    if travel == 0:
        return 0.0 if apart == 0 else math.inf
    return apart / travel


def timed_steps(series: Series) -> list[tuple[int, float | None]]:
    """``(step, step time)`` without the first step (warm-up) and the steps slowed by rank 0 measuring weight
    distances: what the step-time statistics and the picture use."""
    slowed = set(series["slowed_steps"])
    pairs = zip(series["step"], series["step_time_s"], strict=True)
    return [(step, t) for index, (step, t) in enumerate(pairs) if index and step not in slowed]


def step_times(series: Series) -> StepTimes | None:
    """Median and quartiles of :func:`timed_steps` (all steps when that leaves none); None without a finite time."""
    times = [t for _, t in timed_steps(series) if t is not None and math.isfinite(t)] or [
        t for t in series["step_time_s"] if t is not None and math.isfinite(t)
    ]
    if not times:
        return None
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median": statistics.median(times), "p25": quartiles[0], "p75": quartiles[2]}


def last_values(evaluations: list[Evaluation]) -> dict[str, tuple[float, Stage]]:
    """Each metric's value in the last validation or test run that logged it, and that run's stage."""
    values: dict[str, tuple[float, Stage]] = {}
    for evaluation in evaluations:
        for name, value in evaluation["metrics"].items():
            values[name] = (value, evaluation["stage"])
    return values


def _metrics(evaluations: list[Evaluation], base: list[Evaluation]) -> dict[str, MetricSummary]:
    """Each metric's last value (from the last validation or test run that logged it) beside the baseline's."""
    ours, theirs = last_values(evaluations), last_values(base)
    found: dict[str, MetricSummary] = {}
    for name in sorted(ours.keys() | theirs.keys()):
        value, stage = ours[name] if name in ours else (None, theirs[name][1])
        baseline = theirs[name][0] if name in theirs else None
        found[name] = {
            "stage": stage,
            "value": value,
            "baseline": baseline,
            "difference": None if value is None or baseline is None else value - baseline,
            "relative_difference": _relative(value, baseline),
        }
    return found


def _scale_trend(series: Series, overflows: list[Overflow]) -> ScaleTrend | None:
    """How the loss scale fared after overflows: whether training went on, and whether the model is the problem."""
    skipped = [step for step, flag in zip(series["step"], series["skipped"], strict=True) if flag]
    if not skipped and not overflows:
        return None
    scales = [(step, s) for step, s in zip(series["step"], series["loss_scale"], strict=True) if s is not None]
    lowest = min(scales, key=lambda pair: pair[1], default=None)
    taken_after = [
        step for step, flag in zip(series["step"], series["skipped"], strict=True) if not flag and step > max(skipped)
    ] if skipped else []  # fmt: skip
    recovered = bool(skipped) and bool(taken_after)
    tail = series["skipped"][-3:]
    model_problem = (lowest is not None and lowest[1] < MODEL_PROBLEM_SCALE) or (len(tail) == 3 and all(tail))
    located = next((o for o in reversed(overflows) if o["module"] is not None), None)
    advice = None
    if model_problem:
        where = (
            f"{located['module']} ({located['phase']}: {located['tensor']}, {located['dtype']})"
            if located
            else "an unlocated module"
        )
        fell = f"to {lowest[1]:g} at step {lowest[0]}" if lowest else "on every step at the end"
        advice = (
            f"the loss scale kept falling ({fell}): a model problem, not fp16's rounding: {where} overflows even with"
            " the loss unscaled. Fix: keep that module in fp32 (torch AMP: run it under"
            " torch.autocast(device_type, enabled=False) on .float() inputs; apex O1: amp.register_float_function),"
            " look for weights or activations that grow (learning rate, missing normalization), or train in"
            " bf16-mixed (fp32's range, no loss scale)"
        )
    return {
        "lowest_loss_scale": None if lowest is None else lowest[1],
        "lowest_at_step": None if lowest is None else lowest[0],
        "recovered": recovered,
        "model_problem": model_problem,
        "advice": advice,
    }


def noise_floor(noise: CandidateEntry) -> NoiseFloor:
    """The distances of the noise-floor run, said beside every candidate's."""
    summary, series = noise["summary"], noise["series"]
    assert summary is not None and series is not None
    return {
        "candidate": noise["name"],
        "weight_distance": summary["weight_distance"],
        "weight_distances": series["weight_distance"],
        "final_loss_relative_difference": summary["final_loss_relative_difference"],
        "max_relative_loss_difference": summary["max_relative_loss_difference"],
        "step_time_ratio": summary["step_time_ratio"],
        "peak_memory_ratio": summary["peak_memory_ratio"],
    }


def spread(base: CandidateEntry, noise: CandidateEntry | None) -> Spread:
    """How much step time and peak memory move with nothing changed (module docstring)."""
    assert base["summary"] is not None and base["series"] is not None
    times = base["summary"]["step_time_s"]
    timed = sum(1 for _, t in timed_steps(base["series"]) if t is not None and math.isfinite(t))
    over_steps = None  # fewer timed steps have no spread to speak of: no ratio is called faster or slower on them
    if times and times["median"] and timed >= MIN_TIMED_STEPS:
        over_steps = (times["p75"] - times["p25"]) / (2 * times["median"])
    between_time = between_memory = None
    if noise is not None:
        assert noise["summary"] is not None
        ratio, memory = noise["summary"]["step_time_ratio"], noise["summary"]["peak_memory_ratio"]
        between_time = None if ratio is None else abs(ratio - 1)
        between_memory = None if memory is None else abs(memory - 1)
    step_time = max((v for v in (over_steps, between_time) if v is not None), default=None)
    return {
        "step_time": step_time,
        "step_time_over_steps": over_steps,
        "step_time_between_baseline_runs": between_time,
        "peak_memory": between_memory,
    }


def call(ratio: float | None, width: float | None) -> Call | None:
    """Whether a ratio is above or below ``1 ± width`` (a spread), or within it; None without either."""
    if ratio is None or width is None:
        return None
    if ratio > 1 + width:
        return ABOVE
    if ratio < 1 - width:
        return BELOW
    return WITHIN_THE_SPREAD


def _submodule_distances(
    weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> list[SubmoduleDistance]:
    groups: dict[str, list[str]] = {}
    for name in weights:
        groups.setdefault(name.rpartition(".")[0] or name, []).append(name)
    return [
        {"name": module, "distance": weight_distance(weights, base, start, names)} for module, names in groups.items()
    ]


def _relative(value: float | None, reference: float | None) -> float | None:
    """``|value - reference| / |reference|``; infinite where either is not finite, None where either is None."""
    if value is None or reference is None:
        return None
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    if reference == 0:
        return 0.0 if value == 0 else math.inf
    return abs(value - reference) / abs(reference)


def _ratio(value: float, reference: float) -> float | None:
    return value / reference if reference else None


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def _order(value: float | None) -> float:
    return -1.0 if value is None else math.inf if math.isnan(value) else value
