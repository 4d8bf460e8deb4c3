"""`replay_budgets`: today's budget at each recorded contended state, replayed through the cost model the run's
engine trained (its `cost_observations`), beside the rows that ran."""

from __future__ import annotations

from benchmarks.gpu.replay_budgets import replay_run, summary

LANES = 8


def cost_ms(rows: int, compiled: bool) -> float:
    """8B 4-bit-like on an H100 beside 8 streams: a large fixed cost, 8 ms more for a step built eager."""
    return 12.8 + 0.03 * rows + (0.0 if compiled else 8.0)


def observation(rows: int, history: int, compiled: bool) -> list:
    # [chunks [[rows, history]], decode lanes, path, auxiliary, compiled, measured ms]
    return [[[rows, history]], LANES, "gpu", False, compiled, cost_ms(rows, compiled)]


def collapsed_run() -> dict:
    """A warm pass of compiled 64-, 384- and 768-row steps and eager 128-row ones over short histories, then a
    measured pass that read a prompt's far half in 64-row steps (the forty-sixth run's c84_2: 169 of them)."""
    warm = [observation(rows, history, rows != 128) for history in range(0, 4096, 512) for rows in (64, 128, 384, 768)]
    measured = [observation(64, history, True) for history in range(8192, 12_288, 64)]
    return {
        "cost_observations": warm + measured,
        "contended": {"cost_observations_from": len(warm)},
        "step_target_ms": 16.0,
        "row_quantum": 64,
        "floor_slack": 1.75,
        "slack_guard_rows": 512,
        "pads_history": False,
    }


def test_a_run_read_in_floor_steps_now_gets_larger_chunks_within_its_allowance():
    replayed = replay_run(collapsed_run())
    assert len(replayed) == 64 and {state.ran_rows for state in replayed} == {64}
    for state in replayed:
        assert state.rows >= 128 and state.reason.endswith("+slack")
        assert state.allowance_ms > 16.0 and state.predicted_ms <= state.allowance_ms
    line = summary("c84", "8b-4bit", replayed)
    assert line.startswith("| c84 | 8b-4bit | 64 | 64 x64 | ")


def test_states_need_decode_lanes_one_chunk_and_rows_left():
    run = collapsed_run()
    run["cost_observations"] += [
        [[[64, 12_288]], 0, "gpu", False, True, 14.0],  # no decode lanes: trains, is no state
        [[[64, 12_352], [64, 0]], LANES, "gpu", False, False, 30.0],  # two chunks
        [[[64, 20_000]], LANES, "gpu", False, True, 15.0],  # past the prompt
    ]
    assert len(replay_run(run)) == 64
    assert replay_run({**run, "contended": {"cost_observations_from": len(run["cost_observations"])}}) == []
