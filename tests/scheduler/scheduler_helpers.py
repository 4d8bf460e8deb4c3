"""Shared helpers for the scheduler tests: a fake runner that samples deterministic tokens."""

from __future__ import annotations

from scheduler import Request, Scheduler, StepOutcome, StepPlan


def make_request(request_id: str, prompt_len: int, max_tokens: int = 4, **kwargs) -> Request:
    base = kwargs.pop("base", 1000)
    return Request(
        request_id=request_id,
        prompt_ids=[base + i for i in range(prompt_len)],
        max_tokens=max_tokens,
        **kwargs,
    )


def fake_outcome(plan: StepPlan, elapsed_ms: float = 10.0, token: int = 7, **kwargs) -> StepOutcome:
    sampled = {lane.request_id: token for lane in plan.lanes if lane.samples}
    return StepOutcome(sampled_tokens=sampled, elapsed_ms=elapsed_ms, **kwargs)


def run_step(scheduler: Scheduler, now: float, elapsed_ms: float = 10.0, token: int = 7) -> StepPlan:
    plan = scheduler.schedule(now)
    scheduler.update(plan, fake_outcome(plan, elapsed_ms, token), now + elapsed_ms / 1000.0)
    return plan


def drain(scheduler: Scheduler, max_steps: int = 10_000, elapsed_ms: float = 10.0) -> int:
    """Run steps until no work is left; returns how many steps it took."""
    now = 0.0
    for step in range(max_steps):
        if not scheduler.has_work:
            return step
        run_step(scheduler, now, elapsed_ms)
        now += elapsed_ms / 1000.0
    raise AssertionError(f"scheduler still has work after {max_steps} steps")
