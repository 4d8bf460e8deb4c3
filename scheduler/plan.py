"""The step plan the engine executes and the outcome it reports back. Plain data, no MLX.

One step is one forward pass over a ragged batch of rows (see ARCHITECTURE.md): the plan lists the lanes, each
one request's consecutive rows, with the positions and KV blocks the runner needs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

# A decode lane's input when the token is the one the previous, still running, step samples: the runner takes
# it from that step's device-side result, so the host never waits for it (one step in flight).
PENDING_TOKEN = -1
# A window-space table's entry for a block behind the request's window: freed, never read
NO_BLOCK = -1


class Path(str, enum.Enum):
    GPU = "gpu"  # MLX on the default device (GPU, or the CPU backend in CI)
    ANE = "ane"  # the Core ML lane (or its labelled CPU stand-in)


class LaneKind(str, enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


@dataclass(frozen=True, slots=True)
class SnapshotPoint:
    """Where a lane's recurrent state is copied to a snapshot slot: after its row at `position` - 1."""

    position: int
    slot: int
    block_hash: bytes | None  # the block ending at `position` (None for a decode lane: hashed once its token is known)


@dataclass(frozen=True, slots=True)
class Lane:
    """One request's consecutive rows in a step."""

    request_id: str
    kind: LaneKind
    token_ids: tuple[int, ...]  # the rows' input tokens
    start: int  # position of the first row == tokens already in KV (the lane's history)
    block_ids: tuple[int, ...]  # KV blocks covering positions [0, start + rows)
    samples: bool  # the last row's logits pick the request's next token
    path: Path = Path.GPU
    # a decode lane's trailing rows that are drafted tokens (speculative decoding): every row's logits are read, and
    # the drafts the model agrees with are kept (`StepOutcome.accepted_drafts`)
    drafts: int = 0
    # the window space's blocks over the same positions as `block_ids` (`NO_BLOCK` behind the window); () without one
    window_block_ids: tuple[int, ...] = ()
    # a recurrent model's state (`state_snapshots.py`): this lane starts from a copy of snapshot slot `restore_slot`
    # (None: from zeros at position 0, else from the request's own state), and leaves one at `snapshot` (None: none)
    restore_slot: int | None = None
    snapshot: SnapshotPoint | None = None

    @property
    def rows(self) -> int:
        return len(self.token_ids)

    @property
    def history(self) -> int:
        return self.start

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step runs, and why (every field is visible to tracing)."""

    step_id: int
    lanes: tuple[Lane, ...]
    row_budget: int  # prefill rows this step may carry
    budget_reason: str  # "uncontended", "contended", "halved:<n>", "decode-debt", ...
    predicted_ms: float | None  # cost model's prediction for the planned step, None if not predicted
    contended: bool  # at least one stream was decoding when planned
    released_request_ids: tuple[str, ...] = ()  # finished/cancelled/preempted since the last plan
    preempted_request_ids: tuple[str, ...] = ()
    # what a contended step was planned to take at most: the step target, or the floor slack's allowance (None:
    # uncontended). The runner may replay a larger compiled shape in its place that ran within it (a stand-in)
    limit_ms: float | None = None

    @property
    def num_rows(self) -> int:
        return sum(lane.rows for lane in self.lanes)

    @property
    def prefill_rows(self) -> int:
        return sum(lane.rows for lane in self.lanes if lane.kind is LaneKind.PREFILL)

    @property
    def is_empty(self) -> bool:
        return not self.lanes


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What the runner reports after executing a plan."""

    sampled_tokens: Mapping[str, int]  # request_id -> next token, for every lane with samples=True
    elapsed_ms: float  # wall time of the step as measured by the runner
    failed: Mapping[str, str] = field(default_factory=dict)  # request_id -> error; those requests finish ERROR
    # added after the first contract: measured time of the ANE lanes (None: not measured, so no training),
    # and whether auxiliary work (KV restore/prefix copy, images, a compiled shape's first trace or first run, a padded
    # eager shape's first run, a larger trace standing in for the step's own) rode along (then no cost model trains)
    ane_elapsed_ms: float | None = None
    auxiliary: bool = False
    # of the auxiliary work: the step's shape ran for the first time in its form (a first eager run, a compiled
    # shape's first run, a trace built in the step), whose build time `price_first_runs` learns; not a stand-in
    first_run: bool = False
    compiled: bool = False  # the GPU lanes ran through a compiled trace (the affine model prices the two forms apart)
    # request_id -> the drafted tokens the model agreed with, in order; `sampled_tokens` then follows them
    accepted_drafts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
