"""`replay_budgets`: today's budget at each recorded contended state, replayed through the cost model the run's
engine trained (its `cost_observations`), beside the rows that ran."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.gpu.replay_budgets import (
    Replayed,
    cell_of,
    main,
    measured_cells,
    measured_read_s,
    replay_run,
    setting,
    summary,
)

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


def test_each_state_carries_what_the_floor_slack_weighed():
    """The allowance is the slack times the floor step's price, at most the guard's, over the plan headroom (not
    recorded: the default 0.9), and the slack engaged because the guard's 512-row step is priced over the planned
    target."""
    for state in replay_run(collapsed_run()):
        assert state.allowance_ms == pytest.approx(min(1.75 * state.floor_ms, state.guard_ms) / 0.9)
        assert state.guard_ms > 16.0 * 0.9
        assert state.floor_ms == pytest.approx(cost_ms(128, True), rel=0.2)
        # 512 rows is past the trust region of the 64-row steps read last: priced at their cost a row
        assert state.guard_ms >= cost_ms(512, True)


def test_states_need_decode_lanes_one_chunk_and_rows_left():
    run = collapsed_run()
    run["cost_observations"] += [
        [[[64, 12_288]], 0, "gpu", False, True, 14.0],  # no decode lanes: trains, is no state
        [[[64, 12_352], [64, 0]], LANES, "gpu", False, False, 30.0],  # two chunks
        [[[64, 20_000]], LANES, "gpu", False, True, 15.0],  # past the prompt
    ]
    assert len(replay_run(run)) == 64
    assert replay_run({**run, "contended": {"cost_observations_from": len(run["cost_observations"])}}) == []


def test_a_setting_replayed_under_another_value_changes_the_decisions():
    run = collapsed_run()
    without_slack = replay_run(run, overrides={"floor_slack": 1.0})
    assert len(without_slack) == 64
    assert not any(state.reason.endswith("+slack") for state in without_slack)
    assert all(state.allowance_ms == 16.0 for state in without_slack)
    narrower = replay_run(run, overrides={"floor_slack": 1.25})  # 2.5 would be held at the guard's step's price
    assert all(n.allowance_ms < s.allowance_ms for n, s in zip(narrower, replay_run(run), strict=True))
    assert sum(state.rows for state in narrower) < sum(state.rows for state in replay_run(run))


def test_measured_cells_are_medians_of_repeated_one_chunk_steps_beside_decode_lanes():
    steps = [
        [[[512, 4096]], LANES, "gpu", False, True, 20.0],
        [[[500, 5000]], LANES, "gpu", False, True, 22.0],  # same cell: bucket 512, history 4096-6143
        [[[512, 4200]], LANES, "gpu", False, True, 30.0],
        [[[512, 4200]], LANES, "gpu", True, True, 90.0],  # one-off work: left out
        [[[512, 4200]], 0, "gpu", False, True, 10.0],  # no decode lanes: left out
        [[[512, 4200], [64, 0]], LANES, "gpu", False, False, 40.0],  # two chunks: left out
        [[[384, 4096]], LANES, "gpu", False, True, 18.0],  # a cell of one step prices nothing
    ]
    cells = measured_cells([{"cost_observations": steps}])
    assert cells == {cell_of(512, LANES, True, 4096): 22.0}


def test_the_measured_read_time_prices_only_the_states_whose_cell_ran():
    def state(history: int, rows: int) -> Replayed:
        return Replayed(history, rows, 0.0, rows, 20.0, 30.0, "halved:2", cell_of(rows, LANES, True, history))

    cells = {cell_of(512, LANES, True, 0): 25.0, cell_of(512, LANES, True, 2048): 35.0}
    replayed = [state(0, 512), state(2048, 512), state(4096, 512)]
    read_s, priced = measured_read_s(replayed, cells, 16_384)
    assert priced == 2 and read_s == 16_384 * 60.0 / 1024 / 1000
    assert measured_read_s(replayed, {}, 16_384) == (None, 0)
    # the prompt's last rows are all a state reads, however large its budget
    read_s, _ = measured_read_s([state(16_000, 512)], {cell_of(512, LANES, True, 16_000): 20.0}, 16_384)
    assert read_s == 16_384 * 20.0 / 384 / 1000


def test_set_reads_each_setting_as_its_config_type_and_refuses_others():
    assert setting("floor_slack=2") == ("floor_slack", 2.0)
    assert setting("slack_guard_rows=256") == ("slack_guard_rows", 256)
    assert setting("budget_midpoints=off") == ("budget_midpoints", False)
    assert setting("checked_fill=untraced") == ("checked_fill", "untraced")
    for bad in ("floor=2", "floor_slack", "floor_slack=", "budget_midpoints=yes", "slack_guard_rows=a"):
        with pytest.raises(argparse.ArgumentTypeError):
            setting(bad)


def test_the_command_prints_a_row_a_run_with_its_measured_read_time(tmp_path, capsys):
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps({"results": [{"shape": "8b-4bit", "ours": collapsed_run()}]}))
    assert main([str(path), "--set", "floor_slack=2.0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("| read s at their measured cost (states priced) |")
    assert len(lines) == 3 and lines[2].startswith(f"| {tmp_path.name} | 8b-4bit | 64 | 64 x64 | ")


def test_a_state_at_the_prompts_tail_is_priced_at_the_rows_left_not_its_budget():
    (state,) = replay_run(collapsed_run(), prompt_tokens=8192 + 40)
    assert state.history == 8192 and state.rows > 40
    assert state.cell == cell_of(40, LANES, state.cell[2], 8192)


def tiled_run(**recorded) -> dict:
    """Steps where 512 rows cost what 384 do (H100, 8B 4-bit), so the residual correction moves 512's price."""
    def step(rows: int, history: int) -> list:
        ms = 14.0 + 0.03 * min(rows, 384) + 0.03 * max(rows - 512, 0) + 2e-7 * rows * history
        return [[[rows, history]], LANES, "gpu", False, True, ms]

    warm = [step(rows, history) for history in range(0, 8192, 512) for rows in (256, 384, 512, 768)]
    measured = [step(512, history) for history in range(8192, 16_384, 512)]
    return {"cost_observations": warm + measured, "contended": {"cost_observations_from": len(warm)},
            "step_target_ms": 30.0, "row_quantum": 128, "pads_history": False, **recorded}  # fmt: skip


