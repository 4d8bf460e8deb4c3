"""Scheduler basics: chunked prefill with decode lanes, positions and blocks, finishing, cancel, refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
from scheduler_helpers import drain, fake_outcome, make_request, run_step

from scheduler import (
    FinishReason,
    LaneKind,
    QueueFull,
    Request,
    RequestState,
    RequestTooLarge,
    Scheduler,
    SchedulerConfig,
    StepOutcome,
)


def make_scheduler(num_blocks: int = 512, **kwargs) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, **kwargs))


def test_import_leaves_mlx_out() -> None:
    code = "import sys, scheduler, scheduler.core, scheduler.cost_models; print('mlx' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_chunked_prefill_runs_beside_decode_lanes_and_shortest_first() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_request("long", 3000, max_tokens=3))
    scheduler.add(make_request("short", 40, max_tokens=3))
    first = scheduler.schedule(0.0)
    assert [lane.request_id for lane in first.lanes] == ["short", "long"]
    assert first.num_rows == 2048 and not first.contended
    long_lane = first.lanes[1]
    assert long_lane.rows == 2008 and not long_lane.samples and long_lane.start == 0
    assert len(long_lane.block_ids) == -(-2008 // 16)
    scheduler.update(first, fake_outcome(first), 0.1)
    second = scheduler.schedule(0.1)
    kinds = {lane.request_id: lane.kind for lane in second.lanes}
    assert kinds == {"short": LaneKind.DECODE, "long": LaneKind.PREFILL}
    assert second.contended
    long_lane = next(lane for lane in second.lanes if lane.request_id == "long")
    assert long_lane.start == 2008 and long_lane.end == 3000 and long_lane.samples
    assert len(long_lane.block_ids) == -(-3000 // 16)
    assert second.num_rows <= 2048


def test_update_finishes_on_stop_token_max_tokens_and_length() -> None:
    scheduler = make_scheduler(max_model_len=42)
    scheduler.add(make_request("stop", 10, max_tokens=9, stop_token_ids=frozenset({7})))
    scheduler.add(make_request("max", 10, max_tokens=2, base=5000))
    scheduler.add(make_request("len", 40, max_tokens=100, base=9000))
    finished = {}
    now = 0.0
    while scheduler.has_work:
        plan = scheduler.schedule(now)
        token = {
            lane.request_id: (7 if lane.request_id == "stop" else 3) for lane in plan.lanes if lane.samples
        }
        for request in scheduler.update(plan, StepOutcome(token, 5.0), now):
            if request.is_finished:
                finished[request.request_id] = request
        now += 0.01
    assert finished["stop"].finish_reason is FinishReason.STOP and finished["stop"].output_ids == [7]
    assert finished["max"].finish_reason is FinishReason.LENGTH and len(finished["max"].output_ids) == 2
    assert finished["len"].finish_reason is FinishReason.LENGTH and finished["len"].num_tokens == 42
    assert scheduler.blocks.num_used_blocks == 0


def test_cancel_frees_blocks_at_once_and_is_idempotent() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_request("a", 100))
    plan = scheduler.schedule(0.0)
    assert scheduler.blocks.num_used_blocks == 7
    cancelled = scheduler.cancel("a")
    assert cancelled is not None and cancelled.finish_reason is FinishReason.CANCELLED
    assert scheduler.blocks.num_used_blocks == 0
    assert scheduler.cancel("a") is None
    assert scheduler.update(plan, fake_outcome(plan), 0.1) == []  # its in-flight lane is ignored
    assert not scheduler.has_work
    assert "a" in scheduler.schedule(0.2).released_request_ids


def test_queue_limit_and_too_large() -> None:
    scheduler = make_scheduler(num_blocks=8, queue_limit=2)
    with pytest.raises(RequestTooLarge):
        scheduler.add(make_request("huge", 8 * 16 + 1))
    scheduler.add(make_request("a", 10))
    scheduler.add(make_request("b", 10))
    with pytest.raises(QueueFull):
        scheduler.add(make_request("c", 10))
    with pytest.raises(ValueError):
        scheduler.add(make_request("a", 10))


def test_prefix_cache_hit_never_covers_the_last_prompt_token() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_request("first", 64, max_tokens=1))
    drain(scheduler)
    assert scheduler.blocks.num_cached_blocks == 4
    scheduler.add(make_request("same", 64, max_tokens=1))
    lane = scheduler.schedule(1.0).lanes[0]
    assert lane.start == 48 and lane.rows == 16  # 3 of 4 cached blocks: the last token is recomputed
    assert scheduler.get("same").num_cached_tokens == 48
    assert scheduler.stats.prefix_hit_tokens == 48


@pytest.mark.parametrize("shared_blocks", [0, 15, 16, 17, 40, 200])
def test_prefix_lookup_finds_the_whole_cached_run_and_hashes_little_on_a_miss(shared_blocks) -> None:
    """The lookup grows the hash chain only while it hits, and finds exactly the shared leading blocks."""
    scheduler = make_scheduler(num_blocks=2048)
    scheduler.add(make_request("first", 16 * 300, max_tokens=1))
    drain(scheduler)
    shared = make_request("second", 16 * 300, max_tokens=1)
    shared.prompt_ids[16 * shared_blocks] = 7  # the first differing block
    scheduler.add(shared)
    assert scheduler.schedule(1.0).lanes[0].start == 16 * shared_blocks
    assert len(shared.block_hashes) <= max(16, 2 * shared_blocks) + 1  # not all 299 of a miss


def test_cache_salt_separates_prefixes() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_request("a", 64, max_tokens=1, cache_salt="tenant-1"))
    drain(scheduler)
    scheduler.add(make_request("b", 64, max_tokens=1, cache_salt="tenant-2"))
    assert scheduler.schedule(1.0).lanes[0].start == 0


def test_a_request_that_reads_no_prefix_cache_computes_every_row_and_still_publishes() -> None:
    """Prompt scoring needs every row's hidden state: such a request takes no hit, but the blocks it computes serve
    the next request with the same prefix."""
    scheduler = make_scheduler()
    scheduler.add(make_request("first", 64, max_tokens=1))
    drain(scheduler)
    scorer = make_request("scorer", 64, max_tokens=1, reads_prefix_cache=False)
    scheduler.add(scorer)
    assert run_step(scheduler, 1.0).lanes[0].start == 0 and scorer.num_cached_tokens == 0
    drain(scheduler)
    scheduler.add(make_request("after", 96, max_tokens=1))  # the same 64 tokens first
    assert scheduler.schedule(2.0).lanes[0].start == 64


def test_decode_that_cannot_grow_preempts_the_newest_by_recomputation() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_cache=False)
    scheduler.add(make_request("old", 8, max_tokens=6))
    scheduler.add(make_request("new", 8, max_tokens=6, base=5000))
    run_step(scheduler, 0.0)  # both prefilled: 4 blocks used, both decoding
    plan = scheduler.schedule(1.0)  # "old" needs a 3rd block at position 8
    assert plan.preempted_request_ids == ("new",)
    new = scheduler.get("new")
    assert new.state is RequestState.PREEMPTED and new.num_computed == 0 and new.block_ids == []
    assert [lane.request_id for lane in plan.lanes] == ["old"]
    scheduler.update(plan, fake_outcome(plan), 1.1)
    drain(scheduler)
    assert scheduler.stats.preemptions >= 1 and scheduler.blocks.num_used_blocks == 0


def test_requests_and_counts() -> None:
    scheduler = make_scheduler()
    scheduler.add(Request("x", [1, 2, 3], max_tokens=2))
    assert scheduler.num_waiting == 1 and scheduler.num_running == 0
    scheduler.schedule(0.0)
    assert scheduler.num_waiting == 0 and scheduler.num_running == 1
    assert [r.request_id for r in scheduler.requests()] == ["x"]


def test_a_preempted_request_with_a_pending_token_waits_for_it() -> None:
    from scheduler.plan import PENDING_TOKEN

    scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_cache=False)
    scheduler.add(make_request("old", 8, max_tokens=6))
    scheduler.add(make_request("new", 8, max_tokens=6, base=5000))
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, StepOutcome({"old": PENDING_TOKEN, "new": PENDING_TOKEN}, float("nan")), 0.01)
    plan = scheduler.schedule(0.02)  # "old" needs a block: "new" is preempted with its token still pending
    assert plan.preempted_request_ids == ("new",)
    assert [lane.token_ids for lane in plan.lanes] == [(PENDING_TOKEN,)]
    scheduler.get("new").output_ids[-1] = 9  # the engine fills the token in once it is read back
    scheduler.get("old").output_ids[-1] = 9
    scheduler.update(plan, fake_outcome(plan), 0.03)
    drain(scheduler)
    assert scheduler.blocks.num_used_blocks == 0
