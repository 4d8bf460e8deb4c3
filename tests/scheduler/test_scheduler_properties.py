"""Hypothesis: random interleavings of arrivals (lengths, priorities, salts, shared prefixes), steps with random
measured times, stop-token finishes and cancellations, over random pool sizes. Every plan and state is checked
by `Harness` (SCHEDULER.md's invariants); afterwards every admitted request must finish."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_harness import Harness

from scheduler import FinishReason, Request, Scheduler, SchedulerConfig
from scheduler.buckets import query_bucket
from scheduler.cost_models import EmaCostModel

STOP_TOKEN = 2
PREFIXES = [list(range(100, 100 + n)) for n in (0, 16, 40, 64)]

arrival = st.fixed_dictionaries(
    {
        "kind": st.just("arrive"),
        "length": st.integers(1, 300),
        "prefix": st.integers(0, len(PREFIXES) - 1),
        "priority": st.integers(0, 2),
        "salt": st.sampled_from([None, None, "a", "b"]),
        "max_tokens": st.integers(1, 24),
        "speculate": st.sampled_from([0, 0, 2, 5]),  # drafted tokens a step (speculative decoding)
    }
)
step = st.fixed_dictionaries(
    {
        "kind": st.just("step"),
        "elapsed_ms": st.one_of(
            st.floats(1.0, 2000.0), st.sampled_from([0.0, -5.0, math.inf, math.nan])
        ),
        "stop": st.booleans(),
        "accept": st.integers(0, 5),  # drafts the model agrees with
    }
)
cancel = st.fixed_dictionaries({"kind": st.just("cancel"), "index": st.integers(0, 200)})
actions = st.lists(st.one_of(arrival, arrival, step, step, step, cancel), min_size=10, max_size=80)

configs = st.builds(
    lambda num_blocks, block_size, ceiling, floor_shift, max_running, overtakes, model, target, cache, ane, quantum,
    kv_bucket, shared, window, window_room, snapshots: (
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            row_ceiling=ceiling,
            row_floor=max(1, ceiling >> floor_shift),
            row_quantum=quantum,
            kv_bucket=kv_bucket,
            max_running=max_running,
            max_overtakes=overtakes,
            cost_model=model,
            step_target_ms=target,
            enable_prefix_cache=cache,
            shared_prefill_tokens=shared,
            ane_lane=ane,
            max_model_len=400,
            queue_limit=64,
            window_tokens=window,
            # a window space from the least that holds one request's window up
            window_blocks=(-(-(window - 1) // block_size) + 1 + window_room) if window else 0,
            recurrent_state=snapshots >= 0,
            state_snapshots=max(0, snapshots),
        )
    ),
    num_blocks=st.integers(20, 120),
    block_size=st.sampled_from([4, 16]),
    ceiling=st.sampled_from([64, 256, 2048]),
    floor_shift=st.integers(0, 3),
    max_running=st.integers(1, 8),
    overtakes=st.integers(0, 4),
    model=st.sampled_from(["ema", "bucketed", "affine"]),
    target=st.sampled_from([20.0, 500.0]),
    cache=st.booleans(),
    ane=st.booleans(),
    quantum=st.sampled_from([1, 1, 16, 64]),
    kv_bucket=st.sampled_from([0, 0, 1024]),
    shared=st.sampled_from([0, 8, 16, 256]),  # PREFIXES share 16-64 tokens: waits for a running prefill happen
    window=st.sampled_from([0, 0, 1, 5, 24, 64]),  # sliding-window layers' widest window (0: no window space)
    window_room=st.sampled_from([0, 1, 3, 40]),
    snapshots=st.sampled_from([-1, -1, -1, 0, 1, 3, 20]),  # a recurrent model's state snapshots (-1: no such state)
)


def make_prompt(action: dict) -> list[int]:
    return PREFIXES[action["prefix"]] + [1000 + i for i in range(action["length"])]


def _progress(harness: Harness) -> tuple[int, int]:
    """Grows with every computed row and every token: a stalled scheduler leaves it unchanged."""
    requests = harness.scheduler.requests()
    return (sum(r.num_computed + 2 * len(r.output_ids) for r in requests), len(requests))


def drive(config: SchedulerConfig, script: list[dict]) -> Harness:
    harness = Harness(Scheduler(config))
    scheduler = harness.scheduler
    now, arrivals = 0.0, 0
    for action in script:
        if action["kind"] == "arrive":
            prompt = make_prompt(action)
            if -(-len(prompt) // config.block_size) > config.num_blocks:
                continue
            request = Request(
                f"r{arrivals}",
                prompt,
                max_tokens=action["max_tokens"],
                priority=action["priority"],
                cache_salt=action["salt"],
                stop_token_ids=frozenset({STOP_TOKEN}),
                speculate=0 if config.recurrent_state else action["speculate"],  # refused with recurrent state
            )
            scheduler.add(request)
            arrivals += 1
        elif action["kind"] == "cancel" and arrivals:
            scheduler.cancel(f"r{action['index'] % arrivals}")
        elif action["kind"] == "step":
            tokens = {r.request_id: STOP_TOKEN for r in scheduler.requests()} if action["stop"] else None
            harness.step(now, action["elapsed_ms"], tokens, action["accept"])
            now += 0.05
    stuck, steps = 0, 0
    while scheduler.has_work and stuck < 50 and steps < 3000:  # arrivals are finite: everything admitted must finish
        progress = _progress(harness)
        harness.step(now, 30.0, accept=steps % 4)
        now += 0.03
        stuck = stuck + 1 if _progress(harness) == progress else 0
        steps += 1
    assert not scheduler.has_work, "requests left unfinished"
    assert scheduler.blocks.num_used_blocks == 0
    assert scheduler.window_space is None or scheduler.window_space.num_used_blocks == 0
    return harness


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, script=actions)
def test_random_interleavings_keep_every_invariant(config: SchedulerConfig, script: list[dict]) -> None:
    harness = drive(config, script)
    assert harness.max_decode_wait <= 2
    for request in harness.finished.values():
        assert request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert len(request.output_ids) <= request.max_tokens
        assert request.num_tokens <= config.max_model_len


ample = st.builds(
    lambda ceiling, floor_shift, target, quantum, midpoints, kv_bucket, model: SchedulerConfig(
        num_blocks=1024, row_ceiling=ceiling, row_floor=max(1, ceiling >> floor_shift), step_target_ms=target,
        row_quantum=quantum, budget_midpoints=midpoints, kv_bucket=kv_bucket, cost_model=model,
    ),
    ceiling=st.sampled_from([256, 2048]),
    floor_shift=st.integers(1, 5),
    target=st.sampled_from([5.0, 50.0, 500.0]),
    quantum=st.sampled_from([1, 64]),
    midpoints=st.booleans(),
    kv_bucket=st.sampled_from([0, 1024]),
    model=st.sampled_from(["ema", "affine"]),
)


@settings(max_examples=60, deadline=None)
@given(
    config=ample,
    lengths=st.lists(st.integers(1, 1500), min_size=2, max_size=10),
    elapsed=st.lists(st.floats(1.0, 3000.0), min_size=20, max_size=20),
)
def test_contended_steps_carry_at_least_the_floor(
    config: SchedulerConfig, lengths: list[int], elapsed: list[float]
) -> None:
    """With KV to spare, a contended step (not a decode-debt step) carries >= floor rows unless fewer wait."""
    harness = Harness(Scheduler(config), check_kv=False)
    scheduler = harness.scheduler
    for index, length in enumerate(lengths):
        scheduler.add(Request(f"r{index}", [index * 10_000 + i for i in range(length)], max_tokens=50))
    now = 0.0
    for elapsed_ms in elapsed:
        waiting_rows = sum(r.num_remaining for r in scheduler.requests() if r.num_remaining > 1)
        plan = harness.step(now, elapsed_ms)
        now += elapsed_ms / 1000
        if plan.contended and plan.budget_reason != "decode-debt":
            assert config.row_floor <= plan.row_budget <= config.row_ceiling
            assert plan.prefill_rows >= min(config.row_floor, waiting_rows)
            lanes = plan.num_rows - plan.prefill_rows
            if config.kv_bucket and plan.row_budget < config.row_ceiling:
                assert plan.row_budget == query_bucket(plan.row_budget)  # the rows a padded chunk pays for
            elif config.row_quantum > 1 and plan.row_budget + lanes < config.row_ceiling:
                assert (plan.row_budget + lanes) % config.row_quantum == 0  # the last row tile is full
            if plan.budget_reason.endswith("+half"):  # a midpoint is taken only where it is predicted to fit
                assert config.budget_midpoints and plan.predicted_ms <= config.step_target_ms
        if not plan.contended:
            assert plan.row_budget == config.row_ceiling


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=10),
    priorities=st.lists(st.integers(0, 2), min_size=10, max_size=10),
    ms_per_row=st.floats(0.01, 5.0),
)
def test_the_estimate_changes_only_the_budget(lengths: list[int], priorities: list[int], ms_per_row: float) -> None:
    """A trained and an untrained model plan the same order: the trained one's lanes are a prefix (last cut)."""
    plans = []
    for trained in (False, True):
        scheduler = Scheduler(SchedulerConfig(num_blocks=4096, step_target_ms=100.0))
        scheduler.add(Request("stream", [1, 2, 3], max_tokens=100))
        harness = Harness(scheduler, check_kv=False)
        harness.step(0.0, 5.0)
        scheduler.cost_model = EmaCostModel()
        if trained:
            scheduler.cost_model.ms_per_row = ms_per_row
        for index, length in enumerate(lengths):
            scheduler.add(Request(f"r{index}", [index * 10_000 + i for i in range(length)], 5, priorities[index]))
        plans.append(harness.step(0.01, 5.0))
    untrained, trained = ([lane.request_id for lane in plan.lanes] for plan in plans)
    assert trained == untrained[: len(trained)]
    assert plans[1].row_budget <= plans[0].row_budget