def test_a_run_from_before_the_residual_weight_was_recorded_replays_as_it_ran():
    """Runs before `cost_residual_weight` existed ran without the correction: replayed so, not at today's default."""
    def prices(run: dict, **overrides) -> list[float]:
        return [state.predicted_ms for state in replay_run(run, overrides=overrides or None)]

    unrecorded = prices(tiled_run())
    assert unrecorded == prices(tiled_run(), cost_residual_weight=0.0)
    corrected = prices(tiled_run(), cost_residual_weight=0.3)
    assert corrected[0] < unrecorded[0] - 1.0  # the fit, not yet trained on the prompt's steps, over-prices 512 rows
    assert all(c < u for c, u in zip(corrected, unrecorded, strict=True))
    assert prices(tiled_run(cost_residual_weight=0.3)) == corrected


def first_pass_run() -> dict:
    """A first pass read at the floor (64-row eager steps dearer than the target: the fit had seen only solo
    prefill, as in the sixty-second run's first warm pass), then the measured pass of `collapsed_run`."""
    first = [observation(2040, history, False) for history in range(0, 8160, 2040)]
    first[0][1] = 0  # the solo prefill: no decode lanes, no state
    first += [observation(64, history, False) for history in range(8160, 12_256, 64)]
    run = collapsed_run()
    run["cost_observations"] = first + run["cost_observations"]
    run["contended"] = {"cost_observations_from": len(first) + run["contended"]["cost_observations_from"]}
    return run


def test_from_the_first_pass_the_warm_passes_states_are_replayed_too():
    run = first_pass_run()
    measured = replay_run(run)
    every = replay_run(run, from_first_pass=True)
    assert len(measured) == 64
    # the first pass's 3 contended solo-sized steps and 64 floor steps, the warm pass's one-chunk steps, the measured
    assert len(every) == 3 + 64 + 32 + 64
    assert every[-64:] == measured
    assert [state.ran_rows for state in every[3:67]] == [64] * 64
    # those floor steps ran over 1.5 x the planned target: measured so, the floor slack reads on in larger chunks
    left = [state for state in every[3:67] if state.rows > 64 and state.reason.endswith("+slack")]
    assert len(left) >= 60


def test_a_replay_at_another_target_plans_to_it():
    run = first_pass_run()
    at_run_end = replay_run(run, from_first_pass=True)
    higher = replay_run(run, from_first_pass=True, target_ms=40.0)
    assert all(state.allowance_ms >= 40.0 for state in higher)
    assert sum(state.rows for state in higher) > sum(state.rows for state in at_run_end)
    assert replay_run(run, target_ms=16.0) == replay_run(run)  # the recorded target


def test_the_command_refuses_a_target_that_is_no_time(tmp_path, capsys):
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps({"results": [{"shape": "8b-4bit", "ours": first_pass_run()}]}))
    for bad in ("0", "-3", "nan", "inf", "fast"):
        with pytest.raises(SystemExit):
            main([str(path), "--target-ms", bad])
        assert "argument --target-ms" in capsys.readouterr().err
    assert main([str(path), "--from-first-pass", "--target-ms", "12"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2].startswith(f"| {tmp_path.name} | 8b-4bit | {3 + 64 + 32 + 64} | ")
