"""How a candidate of ``lightning-ddp-amp compare`` ends against the baseline: **identical** when it took the
baseline's steps with the baseline's loss at each (each ``loss_id``'s too) and ended in its weights, bit for bit;
else **close** when its final loss (each ``loss_id``'s too), its weight distance and each ``--metric`` are within
their tolerances; otherwise **apart**, with the reason, and the skipped step that explains where it left the
tolerance, when one does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_ddp_amp.commands.compare.schema import APART, CLOSE, CandidateEntry, Series, Status, Summary
from lightning_ddp_amp.commands.compare.tolerance import Metric, Tolerance


def identical(
    series: Series,
    base: Series,
    weights: dict[str, torch.Tensor],
    base_weights: dict[str, torch.Tensor],
) -> bool:
    """Whether a run trained exactly as the baseline did: the same steps and losses (a NaN loss, an overflowed step's,
    the same as a NaN), each ``loss_id``'s too (given at the same steps), the same final weights."""
    if (
        series["step"] != base["step"]
        or not _same(series["loss"], base["loss"])
        or series["loss_by_id"].keys() != base["loss_by_id"].keys()
        or not all(_same(losses, base["loss_by_id"][loss_id]) for loss_id, losses in series["loss_by_id"].items())
        or weights.keys() != base_weights.keys()
    ):
        return False
    return all(torch.equal(weights[name], base_weights[name]) for name in weights)


def _same(values: Sequence[float | None], others: Sequence[float | None]) -> bool:
    """Equal value for value, NaN equal to NaN."""
    return len(values) == len(others) and all(
        value == other or (value is not None and other is not None and math.isnan(value) and math.isnan(other))
        for value, other in zip(values, others, strict=True)
    )


def verdict(summary: Summary, tolerance: Tolerance, metrics: Sequence[Metric] = ()) -> tuple[Status, str]:
    """``close`` or ``apart``, and why: the final loss, each ``loss_id``'s, the weight distance and each
    ``--metric`` against its tolerance."""
    reasons = []
    final, distance = summary["final_loss_relative_difference"], summary["weight_distance"]
    if not _within(final, tolerance.loss):
        reasons.append(f"final loss {percent(final)} from the baseline's (tolerance {percent(tolerance.loss)})")
    apart_ids = []  # several losses per step: each one's final loss is held to the loss tolerance too
    for loss_id, loss in summary["loss_by_id"].items():
        if loss["max_relative_loss_difference"] is None:  # no step to compare: an id one run never gave
            reasons.append(f"no step where both runs gave a loss of loss_id {loss_id}")
        elif not _within(loss["final_loss_relative_difference"], tolerance.loss):
            apart_ids.append(f"loss_id {loss_id} {percent(loss['final_loss_relative_difference'])}")
    if apart_ids:
        reasons.append(
            f"final loss of {', '.join(apart_ids)} from the baseline's (tolerance {percent(tolerance.loss)})"
        )
    if not _within(distance, tolerance.weights):
        reasons.append(
            f"weights {percent(distance)} of the baseline's travel away (tolerance {percent(tolerance.weights)})"
        )
    held = []
    for metric in metrics:
        found = summary.get("metrics", {}).get(metric.name)
        if found is None or found["baseline"] is None:
            continue  # the baseline never logged it: the report's problem says so
        if found["value"] is None:
            reasons.append(f"it logged no {metric.name}")
        elif not metric.within(found["value"], found["baseline"]):
            reasons.append(
                f"{metric.name} {found['value']:.6g} against the baseline's {found['baseline']:.6g}"
                f" (tolerance {metric.tolerance_text()})"
            )
        else:
            held.append(f"{metric.name} {found['value']:.6g} against {found['baseline']:.6g}")
    if reasons:
        return APART, "; ".join(reasons)
    return CLOSE, (
        f"final loss {percent(final)} from the baseline's, weights {percent(distance)} of its travel away"
        f" (tolerances {percent(tolerance.loss)}, {percent(tolerance.weights)})" + "".join(f"; {text}" for text in held)
    )


def _within(difference: float | None, tolerance: float) -> bool:
    return difference is not None and math.isfinite(difference) and difference <= tolerance


def first_apart(series: Series, tolerance: Tolerance) -> int | None:
    """The first step whose loss is further from the baseline's than the loss tolerance, or not finite; None when no
    step is."""
    for step, difference in zip(series["step"], series["relative_loss_difference"], strict=True):
        if difference is None:
            continue
        if not math.isfinite(difference) or difference > tolerance.loss:
            return int(step)
    return None


def explain(entry: CandidateEntry, base: CandidateEntry) -> str | None:
    """Why a run leaves the tolerance where it does, when a step skipped in one run only explains it: the step apart
    itself (the skipping run's loss there is often not finite: the overflow), or the last such step before it.

    A step skipped on overflow leaves the weights as they were and holds the LR schedule back one step, so from there
    the two runs train out of phase: a difference that is not the precision's rounding.
    """
    summary, base_summary = entry["summary"], base["summary"]
    series, base_series = entry["series"], base["series"]
    assert summary is not None and base_summary is not None and series is not None and base_series is not None
    first = summary["first_step_apart"]
    if first is None:
        return None
    ours, theirs = set(summary["skipped_steps"]), set(base_summary["skipped_steps"])
    alone = sorted(step for step in ours ^ theirs if step <= first)
    if not alone:
        return None
    step = alone[-1]
    who, other = ("this run", "the baseline") if step in ours else ("the baseline", "this run")
    if step == first:
        skipping = series if step in ours else base_series
        at = skipping["step"].index(step)
        scale, loss = skipping["loss_scale"][at], skipping["loss"][at]
        details = ([] if scale is None else [f"loss scale {scale:g}"]) + (
            [] if math.isfinite(loss) else ["its loss not finite"]
        )
        which = f" ({', '.join(details)})" if details else ""
        said = (
            f"it leaves the tolerance at step {first}, which {who} alone skipped on overflow{which} and {other} trained"
        )
    else:
        said = f"it leaves the tolerance at step {first}, after step {step}, which {who} alone skipped on overflow"
    said += (
        ": a skipped step keeps the weights and holds the LR schedule back, so the runs train out of phase from there"
    )
    shift = _lr_shift(series, base_series, after=step)
    if shift:
        said += f"; its LR schedule runs {abs(shift)} step(s) {'behind' if shift > 0 else 'ahead of'} the baseline's"
    return said


def _lr_shift(series: Series, base: Series, after: int) -> int:
    """How many steps this run's LR lags the baseline's after step ``after`` (negative: leads); 0 when it does not,
    or when the LR does not change there."""
    ours = {step: lr for step, lr in zip(series["step"], series["lr"], strict=True) if step > after}
    theirs = dict(zip(base["step"], base["lr"], strict=True))
    if len(set(ours.values())) < 2:
        return 0
    for shift in (1, -1, 2, -2, 3, -3):
        pairs = [(lr, theirs[step - shift]) for step, lr in ours.items() if step - shift in theirs]
        if len(pairs) >= 2 and all(a == b for a, b in pairs) and any(ours[s] != theirs.get(s) for s in ours):
            return shift
    return 0


def percent(value: float | None) -> str:
    """A fraction as the report says it: ``0.0123`` is ``"1.23%"``; None or not finite is ``"not finite"``."""
    if value is None or not math.isfinite(value):
        return "not finite"
    return f"{100 * value:.3g}%"
