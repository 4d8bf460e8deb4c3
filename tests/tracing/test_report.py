from __future__ import annotations

import math

import pytest
from trace_factory import SimConfig, simulate

from tracing import analysis
from tracing import events as ev
from tracing.jsonl import write_events
from tracing.report import build_report, main


@pytest.fixture(scope="module")
def sim_events() -> list:
    return simulate(SimConfig(ane_every=3))


def test_ttft_and_gaps_come_from_committed_tokens():
    events = [
        ev.RequestArrived(1.0, "a", 10, 3, 1),
        ev.TokenCommitted(1.5, "a", 0),
        ev.TokenCommitted(1.6, "a", 1),
        ev.TokenCommitted(2.0, "a", 2),
        ev.RequestFinished(2.0, "a", "length", 10, 3, 0),
    ]
    report = build_report(events)
    (request,) = report["requests"]
    assert request["ttft_ms"] == pytest.approx(500.0)
    assert request["gap_max_ms"] == pytest.approx(400.0)
    assert request["gap_p50_ms"] == pytest.approx(250.0)
    assert report["committed_tokens"] == 3


def test_idle_gaps_are_separated_from_active_gaps():
    def step(sid: int, end: float) -> ev.StepExecuted:
        return ev.StepExecuted(end, sid, 100.0, 1, 0, 1, 0, 0.0, "gpu")

    events = [
        ev.RequestArrived(0.0, "a", 4, 2, 1), step(1, 0.1), step(2, 0.25),  # 50 ms gap while a is active
        ev.RequestFinished(0.25, "a", "length", 4, 2, 0),
        ev.RequestArrived(5.0, "b", 4, 1, 1), step(3, 5.1), ev.RequestFinished(5.1, "b", "length", 4, 1, 0),
    ]
    timelines = analysis.request_timelines(events)
    gaps = analysis.engine_gaps(events, timelines)
    assert gaps["active_ms"].count == 1 and gaps["active_ms"].max == pytest.approx(50.0)
    assert gaps["idle_ms"].count == 1 and gaps["idle_ms"].max == pytest.approx(4750.0)


def test_simulated_workload_report(sim_events):
    report = build_report(sim_events)
    by_id = {r["request_id"]: r for r in report["requests"]}
    assert by_id["long"]["ttft_ms"] > by_id["interactive-2"]["ttft_ms"]
    assert report["engine_gaps"]["idle_ms"]["count"] == 1  # the deliberate pause before the late request
    assert report["engine_gaps"]["idle_ms"]["max"] >= 500.0
    assert report["budget"]["steps"] == sum(isinstance(e, ev.StepPlanned) for e in sim_events)
    assert {"admission", "planning", "preparation", "submission", "consumption", "application"} <= set(
        report["spans"]
    )
    paths = {g["path"] for g in report["step_time_by_geometry"]}
    assert {"gpu", "ane"} <= paths
    steps = report["steps"]
    assert len(steps) == sum(isinstance(e, ev.StepExecuted) for e in sim_events)
    assert all(s["rows"] == s["prefill_rows"] + s["decode_lanes"] for s in steps)
    assert all(sum(lane["rows"] for lane in s["lanes"]) == s["rows"] for s in steps)  # lanes after the cut


def test_budget_halvings_are_counted():
    lane = ev.LaneInfo("a", "prefill", 128, 0, "gpu")
    events = [ev.StepPlanned(0.0, 1, (lane,), 512, "halved:2", 90.0, True, 2),
              ev.StepPlanned(0.1, 2, (lane,), 2048, "uncontended", None, False, 0)]
    budget = analysis.budget_summary(events)
    assert budget.total_halvings == 2 and budget.halved_steps == 1 and budget.budgets == {512: 1, 2048: 1}


def test_percentile_interpolates():
    assert analysis.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isnan(analysis.percentile([], 95))


def test_cli_writes_report_and_png(tmp_path, sim_events, capsys):
    trace = write_events(sim_events, tmp_path / "t.jsonl", capacity=100_000)
    assert main([str(trace), "--json", str(tmp_path / "r.json")]) == 0
    png = tmp_path / "t.timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "Step time by geometry" in out and "host notification/report interval" in out
    assert (tmp_path / "r.json").exists()


def test_cli_refuses_an_overflowed_capture(tmp_path, sim_events, capsys):
    trace = write_events(sim_events, tmp_path / "t.jsonl", capacity=100, dropped=len(sim_events) - 100)
    assert main([str(trace), "--no-png"]) == 2
    assert "overflowed" in capsys.readouterr().err


def test_cli_refuses_a_capture_that_did_not_end_cleanly(tmp_path, sim_events, capsys):
    trace = write_events(sim_events, tmp_path / "t.jsonl", capacity=100_000, complete=False)
    assert main([str(trace), "--no-png"]) == 2
    assert "incomplete" in capsys.readouterr().err


def test_cli_refuses_open_requests_and_uncommitted_counts(tmp_path, capsys):
    events = [
        ev.RequestArrived(0.0, "open", 4, 8, 1), ev.TokenCommitted(0.1, "open", 0),
        ev.RequestArrived(0.0, "over", 4, 8, 1), ev.TokenCommitted(0.1, "over", 0),
        ev.RequestFinished(0.2, "over", "cancelled", 4, 3, 0),  # counts 3, committed 1
    ]
    trace = write_events(events, tmp_path / "t.jsonl", capacity=100)
    assert main([str(trace), "--no-png"]) == 2
    err = capsys.readouterr().err
    assert "open: arrived but never finished" in err and "1 were committed" in err


def test_cli_refuses_a_file_that_is_not_a_trace(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text("not json\n")
    assert main([str(tmp_path / "x.jsonl")]) == 2
    assert "error:" in capsys.readouterr().err
