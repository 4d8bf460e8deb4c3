from __future__ import annotations

import time

from tracing import NULL_SINK, MemorySink, sink_from_env
from tracing.events import TokenCommitted
from tracing.jsonl import load


def test_null_sink_never_reads_the_clock(monkeypatch):
    def forbidden() -> float:
        raise AssertionError("the null sink read the clock")

    monkeypatch.setattr(time, "perf_counter", forbidden)
    monkeypatch.setattr(time, "monotonic", forbidden)
    assert NULL_SINK.enabled is False
    assert NULL_SINK.now() == 0.0
    NULL_SINK.emit(TokenCommitted(0.0, "r", 0))
    NULL_SINK.close()


def test_memory_sink_is_bounded_and_counts_overflow(tmp_path):
    sink = MemorySink(capacity=3, path=tmp_path / "t.jsonl")
    for i in range(5):
        sink.emit(TokenCommitted(sink.now(), "r", i))
    assert len(sink.events) == 3 and sink.dropped == 2 and sink.overflowed
    assert not (tmp_path / "t.jsonl").exists(), "nothing is written during a workload"
    sink.close()
    capture = load(tmp_path / "t.jsonl")
    assert capture.dropped == 2 and capture.capacity == 3
    assert "overflowed" in capture.refusal()


def test_memory_sink_clock_is_monotonic():
    sink = MemorySink()
    first = sink.now()
    assert sink.now() >= first >= 0.0


def test_sink_from_env_is_null_without_a_path():
    assert sink_from_env(environ={}) is NULL_SINK


def test_sink_from_env_reads_path_and_capacity(tmp_path):
    target = tmp_path / "cap.jsonl"
    sink = sink_from_env(environ={"MLX_SERVE_TRACE": str(target), "MLX_SERVE_TRACE_CAPACITY": "7"})
    assert isinstance(sink, MemorySink) and sink.capacity == 7 and sink.path == target
    sink.emit(TokenCommitted(sink.now(), "r", 0))
    sink.close()
    sink.close()  # idempotent: the atexit hook after a clean close must not overwrite it as incomplete
    capture = load(target)
    assert capture.complete and capture.refusal() is None and len(capture.events) == 1


def test_flag_path_wins_over_env(tmp_path):
    sink = sink_from_env(path=tmp_path / "flag.jsonl", environ={"MLX_SERVE_TRACE": str(tmp_path / "env.jsonl")})
    assert sink.path == tmp_path / "flag.jsonl"
    sink.close()


def test_unclosed_capture_is_dumped_as_incomplete(tmp_path):
    sink = sink_from_env(environ={"MLX_SERVE_TRACE": str(tmp_path / "x.jsonl")})
    sink.close(complete=False)  # what the atexit hook does when the engine never shut down
    assert "did not shut down cleanly" in load(tmp_path / "x.jsonl").refusal()
