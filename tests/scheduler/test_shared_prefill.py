"""Requests that arrive together over one long prefix compute it once: the later ones wait for the running prefill
that computes it and take it from the prefix cache (`SchedulerConfig.shared_prefill_tokens`)."""

from __future__ import annotations

from scheduler_helpers import fake_outcome

from scheduler import Request, Scheduler, SchedulerConfig

SYSTEM = [500 + i for i in range(512)]  # 32 blocks of 16


def _burst(scheduler: Scheduler, count: int, prefix: list[int] = SYSTEM, salts=None) -> None:
    for i in range(count):
        salt = salts[i] if salts else None
        scheduler.add(Request(f"r{i}", [*prefix, *range(2000 + 40 * i, 2040 + 40 * i)], 3, cache_salt=salt))


def _prefill_rows(scheduler: Scheduler, steps: int) -> tuple[int, list[list[tuple[str, int, int]]]]:
    """Run steps; the prefill rows they computed and each step's prefill lanes (request, start, rows)."""
    rows, lanes = 0, []
    for step in range(steps):
        plan = scheduler.schedule(step * 0.05)
        prefill = [(lane.request_id, lane.start, lane.rows) for lane in plan.lanes if lane.rows > 1]
        rows += sum(r for _, _, r in prefill)
        lanes.append(prefill)
        scheduler.update(plan, fake_outcome(plan), step * 0.05 + 0.01)
    return rows, lanes


def test_a_burst_over_one_system_prompt_computes_it_once():
    scheduler = Scheduler(SchedulerConfig(num_blocks=512))
    _burst(scheduler, 3)
    rows, lanes = _prefill_rows(scheduler, 3)
    assert lanes[0] == [("r0", 0, 552)]  # the others wait: r0 is computing their next 512 tokens
    assert sorted(lanes[1]) == [("r1", 512, 40), ("r2", 512, 40)]  # then start past them, from the cache
    assert rows == 552 + 2 * 40
    assert scheduler.stats.shared_prefill_waits == 2 and scheduler.stats.prefix_hit_tokens == 2 * 512
    assert all(scheduler.get(f"r{i}").num_cached_tokens == 512 for i in (1, 2))


def test_off_each_request_computes_the_prefix():
    scheduler = Scheduler(SchedulerConfig(num_blocks=512, shared_prefill_tokens=0))
    _burst(scheduler, 3)
    rows, lanes = _prefill_rows(scheduler, 2)
    assert sorted(lanes[0]) == [("r0", 0, 552), ("r1", 0, 552), ("r2", 0, 552)] and rows == 3 * 552
    assert scheduler.stats.shared_prefill_waits == 0 and scheduler.stats.prefix_hit_tokens == 0


def test_a_short_shared_run_a_salt_or_no_cache_is_not_waited_for():
    """Under `shared_prefill_tokens` shared tokens the wait would cost a step to save a few rows; another salt
    hashes to other blocks; without the prefix cache nothing could be taken from it."""
    for config, prefix, salts in (
        (SchedulerConfig(num_blocks=512), SYSTEM[:240], None),
        (SchedulerConfig(num_blocks=512), SYSTEM, ["a", "b"]),
        (SchedulerConfig(num_blocks=512, enable_prefix_cache=False), SYSTEM, None),
    ):
        scheduler = Scheduler(config)
        _burst(scheduler, 2, prefix, salts)
        _, lanes = _prefill_rows(scheduler, 1)
        assert [request for request, _, _ in lanes[0]] == ["r0", "r1"], (config, len(prefix), salts)
        assert scheduler.stats.shared_prefill_waits == 0


def test_under_a_small_budget_the_later_request_starts_past_the_shared_prefix():
    """Chunks of 128 rows: the first request takes every row until its prompt is in, so the second gets its first
    rows once the shared 512 tokens are published, and starts past them (no wait counted: the budget held it)."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=512, row_ceiling=128, row_floor=128))
    _burst(scheduler, 2)
    rows, lanes = _prefill_rows(scheduler, 5)
    assert [lane for step in lanes[:4] for lane in step] == [("r0", 128 * i, 128) for i in range(4)]
    assert sorted(lanes[4]) == [("r0", 512, 40), ("r1", 512, 40)] and rows == 552 + 40
    assert scheduler.get("r1").num_cached_tokens == 512 and scheduler.stats.shared_prefill_waits == 0


def test_a_step_holds_at_most_as_many_requests_as_it_has_free_running_slots():
    """A burst longer than the running slots: one step looks at (and hashes) no more of the queue than it could
    admit, and the held ones come in, from the cache, once the first prompt is published."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=1024, max_running=4))
    _burst(scheduler, 10)
    _, lanes = _prefill_rows(scheduler, 1)
    assert lanes[0] == [("r0", 0, 552)] and scheduler.stats.shared_prefill_waits == 4
    _, lanes = _prefill_rows(scheduler, 1)
    assert sorted(lanes[0]) == [("r1", 512, 40), ("r2", 512, 40), ("r3", 512, 40)]
