"""The shape of ``compare.json``: one ``TypedDict`` per object of ``docs/compare.schema.json``, one ``Literal`` per
closed set of its strings, and a name for each of those strings.

The report builds these (:mod:`~lightning_ddp_amp.commands.compare.report`), the terminal and the picture read them
(:mod:`~lightning_ddp_amp.commands.compare.terminal`, :mod:`~lightning_ddp_amp.commands.compare.picture`); a status or role is written
here once and named everywhere else. ``tests/test_compare.py`` checks each key and each ``Literal`` against the JSON
schema. In memory a number the file holds as ``null`` may still be a float that is not finite: the report writes
those as ``null``.

Without ``from __future__ import annotations``: ``NotRequired`` is read when each class is built, for
``__required_keys__``.
"""

from typing import Final, Literal

from typing_extensions import NotRequired, TypedDict

#: The ``schema`` value, which changes when a key changes meaning.
SchemaName = Literal["lightning-ddp-amp/compare/1"]
SCHEMA: Final[SchemaName] = "lightning-ddp-amp/compare/1"

#: A run's part: the first run, the one every other is held to; a precision compared with it; the baseline again,
#: every initial weight one ulp up (``--noise-floor``).
Role = Literal["baseline", "candidate", "noise floor"]
#: How a run ended against the baseline. A role's own status for the baseline and the noise floor; else the
#: verdict; ``failed``; or ``not compared`` (the baseline failed, or the runs did not start alike).
Status = Literal["baseline", "noise floor", "identical", "close", "apart", "failed", "not compared"]
BASELINE: Final = "baseline"  # a role and a status
NOISE_FLOOR: Final = "noise floor"  # a role and a status
CANDIDATE: Final[Role] = "candidate"
IDENTICAL: Final[Status] = "identical"
CLOSE: Final[Status] = "close"
APART: Final[Status] = "apart"
FAILED: Final[Status] = "failed"
NOT_COMPARED: Final[Status] = "not compared"

#: A step-time or peak-memory ratio against ``1 ± spread``: more than ``1 + spread``, less than ``1 - spread``, or
#: neither.
Call = Literal["above", "below", "within the spread"]
ABOVE: Final[Call] = "above"
BELOW: Final[Call] = "below"
WITHIN_THE_SPREAD: Final[Call] = "within the spread"

#: The loop an evaluation ran in: validation (during ``fit`` or ``trainer.validate``), ``trainer.test``, or a kept
#: loop's ``fabric.log`` / ``log_dict`` at a step.
Stage = Literal["validate", "test", "logged"]
VALIDATE: Final[Stage] = "validate"
TEST: Final[Stage] = "test"
LOGGED: Final[Stage] = "logged"

#: Where an overflow was found when its step's batch was trained again (:mod:`~lightning_ddp_amp.commands.compare.overflow`).
Phase = Literal["forward", "backward", "loss", "not reproduced", "not re-run"]
FORWARD: Final[Phase] = "forward"
BACKWARD: Final[Phase] = "backward"
LOSS: Final[Phase] = "loss"
NOT_REPRODUCED: Final[Phase] = "not reproduced"
NOT_RE_RUN: Final[Phase] = "not re-run"

#: What ``peak_memory_bytes`` measures: CUDA's peak allocated, or the process's peak resident set.
MemoryKind = Literal["cuda_max_memory_allocated", "process_max_rss"]
CUDA_MAX_MEMORY_ALLOCATED: Final[MemoryKind] = "cuda_max_memory_allocated"
PROCESS_MAX_RSS: Final[MemoryKind] = "process_max_rss"


class Tolerances(TypedDict):
    loss: float
    weights: float


class MetricOption(TypedDict):
    """A ``--metric``: its name and its tolerance as given (``0.005`` or ``1%``)."""

    name: str
    tolerance: str


class Versions(TypedDict):
    python: str
    torch: str
    lightning: str | None
    pytorch_lightning: str | None
    lightning_ddp_amp: str | None
    apex: str | None


class Apex(TypedDict):
    location: str
    version: str
    test_double: bool


