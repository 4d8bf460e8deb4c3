"""The window space: sliding-window layers' KV blocks, held only within a window of a request's next row, and prefix
hits cut back to where that space still holds the window before their end."""

from __future__ import annotations

import pytest
from scheduler_helpers import make_request, run_step

from scheduler import RequestTooLarge, Scheduler, SchedulerConfig
from scheduler.plan import NO_BLOCK


def windowed(**kwargs) -> Scheduler:
    settings = dict(num_blocks=200, block_size=16, window_tokens=64, window_blocks=40, row_ceiling=256, row_floor=16)
    return Scheduler(SchedulerConfig(**(settings | kwargs)))


def test_a_long_prompt_holds_a_window_of_blocks_not_its_length() -> None:
    scheduler = windowed()
    request = make_request("long", 1000, max_tokens=40)
    scheduler.add(request)
    most_held = 0
    for step in range(200):
        if not scheduler.has_work:
            break
        plan = run_step(scheduler, step * 0.01)
        if request.block_ids:
            held = [b for b in request.window_block_ids if b != NO_BLOCK]
            most_held = max(most_held, len(held))
            # every block before the one holding the next row's window start is gone
            assert request.window_first == (request.num_computed - 64 + 1) // 16
            for lane in plan.lanes:
                assert len(lane.window_block_ids) == len(lane.block_ids)
    assert request.is_finished and len(request.output_ids) == 40
    # a 256-row chunk and the 63 positions before it: at most 16 + 5 blocks, never the prompt's 63
    assert most_held <= 21
    assert scheduler.window_space.num_used_blocks == 0 and scheduler.blocks.num_used_blocks == 0


def test_a_window_space_smaller_than_the_prompt_still_serves_it() -> None:
    scheduler = windowed(window_blocks=6, row_ceiling=32)
    request = make_request("long", 500, max_tokens=8)
    scheduler.add(request)
    for step in range(500):
        if not scheduler.has_work:
            break
        run_step(scheduler, step * 0.01)
    assert request.is_finished and len(request.output_ids) == 8


def test_a_continuation_takes_its_prefix_from_both_spaces() -> None:
    scheduler = windowed()
    first = make_request("first", 300, max_tokens=1)
    scheduler.add(first)
    while scheduler.has_work:
        run_step(scheduler, 0.0)
    follow = make_request("follow", 400, max_tokens=4)  # the same first 300 tokens, then 100 more
    scheduler.add(follow)
    plan = scheduler.schedule(1.0)
    assert follow.num_cached_tokens == 288  # 18 full blocks of the 300 (the last partial one is computed again)
    # it holds the window's blocks before 288 from the cache, nothing earlier
    first_kept = (288 - 64 + 1) // 16
    (lane,) = plan.lanes
    assert lane.start == 288 and lane.window_block_ids[:first_kept] == (NO_BLOCK,) * first_kept
    assert NO_BLOCK not in lane.window_block_ids[first_kept:]


def test_a_prefix_hit_stops_where_the_window_space_lost_the_window_before_it() -> None:
    scheduler = windowed(window_blocks=30)
    first = make_request("first", 300, max_tokens=1)
    scheduler.add(first)
    while scheduler.has_work:
        run_step(scheduler, 0.0)
    # another prompt fills the window space, evicting the cached window blocks (the oldest released go first)
    other = make_request("other", 460, max_tokens=1, base=50_000)
    scheduler.add(other)
    while scheduler.has_work:
        run_step(scheduler, 0.0)
    follow = make_request("follow", 400, max_tokens=1)
    scheduler.add(follow)
    run_step(scheduler, 1.0)
    full_hits = scheduler.stats.prefix_hit_tokens
    assert follow.num_cached_tokens < 288, "a hit whose window is gone from the window space would read lost KV"
    assert full_hits == follow.num_cached_tokens
    while scheduler.has_work:
        run_step(scheduler, 2.0)
    assert follow.is_finished


def test_window_space_needs_room_for_one_window() -> None:
    with pytest.raises(ValueError, match="cannot hold one request's window"):
        SchedulerConfig(num_blocks=100, block_size=16, window_tokens=64, window_blocks=4)
    with pytest.raises(ValueError, match="both 0"):
        SchedulerConfig(num_blocks=100, window_tokens=64)
    # the window space never limits a prompt's length: only the full space does
    scheduler = windowed(window_blocks=5)
    scheduler.add(make_request("long", 3000))
    with pytest.raises(RequestTooLarge):
        scheduler.add(make_request("too long", 200 * 16 + 1))
