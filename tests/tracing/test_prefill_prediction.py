from __future__ import annotations

import pytest
from trace_factory import SimConfig, prefill_steps, simulate

from tracing import events as ev
from tracing.jsonl import write_events
from tracing.prefill_prediction import main, observations, replay, summarize


def step_pair(sid: int, rows: int, ms: float, path: str = "gpu", history: int = 0) -> list:
    lane = ev.LaneInfo(f"r{sid}", "prefill", rows, history, path)
    return [ev.StepPlanned(0.0, sid, (lane,), 2048, "contended", None, True, 0),
            ev.StepExecuted(0.0, sid, ms, rows, rows, 0, 1, float(history), path)]


def errors_by(rows: list[dict], model: str, group: str = "all") -> dict:
    return next(r for r in rows if r["model"] == model and r["group"] == group)


def test_each_prediction_uses_only_earlier_observations():
    found, _ = observations(step_pair(1, 100, 10.0) + step_pair(2, 100, 20.0))
    result = replay(found, ("ema",))
    assert result["unpredicted"] == {"ema": 1}  # nothing earlier than the first observation
    # the second is predicted from the first alone (10 ms), not from an EMA that already saw 20 ms
    assert result["errors"]["ema"]["all"] == [pytest.approx(0.5)]


def test_untrainable_observations_are_not_scored():
    found, _ = observations(step_pair(1, 32, 10.0) + step_pair(2, 100, 10.0) + step_pair(3, 100, 10.0))
    result = replay(found, ("ema",))
    assert result["trainable"] == 2 and result["errors"]["ema"]["all"] == [pytest.approx(0.0)]


def test_mixed_path_steps_are_skipped():
    lanes = (ev.LaneInfo("a", "prefill", 128, 0, "gpu"), ev.LaneInfo("b", "prefill", 128, 0, "ane"))
    events = [ev.StepPlanned(0.0, 1, lanes, 2048, "contended", None, True, 0),
              ev.StepExecuted(0.1, 1, 30.0, 256, 256, 0, 2, 0.0, "mixed")]
    assert observations(events) == ([], 1)


def test_bucketed_beats_ema_when_time_depends_on_history():
    found, _ = observations(prefill_steps(400, seed=3))
    rows = summarize(replay(found, ("ema", "bucketed")))
    ema, bucketed = errors_by(rows, "ema"), errors_by(rows, "bucketed")
    assert bucketed["mean_abs_rel_error"] < ema["mean_abs_rel_error"]
    assert bucketed["p95_abs_rel_error"] < ema["p95_abs_rel_error"]
    assert {r["group"] for r in rows} >= {"all", "path=gpu", "width=1", "width=2", "width=3"}


def test_paths_are_reported_separately():
    found, _ = observations(prefill_steps(200, seed=4, ane_share=0.4))
    groups = {r["group"] for r in summarize(replay(found, ("bucketed",)))}
    assert {"path=gpu", "path=ane"} <= groups


def test_cli_replays_several_traces(tmp_path, capsys):
    first = write_events(prefill_steps(50, seed=1), tmp_path / "a.jsonl", capacity=10_000)
    second = write_events(simulate(SimConfig()), tmp_path / "b.jsonl", capacity=10_000)
    assert main([str(first), str(second), "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "| ema | all |" in out and "| bucketed | all |" in out
    assert (tmp_path / "p.json").exists()


def test_cli_refuses_an_overflowed_trace(tmp_path, capsys):
    trace = write_events(prefill_steps(10), tmp_path / "a.jsonl", capacity=10, dropped=10)
    assert main([str(trace)]) == 2
    assert "overflowed" in capsys.readouterr().err
