"""The terminal report of ``lightning-ddp-amp compare``: one block per run, every line within :data:`WIDTH` columns.

The long rows (per-submodule distances, per-step series, the changes made to each Trainer) are in ``compare.json``
only; the terminal names the verdicts and the numbers they rest on.
"""

from __future__ import annotations

import textwrap
from typing import Any

from lightning_ddp_amp.compare.report import percent

#: The widest line the report prints.
WIDTH = 100
#: The label column of a block.
LABEL = 18


def render(report: dict[str, Any]) -> str:
    """The report as the terminal shows it (see the module docstring)."""
    entries = report["candidates"]
    lines = [
        "",
        *_wrap(
            f"compare: {len(entries)} runs of {_steps_run(report)}, baseline {report['baseline']},"
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
            if entry["status"] == "failed":
                lines += _wrap(f"  {entry['name']}: FAILED: {entry['reason']}{_crashed_at(entry)}", "    ")
        lines += _wrap(f"NOT COMPARED: {report['problem']}", "  ")
        return "\n".join(lines)
    lines += _context(report)
    for entry in entries:
        lines.append("")
        lines += _block(entry, report)
    lines.append("")
    for entry in entries:
        if entry["status"] in ("identical", "close", "apart"):
            lines += _wrap(f"{entry['name']}: {entry['status'].upper()}: {entry['reason']}", "  ")
        elif entry["status"] == "failed":
            lines += _wrap(f"{entry['name']}: FAILED: {entry['reason']}{_crashed_at(entry)}", "  ")
    if report["problem"]:
        lines += _wrap(f"PROBLEM: {report['problem']}", "  ")
    return "\n".join(lines)


def _steps_run(report: dict[str, Any]) -> str:
    """How many steps the runs that finished took, beside ``--steps`` where the script stopped them sooner."""
    taken = sorted({len(e["series"]["step"]) for e in report["candidates"] if e["series"] and e["status"] != "failed"})
    if not taken or taken == [report["steps"]]:
        return f"{report['steps']} steps"
    counted = f"{taken[0]} steps" if len(taken) == 1 else f"{taken[0]} to {taken[-1]} steps"
    return f"{counted} (--steps {report['steps']}; the script's max_steps or max_epochs stopped them sooner)"


def _context(report: dict[str, Any]) -> list[str]:
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
    spread = report.get("spread") or {}
    if spread.get("step_time") is not None:
        between = spread.get("step_time_between_baseline_runs")
        memory = spread.get("peak_memory")
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


def _block(entry: dict[str, Any], report: dict[str, Any]) -> list[str]:
    status = {"baseline": "BASELINE", "noise floor": "NOISE FLOOR"}.get(entry["status"], entry["status"].upper())
    lines = [f"{entry['name']}  {status}"]
    summary = entry["summary"]
    if summary is None:
        if entry["series"]:
            lines.append(_row("steps", f"{len(entry['series']['step'])} taken before it failed"))
        return lines
    lines.append(_row("ran as", f"{entry['ran_as']}, {_steps(entry)}"))
    loss = f"{summary['final_loss']:.6g}"
    if entry["status"] != "baseline":
        loss += (
            f" ({percent(summary['final_loss_relative_difference'])} from the baseline's; per step max"
            f" {percent(summary['max_relative_loss_difference'])}, mean"
            f" {percent(summary['mean_relative_loss_difference'])})"
        )
    lines.append(_row("final loss", loss))
    if entry["status"] != "baseline":
        noise = report.get("noise_floor")
        floor = f"; noise floor {percent(noise['weight_distance'])}" if noise and entry["role"] != "noise floor" else ""
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
        lines.append(_row(name, _metric(metric, entry["status"] == "baseline")))
    lines.append(_row("skipped steps", _skips(summary)))
    for overflow in entry["overflows"][:3]:
        lines += _wrap(_row("overflow", _overflow(overflow)), " " * (LABEL + 2))
    if len(entry["overflows"]) > 3:
        lines.append(_row("", f"... {len(entry['overflows']) - 3} more in compare.json"))
    lines.append(_row("step time", _time(summary, entry["status"] == "baseline")))
    lines.append(_row("peak memory", _memory(summary, entry["status"] == "baseline")))
    return [line for text in lines for line in _wrap(text, " " * (LABEL + 2))]


def _row(label: str, text: str) -> str:
    return f"  {label:<{LABEL - 1}} {text}"  # a metric's name may be longer than the column: a space still follows


def _steps(entry: dict[str, Any]) -> str:
    steps = entry["series"]["step"]
    text = f"{len(steps)} steps" + (f" from step {steps[0]}" if steps and steps[0] else "")
    return text + (f", after {entry['restarts']} restart(s)" if entry["restarts"] else "")


def _metric(metric: dict[str, Any], baseline: bool) -> str:
    stage = f" ({metric['stage']})"
    if metric["value"] is None:
        return f"not logged{stage}"
    if baseline or metric["baseline"] is None:
        return f"{metric['value']:.6g}{stage}"
    return f"{metric['value']:.6g}, baseline {metric['baseline']:.6g}, difference {metric['difference']:+.3g}{stage}"


def _skips(summary: dict[str, Any]) -> str:
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


def _overflow(overflow: dict[str, Any]) -> str:
    where = f"step {overflow['step']}"
    if overflow["module"] is None:
        return f"{where}: {overflow['phase']}: {overflow['note']}"
    largest = "" if overflow["max_finite"] is None else f", largest finite {overflow['max_finite']:.3g}"
    if overflow["phase"] == "loss":
        return f"{where}: the {overflow['tensor']} is not finite ({overflow['dtype']}{largest})"
    return f"{where}: {overflow['module']}, {overflow['phase']} ({overflow['tensor']}, {overflow['dtype']}{largest})"


def _time(summary: dict[str, Any], baseline: bool) -> str:
    times = summary["step_time_s"]
    if not times:
        return "-"
    text = (
        f"{times['median'] * 1000:.3g} ms median ({times['p25'] * 1000:.3g}-{times['p75'] * 1000:.3g} ms middle half)"
    )
    if not baseline and summary["step_time_ratio"]:
        call = {"above": "slower", "below": "faster"}.get(summary["step_time_call"] or "", "not faster or slower")
        text += f", x{summary['step_time_ratio']:.2f}: {call}"
    return text


def _memory(summary: dict[str, Any], baseline: bool) -> str:
    text = f"{summary['peak_memory_bytes'] / 2**20:.0f} MiB"
    if not baseline and summary["peak_memory_ratio"]:
        call = {"above": "more", "below": "less", "within the spread": "the same within the spread"}.get(
            summary["peak_memory_call"] or "", "spread unknown"
        )
        text += f", x{summary['peak_memory_ratio']:.3f} ({call})"
    return text


def _crashed_at(entry: dict[str, Any]) -> str:
    steps = (entry.get("series") or {}).get("step") or []
    plural = "" if len(steps) == 1 else "s"
    return f" (after {len(steps)} step{plural}, kept in compare.json)" if steps else ""


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [""]
