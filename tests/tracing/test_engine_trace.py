"""A real capture from the engine on the tiny model, read back by the report and the prediction analysis."""

from __future__ import annotations

import random

import pytest

from tracing import MemorySink
from tracing import events as ev
from tracing.jsonl import load
from tracing.prefill_prediction import main as prediction_main
from tracing.report import main as report_main


@pytest.fixture(scope="module")
def engine_capture(tiny_qwen3, tmp_path_factory):
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.types import GenerationRequest

    path = tmp_path_factory.mktemp("trace") / "engine.jsonl"
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=256, row_ceiling=256, row_floor=64,
                                      trace=MemorySink(path=path)))
    rng = random.Random(0)
    # short streams plus one long prompt: the long prefill is chunked beside the streams' decode lanes
    prompts = [[rng.randrange(1, 2000) for _ in range(n)] for n in (24, 40, 700, 16)]
    completions = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=12, ignore_eos=True)
                                   for p in prompts])
    engine.shutdown()  # closes the sink: the capture is written now, never during the workload
    return path, completions


def test_engine_capture_is_complete_and_counts_committed_tokens(engine_capture):
    path, completions = engine_capture
    capture = load(path)
    assert capture.refusal() is None
    tokens = [e for e in capture.events if isinstance(e, ev.TokenCommitted)]
    assert len(tokens) == sum(len(c.token_ids) for c in completions)
    spans = {e.name for e in capture.events if isinstance(e, ev.Span)}
    assert {"admission", "planning", "preparation", "submission", "consumption", "application"} <= spans
    steps = [e for e in capture.events if isinstance(e, ev.StepExecuted)]
    assert max(s.prefill_rows for s in steps) <= 256  # actual rows after the cut
    assert any(s.prefill_rows and s.decode_lanes for s in steps)  # the long prefill ran beside decoding


def test_report_and_prediction_tools_accept_the_engine_capture(engine_capture, tmp_path, capsys):
    path, _ = engine_capture
    assert report_main([str(path), "--png", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert prediction_main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "Step time by geometry" in out and "| ema | all |" in out
