"""Typed trace events. Small frozen dataclasses; `kind` names each in the JSONL dump.

Times are seconds from the sink's clock (`TraceSink.now()`), monotonic, shared by every event of one capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class LaneInfo:
    request_id: str
    kind: str  # "decode" | "prefill"
    rows: int
    history: int
    path: str  # "gpu" | "ane"


@dataclass(frozen=True, slots=True)
class RequestArrived:
    kind: ClassVar[str] = "request_arrived"
    t: float
    request_id: str
    prompt_tokens: int
    max_tokens: int
    priority: int


@dataclass(frozen=True, slots=True)
class RequestAdmitted:
    kind: ClassVar[str] = "request_admitted"
    t: float
    request_id: str
    cached_tokens: int
    overtaken: int  # how many times it was overtaken while waiting


@dataclass(frozen=True, slots=True)
class StepPlanned:
    """The scheduler's decision for one step, after any cut."""

    kind: ClassVar[str] = "step_planned"
    t: float
    step_id: int
    lanes: tuple[LaneInfo, ...]
    row_budget: int
    budget_reason: str
    predicted_ms: float | None
    contended: bool
    halvings: int  # how many times the budget was halved for this step
    overtakes: tuple[str, ...] = ()  # request ids overtaken by this step's admissions
    preempted: tuple[str, ...] = ()
    limit_ms: float | None = None  # what a contended step was planned to take at most


@dataclass(frozen=True, slots=True)
class StepExecuted:
    """The runner's report for one step: measured time and the engine phases inside it.

    `t` is when the step's results were consumed (its end); it started `measured_ms` earlier. Rows are the actual
    rows after any cut.
    """

    kind: ClassVar[str] = "step_executed"
    t: float
    step_id: int
    measured_ms: float
    rows: int
    prefill_rows: int
    decode_lanes: int
    prefill_width: int  # number of prefill lanes
    weighted_history: float  # row-weighted history over the prefill lanes
    path: str  # "gpu", "ane" or "mixed"
    predicted_ms: float | None = None
    auxiliary: bool = False  # restore/prefix-copy/image work or a trace rode along: never trains a cost model
    compiled: bool = False  # replayed a compiled trace (the affine model fits compiled and eager steps apart)
    one_off: str = ""  # why an auxiliary GPU step was one ("stand-in 1024x12288", "first-run", ...; "": not said)


@dataclass(frozen=True, slots=True)
class Span:
    """A timed phase: admission, planning, preparation, submission, consumption, application, ane_*.

    ANE spans measure host notification/report intervals, not exact hardware execution.
    """

    kind: ClassVar[str] = "span"
    name: str
    start: float
    end: float
    step_id: int | None = None
    attrs: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenCommitted:
    """A token delivered to a request (committed; cancelled provisional output is never traced)."""

    kind: ClassVar[str] = "token"
    t: float
    request_id: str
    index: int  # 0 for the first generated token


@dataclass(frozen=True, slots=True)
class RequestFinished:
    kind: ClassVar[str] = "request_finished"
    t: float
    request_id: str
    reason: str
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
