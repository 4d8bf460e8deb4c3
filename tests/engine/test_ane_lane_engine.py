"""`--ane-lane cpu`: prefill chunks placed on the ANE path run on the labelled MLX CPU stand-in beside the GPU
lanes, produce the GPU-only run's tokens, show up in traces, and train only their own cost cells."""

from __future__ import annotations

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest
from scheduler.cost_models import PATHS, BucketedCostModel
from scheduler.plan import Path
from tests.engine.reference import StreamReaders, prompt_of
from tracing.events import Span, StepExecuted, StepPlanned
from tracing.sink import MemorySink

LONG = [150, 210, 180, 260, 130, 240]


def _workload(engine: Engine) -> list[tuple[int, ...]]:
    """Two streams start decoding, then six long prompts arrive together (contended, several prefill lanes)."""
    streams = [engine.submit(GenerationRequest(prompt_ids=tuple(prompt_of(8, seed=70 + i)), max_tokens=60))
               for i in range(2)]
    readers = StreamReaders(streams)
    assert readers.started.wait(60)
    longs = [GenerationRequest(prompt_ids=tuple(prompt_of(n, seed=80 + i)), max_tokens=8) for i, n in enumerate(LONG)]
    completions = engine.generate(longs)
    tokens = readers.join()
    tokens.update({i: list(c.token_ids) for i, c in enumerate(completions, start=2)})
    return [tuple(tokens[i]) for i in range(len(tokens))]


def _run(path, ane_lane: str, sink=None):
    config = EngineConfig(model=str(path), ane_lane=ane_lane, cost_model="bucketed", row_ceiling=256, row_floor=64,
                          trace=sink)
    engine = Engine.load(config)
    try:
        return _workload(engine), engine.scheduler.cost_model
    finally:
        engine.shutdown()


def test_ane_stand_in_matches_gpu_only_and_keeps_paths_apart(tiny_qwen3):
    gpu_only, _ = _run(tiny_qwen3, "off")
    sink = MemorySink()
    with_lane, model = _run(tiny_qwen3, "cpu", sink)
    assert with_lane == gpu_only

    planned_paths = {lane.path for e in sink.events if isinstance(e, StepPlanned) for lane in e.lanes}
    assert planned_paths == {"gpu", "ane"}
    lane_spans = [e for e in sink.events if isinstance(e, Span) and e.name == "ane_chunk"]
    assert lane_spans and all(s.attrs["lane"] == "mlx-cpu-standin" for s in lane_spans)
    assert any(e.path == "mixed" for e in sink.events if isinstance(e, StepExecuted))

    assert isinstance(model, BucketedCostModel)
    ane_cells = [i for i in range(len(model.samples)) if i % len(PATHS) == PATHS.index(Path.ANE)]
    gpu_cells = [i for i in range(len(model.samples)) if i % len(PATHS) == PATHS.index(Path.GPU)]
    assert sum(model.samples[i] for i in ane_cells) >= 1  # the lane's own times trained its own cells
    assert sum(model.samples[i] for i in gpu_cells) >= 1
