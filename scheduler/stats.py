"""The scheduler's counters (read by /v1/status and /metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from scheduler.plan import Lane, LaneKind


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0  # non-empty steps whose outcome was applied
    prefill_rows: int = 0
    decode_rows: int = 0
    contended_prefill_rows: int = 0  # prefill rows run in steps that also had decode lanes
    prefix_hit_tokens: int = 0
    shared_prefill_waits: int = 0  # admissions put off a step because a running prefill was computing the block
    recalled_hash_blocks: int = 0  # block hashes prompts copied from remembered chains instead of hashing them
    preemptions: int = 0
    budget_halvings: int = 0
    overtakes: int = 0
    decode_debt_steps: int = 0
    traces_wanted: int = 0  # steps whose budget was cut only because their larger shape had no compiled trace yet
    draft_tokens: int = 0  # drafted tokens verified (speculative decoding)
    accepted_draft_tokens: int = 0  # ... of which the model agreed with

    def count_lane(self, lane: Lane, contended: bool) -> None:
        """Count a lane whose outcome was applied (committed rows only)."""
        if lane.kind is LaneKind.DECODE:
            self.decode_rows += lane.rows
            self.draft_tokens += lane.drafts
            return
        self.prefill_rows += lane.rows
        if contended:
            self.contended_prefill_rows += lane.rows

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
