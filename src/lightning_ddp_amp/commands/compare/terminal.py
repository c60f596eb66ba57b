"""The terminal report of ``lightning-ddp-amp compare``: one block per run, every line within :data:`WIDTH` columns.

The long rows (per-submodule distances, per-step series, the changes made to each Trainer) are in ``compare.json``
only; the terminal names the verdicts and the numbers they rest on.
"""

from __future__ import annotations

import textwrap

from lightning_ddp_amp.commands.compare.schema import (
    ABOVE,
    APART,
    BASELINE,
    BELOW,
    CLOSE,
    FAILED,
    IDENTICAL,
    LOSS,
    NOISE_FLOOR,
    WITHIN_THE_SPREAD,
    Call,
    CandidateEntry,
    LossSummary,
    MetricSummary,
    Overflow,
    Report,
    Series,
    Summary,
)
from lightning_ddp_amp.commands.compare.verdict import percent

#: The widest line the report prints.
WIDTH = 100
#: The label column of a block.
LABEL = 18
#: How a candidate's step time is said against the baseline's, by its call (None: no spread to call it against).
TIME_SAID: dict[Call | None, str] = {
    ABOVE: "slower",
    BELOW: "faster",
    WITHIN_THE_SPREAD: "not faster or slower",
    None: "not faster or slower",
}
#: How its peak memory is said.
MEMORY_SAID: dict[Call | None, str] = {
    ABOVE: "more",
    BELOW: "less",
    WITHIN_THE_SPREAD: "the same within the spread",
    None: "spread unknown",
}


def render(report: Report) -> str:
    """The report as the terminal shows it (see the module docstring)."""
    entries = report["candidates"]
    runs = f"{len(entries)} run" + ("" if len(entries) == 1 else "s")
    steps = _steps_run(report)
    lines = [
        "",
        *_wrap(
            f"compare: {runs}{'' if steps is None else f' of {steps}'}, baseline {report['baseline']},"
            f" on {report.get('hardware', 'this machine')}"
        ),
    ]
    for entry in entries:
        if entry["turned_off"]:
            lines += _wrap(
                f"  {entry['name']}: turned off {', '.join(entry['turned_off'])} (it cannot write into the run's"
                " folder)",
                "    ",
            )
    if not report["comparable"]:
        for entry in entries:
            if entry["status"] == FAILED:
                lines += _wrap(f"  {entry['name']}: FAILED: {entry['reason']}{_crashed_at(entry)}", "    ")
        lines += _wrap(f"NOT COMPARED: {report['problem']}", "  ")
        return "\n".join(lines)
    lines += _context(report)
    for entry in entries:
        lines.append("")
        lines += _block(entry, report)
    lines.append("")
    for entry in entries:
        if entry["status"] in (IDENTICAL, CLOSE, APART):
            lines += _wrap(f"{entry['name']}: {entry['status'].upper()}: {entry['reason']}", "  ")
        elif entry["status"] == FAILED:
            lines += _wrap(f"{entry['name']}: FAILED: {entry['reason']}{_crashed_at(entry)}", "  ")
    if report["problem"]:
        lines += _wrap(f"PROBLEM: {report['problem']}", "  ")
    return "\n".join(lines)


def _steps_run(report: Report) -> str | None:
    """How many steps the runs that finished took, beside ``--steps`` where the script stopped them sooner; None when
    none finished."""
    series = [e["series"] for e in report["candidates"] if e["status"] != FAILED]
    taken = sorted({len(each["step"]) for each in series if each})
    if not taken:
        return None
    if taken == [report["steps"]]:
        return f"{report['steps']} steps"
    counted = f"{taken[0]} steps" if len(taken) == 1 else f"{taken[0]} to {taken[-1]} steps"
    return f"{counted} (--steps {report['steps']}; the script's max_steps or max_epochs stopped them sooner)"


def _context(report: Report) -> list[str]:
    """The noise floor and the spread, said once above the blocks."""
    lines = []
    noise = report.get("noise_floor")
    if noise:
        lines += _wrap(
            f"  noise floor ({noise['candidate']}: the baseline again, every initial weight one ulp up): weights"
            f" {percent(noise['weight_distance'])} of the baseline's travel, final loss"
            f" {percent(noise['final_loss_relative_difference'])}",
            "    ",
        )
    spread = report.get("spread")
    if spread and spread["step_time"] is not None:
        between, memory = spread["step_time_between_baseline_runs"], spread["peak_memory"]
        lines += _wrap(
            f"  spread: step time ±{percent(spread['step_time'])}"
            + (
                f" (±{percent(between)} between the baseline's two runs)"
                if between is not None
                else " (over the baseline's steps)"
            )
            + (f", peak memory ±{percent(memory)}" if memory is not None else ", peak memory: run with --noise-floor"),
            "    ",
        )
    return lines


