"""Quantized checkpoints (written the way mlx-lm converts them) serve exactly like mlx-lm runs them."""

from __future__ import annotations

import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest
from tests.engine.reference import prompt_of, reference_tokens


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
