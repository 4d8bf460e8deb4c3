from __future__ import annotations

import json

import pytest
from trace_factory import SimConfig, simulate

from tracing.events import LaneInfo, Span, StepPlanned
from tracing.jsonl import CaptureError, load, write_events


def test_round_trip_preserves_every_event(tmp_path):
    events = simulate(SimConfig(ane_every=2))
    write_events(events, tmp_path / "t.jsonl", capacity=100_000)
    capture = load(tmp_path / "t.jsonl")
    assert capture.events == events
    assert capture.refusal() is None and capture.unknown_kinds == ()


def test_nested_lanes_and_attrs_survive(tmp_path):
    lane = LaneInfo("a", "prefill", 64, 128, "ane")
    planned = StepPlanned(1.0, 3, (lane,), 512, "halved:2", 40.0, True, 2, overtakes=("b",), preempted=())
    span = Span("ane_prefill", 1.0, 1.5, 3, {"timing": "host notification/report interval"})
    write_events([planned, span], tmp_path / "t.jsonl", capacity=10)
    assert load(tmp_path / "t.jsonl").events == [planned, span]


def test_every_line_names_its_kind(tmp_path):
    write_events(simulate(), tmp_path / "t.jsonl", capacity=100_000)
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert kinds[0] == "capture_header" and kinds[-1] == "capture_footer"
    assert {"step_planned", "step_executed", "span", "token", "request_arrived", "request_finished"} <= set(kinds)


def test_torn_file_has_no_footer_and_is_refused(tmp_path):
    path = write_events(simulate(), tmp_path / "t.jsonl", capacity=100_000)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # killed mid-dump
    capture = load(path)
    assert not capture.has_footer
    assert "no footer" in capture.refusal()


def test_unknown_kinds_are_kept_out_but_named(tmp_path):
    path = write_events([], tmp_path / "t.jsonl", capacity=10)
    lines = path.read_text().splitlines()
    lines.insert(1, json.dumps({"kind": "from_the_future", "t": 0}))
    path.write_text("\n".join(lines) + "\n")
    assert load(path).unknown_kinds == ("from_the_future",)


def test_not_a_trace_is_an_error(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(CaptureError):
        load(tmp_path / "x.jsonl")