class NoiseFloor(TypedDict):
    candidate: str
    weight_distance: float | None
    weight_distances: list[list[float | None]]
    final_loss_relative_difference: float | None
    max_relative_loss_difference: float | None
    step_time_ratio: float | None
    peak_memory_ratio: float | None


class Spread(TypedDict):
    step_time: float | None
    step_time_over_steps: float | None
    step_time_between_baseline_runs: float | None
    peak_memory: float | None


class Series(TypedDict):
    """Per step; ``weight_distance`` as ``[steps done, distance]`` pairs; ``loss_by_id`` each ``loss_id``'s loss when
    the run gave several (empty with one), None at a step that gave none of that id."""

    step: list[int]
    loss: list[float]
    loss_by_rank: list[list[float]]
    loss_by_id: dict[str, list[float | None]]
    skipped: list[bool]
    loss_scale: list[float | None]
    grad_norm: list[float | None]  #: None at a step it was not measured at (--grad-norm-every)
    lr: list[float]
    step_time_s: list[float]
    relative_loss_difference: list[float | None]
    slowed_steps: list[int]
    weight_distance: list[list[float | None]]


class Evaluation(TypedDict):
    """A validation or test run: the global step it ran at, and what the script logged in it."""

    stage: Stage
    step: int
    metrics: dict[str, float]


class Overflow(TypedDict):
    step: int
    loss_scale: float | None
    phase: Phase
    module: str | None
    tensor: str | None
    dtype: str | None
    max_finite: float | None
    note: str | None
    rank: int


class SubmoduleDistance(TypedDict):
    name: str
    distance: float | None


class MetricSummary(TypedDict):
    """A metric's last value beside the baseline's; ``difference`` is ``value - baseline``."""

    stage: Stage
    value: float | None
    baseline: float | None
    difference: float | None
    relative_difference: float | None


class ScaleTrend(TypedDict):
    lowest_loss_scale: float | None
    lowest_at_step: int | None
    recovered: bool
    model_problem: bool
    advice: str | None


class StepTimes(TypedDict):
    median: float
    p25: float
    p75: float


class LossSummary(TypedDict):
    """One ``loss_id``'s loss against the baseline's, over the steps where both runs gave it, as the summary's own
    ``final_loss`` and the differences beside it are over the steps both took; without such a step, the final loss
    is NaN and the differences None."""

    final_loss: float
    final_loss_relative_difference: float | None
    max_relative_loss_difference: float | None
    mean_relative_loss_difference: float | None


class Summary(TypedDict):
    final_loss: float
    final_loss_relative_difference: float | None
    max_relative_loss_difference: float | None
    mean_relative_loss_difference: float | None
    loss_by_id: dict[str, LossSummary]
    first_step_apart: int | None
    explanation: str | None
    weight_distance: float | None
    submodule_distances: list[SubmoduleDistance]
    metrics: dict[str, MetricSummary]
    skipped_steps: list[int]
    final_loss_scale: float | None
    scale_trend: ScaleTrend | None
    step_time_s: StepTimes | None
    median_step_time_s: float | None
    step_time_ratio: float | None
    step_time_call: Call | None
    peak_memory_bytes: int
    peak_memory_ratio: float | None
    peak_memory_call: Call | None


class CandidateEntry(TypedDict):
    """One run in ``candidates``; ``series`` also for a failed run's steps, ``summary`` only for a compared run."""

    name: str
    precision: str
    role: Role
    command: list[str]
    directory: str
    returncode: int | None
    status: Status
    reason: str | None
    world_size: int | None
    ran_as: str | None
    restarts: int | None
    replaced: list[str]
    turned_off: list[str]
    peak_memory_bytes: NotRequired[int]
    peak_memory_kind: NotRequired[MemoryKind]
    series: Series | None
    evaluations: list[Evaluation]
    overflows: list[Overflow]
    summary: Summary | None


class Report(TypedDict):
    """``compare.json``."""

    schema: SchemaName
    command: list[str]
    steps: int
    tolerance: Tolerances
    metrics: list[MetricOption]
    versions: Versions
    hardware: str
    apex: Apex | None
    baseline: str
    comparable: bool
    problem: str | None
    noise_floor: NoiseFloor | None
    spread: Spread | None
    candidates: list[CandidateEntry]