def _block(entry: CandidateEntry, report: Report) -> list[str]:
    lines = [f"{entry['name']}  {entry['status'].upper()}"]
    summary, series = entry["summary"], entry["series"]
    if summary is None or series is None:  # a compared run has both
        if series:
            lines.append(_row("steps", f"{len(series['step'])} taken before it failed"))
        return lines
    lines.append(_row("ran as", f"{entry['ran_as']}, {_steps(series, entry['restarts'])}"))
    lines.append(_row("final loss", _loss(summary, entry["status"] == BASELINE)))
    for loss_id, loss in summary["loss_by_id"].items():  # several losses per step: each one's below their sum's
        said = "no step where both runs gave it" if loss["max_relative_loss_difference"] is None else None
        lines.append(_row(f"  loss_id {loss_id}", said or _loss(loss, entry["status"] == BASELINE)))
    if entry["status"] != BASELINE:
        noise = report.get("noise_floor")
        floor = f"; noise floor {percent(noise['weight_distance'])}" if noise and entry["role"] != NOISE_FLOOR else ""
        lines.append(
            _row(
                "weights",
                f"{percent(summary['weight_distance'])} of the baseline's travel away"
                f" (tolerance {percent(report['tolerance']['weights'])}{floor})",
            )
        )
        if summary["first_step_apart"] is not None:
            lines.append(_row("first step apart", str(summary["first_step_apart"])))
    for name, metric in summary["metrics"].items():
        lines.append(_row(name, _metric(metric, entry["status"] == BASELINE)))
    lines.append(_row("skipped steps", _skips(summary)))
    for overflow in entry["overflows"][:3]:
        lines += _wrap(_row("overflow", _overflow(overflow)), " " * (LABEL + 2))
    if len(entry["overflows"]) > 3:
        lines.append(_row("", f"... {len(entry['overflows']) - 3} more in compare.json"))
    lines.append(_row("step time", _time(summary, entry["status"] == BASELINE)))
    lines.append(_row("peak memory", _memory(summary, entry["status"] == BASELINE)))
    return [line for text in lines for line in _wrap(text, " " * (LABEL + 2))]


def _row(label: str, text: str) -> str:
    return f"  {label:<{LABEL - 1}} {text}"  # a metric's name may be longer than the column: a space still follows


def _loss(loss: Summary | LossSummary, baseline: bool) -> str:
    """A final loss, and against the baseline's: its difference and the per-step differences' max and mean."""
    text = f"{loss['final_loss']:.6g}"
    if baseline:
        return text
    return (
        f"{text} ({percent(loss['final_loss_relative_difference'])} from the baseline's; per step max"
        f" {percent(loss['max_relative_loss_difference'])}, mean {percent(loss['mean_relative_loss_difference'])})"
    )


def _steps(series: Series, restarts: int | None) -> str:
    steps = series["step"]
    text = f"{len(steps)} steps" + (f" from step {steps[0]}" if steps and steps[0] else "")
    return text + (f", after {restarts} restart(s)" if restarts else "")


def _metric(metric: MetricSummary, baseline: bool) -> str:
    stage = f" ({metric['stage']})"
    if metric["value"] is None:
        return f"not logged{stage}"
    if baseline or metric["baseline"] is None:
        return f"{metric['value']:.6g}{stage}"
    return f"{metric['value']:.6g}, baseline {metric['baseline']:.6g}, difference {metric['difference']:+.3g}{stage}"


def _skips(summary: Summary) -> str:
    steps = summary["skipped_steps"]
    scale = summary["final_loss_scale"]
    text = "0" if not steps else f"{len(steps)} ({', '.join(map(str, steps[:5]))}{', ...' if len(steps) > 5 else ''})"
    if scale is not None:
        text += f"; loss scale {scale:g} at the end"
    trend = summary["scale_trend"]
    if trend and steps:
        text += "; it recovered" if trend["recovered"] and not trend["model_problem"] else "; it did not recover"
    if trend and trend["model_problem"]:
        text += " (a model problem: see below)"
    return text


def _overflow(overflow: Overflow) -> str:
    where = f"step {overflow['step']}"
    if overflow["module"] is None:
        return f"{where}: {overflow['phase']}: {overflow['note']}"
    largest = "" if overflow["max_finite"] is None else f", largest finite {overflow['max_finite']:.3g}"
    if overflow["phase"] == LOSS:
        return f"{where}: the {overflow['tensor']} is not finite ({overflow['dtype']}{largest})"
    return f"{where}: {overflow['module']}, {overflow['phase']} ({overflow['tensor']}, {overflow['dtype']}{largest})"


def _time(summary: Summary, baseline: bool) -> str:
    times = summary["step_time_s"]
    if not times:
        return "-"
    text = (
        f"{times['median'] * 1000:.3g} ms median ({times['p25'] * 1000:.3g}-{times['p75'] * 1000:.3g} ms middle half)"
    )
    if not baseline and summary["step_time_ratio"]:
        text += f", x{summary['step_time_ratio']:.2f}: {TIME_SAID[summary['step_time_call']]}"
    return text


def _memory(summary: Summary, baseline: bool) -> str:
    text = f"{summary['peak_memory_bytes'] / 2**20:.0f} MiB"
    if not baseline and summary["peak_memory_ratio"]:
        text += f", x{summary['peak_memory_ratio']:.3f} ({MEMORY_SAID[summary['peak_memory_call']]})"
    return text


def _crashed_at(entry: CandidateEntry) -> str:
    series = entry["series"]
    steps = series["step"] if series else []
    plural = "" if len(steps) == 1 else "s"
    return f" (after {len(steps)} step{plural}, kept in compare.json)" if steps else ""


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [""]
