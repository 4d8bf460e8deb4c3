"""The gap frontier of a recorded contended run: its step price fitted from its own compiled steps, the prompt planned
under a step limit, and the least limit whose steps keep the long prompt's TTFT within 1.5x of its solo prefill."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.gpu.gap_frontier import (
    StepPrice,
    frontier,
    least_limit,
    main,
    prompt_steps,
    read_steps,
    step_price,
)
from scheduler.buckets import query_bucket

DECODE_MS, ROW_MS, PAIR_MS = 4.0, 3.0, 0.6
PROMPT = 16384


def _result(decode_ms: float | None = DECODE_MS, solo_s: float = 0.2) -> dict:
    """A run whose compiled 8-lane steps cost exactly DECODE_MS + ROW_MS a k padded rows + PAIR_MS a M pairs."""
    truth = StepPrice(DECODE_MS, ROW_MS, PAIR_MS, 0, 0.0)
    observations = [[[[2048, 0]], 0, "gpu", False, False, 20.0]]  # solo prefill: not a compiled 8-lane step
    history = 0
    for rows in (1536, 1024, 1024, 1024, 768, 768, 768, 512, 512):
        observations.append([[[rows, history]], 8, "gpu", False, True, truth.of(rows, history, 8)])
        history += rows
    observations.append([[[1536, 0]], 8, "gpu", True, True, 99.0])  # auxiliary: left out of the fit
    contended = {"gap_ratio": 4.0, "gap_p50_ms": 4.2, "long_ttft_s": 0.23, "steps": {"decode_only_ms_p50": decode_ms}}
    ours = {"cost_observations": observations, "contended": {**contended, "cost_observations_from": 1},
            "prefill": {"16384": {"ttft_s": solo_s}}}  # fmt: skip
    return {"shape": "0.6b", "contended_streams": 8, "contended_long": PROMPT, "ours": ours}


def test_the_step_price_is_the_runs_own_costs() -> None:
    price = step_price(_result())
    assert price is not None and price.fitted_steps == 9
    assert price.fixed_ms == DECODE_MS
    assert price.row_ms == pytest.approx(ROW_MS) and price.pair_ms == pytest.approx(PAIR_MS)
    assert price.error_ms == pytest.approx(0.0, abs=1e-9)


def test_the_prompt_is_read_in_steps_within_the_limit() -> None:
    price = StepPrice(DECODE_MS, ROW_MS, PAIR_MS, 9, 0.0)
    costs = prompt_steps(price, PROMPT, 8, 12.0)
    assert costs is not None and all(cost <= 12.0 for cost in costs)
    wider = prompt_steps(price, PROMPT, 8, 20.0)
    assert wider is not None and len(wider) < len(costs)  # a wider limit takes fewer steps
    assert prompt_steps(price, PROMPT, 8, DECODE_MS) is None  # no chunk fits beside a decode step's cost


def test_the_least_limit_is_where_the_ttft_allowance_is_met() -> None:
    price = StepPrice(DECODE_MS, ROW_MS, PAIR_MS, 9, 0.0)
    allowed = 300.0
    limit = least_limit(price, PROMPT, 8, allowed, 4.2, 84.0)
    assert limit is not None
    assert sum(prompt_steps(price, PROMPT, 8, limit)) <= allowed
    under = prompt_steps(price, PROMPT, 8, limit * 0.98)
    assert under is None or sum(under) > allowed
    assert least_limit(price, PROMPT, 8, 10.0, 4.2, 84.0) is None  # no limit reads 16k tokens in 10 ms


def test_the_frontier_row_and_the_table(tmp_path, capsys) -> None:
    row = frontier("run", _result())
    assert row is not None and row.ratio == 4.0 and row.ttft == pytest.approx(1.15)
    assert row.least_ratio is not None and row.steps_at_target is not None
    assert row.ttft_at_target == pytest.approx(sum(prompt_steps(row.price, PROMPT, 8, 3 * 4.2)) / 200.0)
    assert frontier("run", _result(decode_ms=None)) is None  # no decode-only step: no fixed part to pin
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps({"results": [_result()]}))
    assert main([str(path)]) == 0
    assert f"| {tmp_path.name} | 4.2 | 4.00 + 3.00 + 0.600 (9, 0.00) | 4.00 / 1.15 |" in capsys.readouterr().out
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"results": [{"shape": "8b", "ours": {}}]}))
    assert main([str(empty)]) == 1


CEILING = 2048


def linear(fixed_ms: float, row_ms: float, pair_ms: float = 0.0):
    return lambda rows, history: fixed_ms + row_ms * rows + pair_ms * rows * (history + rows / 2)


@settings(max_examples=300, deadline=None)
@given(
    fixed_ms=st.floats(0.0, 30.0),
    row_ms=st.floats(0.0005, 0.05),
    pair_ms=st.floats(0.0, 2e-6),
    rows=st.integers(1, 20000),
    history=st.integers(0, 16000),
    limit_ms=st.floats(1.0, 200.0),
)
def test_each_step_is_the_widest_within_the_limit(fixed_ms, row_ms, pair_ms, rows, history, limit_ms) -> None:
    """Steps read exactly the prompt's rows, each priced within the limit, each a query bucket (or the rows left), and
    the next wider bucket (within the ceiling and the rows left) over the limit; None only where the first step's
    narrowest chunk is over it (a price rising with history never lets a narrower one fit later)."""
    price = linear(fixed_ms, row_ms, pair_ms)
    steps = read_steps(price, rows, history, limit_ms, CEILING)
    if steps is None:
        assert price(min(64, rows), history) > limit_ms or any(
            price(min(64, rows - done), history + done) > limit_ms for done in range(0, rows, 64)
        )
        return
    assert sum(taken for taken, _ in steps) == rows
    done = 0
    for taken, cost in steps:
        left = rows - done
        assert cost == price(taken, history + done) and cost <= limit_ms
        assert taken == left or (taken == query_bucket(taken) and taken <= CEILING)
        wider = query_bucket(taken + 1)
        if taken < left and wider <= CEILING:
            assert price(min(wider, left), history + done) > limit_ms
        done += taken


def test_an_unknown_price_reads_nothing() -> None:
    assert read_steps(lambda rows, history: None, 5000, 0, 50.0, CEILING) is None
