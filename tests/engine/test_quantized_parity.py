"""Quantized checkpoints (written the way mlx-lm converts them) serve exactly like mlx-lm runs them."""

from __future__ import annotations

import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest
from tests.engine.reference import prompt_of, reference_tokens, run_staggered


@pytest.mark.parametrize("fixture", ["tiny_qwen3_4bit", "tiny_qwen3_8bit", "tiny_qwen3_moe_4bit"])
def test_quantized_greedy_parity_single_and_concurrent(fixture, request):
    path = request.getfixturevalue(fixture)
    prompts = [prompt_of(n, seed=50 + n) for n in (23, 7, 41, 16)]
    engine = Engine.load(EngineConfig(model=str(path), row_ceiling=24, row_floor=1))
    try:
        [single] = engine.generate([GenerationRequest(prompt_ids=tuple(prompts[0]), max_tokens=12)])
        concurrent = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=12) for p in prompts])
        weights = engine.loaded.weight_bytes
    finally:
        engine.shutdown()
    assert list(single.token_ids) == reference_tokens(path, prompts[0], 12)
    for prompt, completion in zip(prompts, concurrent):
        assert list(completion.token_ids) == reference_tokens(path, prompt, 12)
    assert weights > 0


def test_row_tiles_fill_contended_steps_and_keep_tokens(tiny_qwen3_4bit):
    """`row_quantum`: a contended step halved to its floor grows to end on a row tile, and the tokens stay
    mlx-lm's; auto is off without CUDA; a bad value is a clear error."""
    from mlx_serve import engine_setup
    from mlx_serve.errors import InvalidRequest
    from tracing.events import StepPlanned
    from tracing.sink import MemorySink

    sink = MemorySink()
    prompts = [prompt_of(n, seed=70 + n) for n in (5, 6, 200)]  # two streams, then a long prompt beside them
    config = EngineConfig(model=str(tiny_qwen3_4bit), row_ceiling=128, row_floor=1, row_quantum=8,
                          step_target_ms=1e-3, cost_model="ema", trace=sink, warm_up=False)  # fmt: skip
    engine = Engine.load(config)
    try:
        assert engine.scheduler.config.row_quantum == 8
        outputs = run_staggered(engine, prompts, first=2, max_tokens=16)  # the long prompt joins two streams
    finally:
        engine.shutdown()
    for index, prompt in enumerate(prompts):
        assert outputs[index] == reference_tokens(tiny_qwen3_4bit, prompt, 16)
    halved = [e for e in sink.events if isinstance(e, StepPlanned) and e.halvings and e.row_budget]
    assert halved, "no contended step was halved"
    for event in halved:
        decode_lanes = sum(1 for lane in event.lanes if lane.rows == 1)
        assert (event.row_budget + decode_lanes) % 8 == 0 and event.row_budget >= 8 - decode_lanes
    assert engine_setup.row_quantum("auto", quantized=True) == 1  # no CUDA here
    with pytest.raises(InvalidRequest, match="row_quantum must be a whole number"):
        engine_setup.row_quantum(0, quantized=True)
