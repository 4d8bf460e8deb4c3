"""Greedy output of the engine is token-identical to mlx-lm's own generation."""

from __future__ import annotations

import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest
from tests.engine.reference import generate_in_cuda_layout, prompt_of, reference_tokens, run_staggered

LENGTHS = [3, 17, 40, 9, 64, 5, 33, 21, 90]


def _engine(path, **kwargs) -> Engine:
    return Engine.load(EngineConfig(model=str(path), **kwargs))


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama", "tiny_qwen3_moe", "tiny_qwen2", "tiny_mistral"])
def test_single_request_matches_mlx_lm(fixture, request):
    path = request.getfixturevalue(fixture)
    prompt = prompt_of(29, seed=1)
    engine = _engine(path)
    try:
        [completion] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=24)])
    finally:
        engine.shutdown()
    assert list(completion.token_ids) == reference_tokens(path, prompt, 24)
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == len(completion.token_ids)


@pytest.mark.parametrize(
    ("fixture", "row_ceiling", "attention"),
    [
        ("tiny_qwen3", 7, "auto"),
        ("tiny_qwen3", 50, "auto"),
        ("tiny_qwen3", 7, "reference"),  # the yardstick path stays exact too
        ("tiny_qwen3_moe", 7, "auto"),
        ("tiny_qwen3_moe", 50, "auto"),
    ],
)
def test_concurrent_staggered_requests_match_mlx_lm(fixture, row_ceiling, attention, request):
    """9 requests of different lengths, arriving while others run, prefill cut at odd row budgets."""
    path = request.getfixturevalue(fixture)
    prompts = [prompt_of(n, seed=i) for i, n in enumerate(LENGTHS)]
    engine = _engine(path, row_ceiling=row_ceiling, row_floor=1, decode_attention=attention)
    try:
        results = run_staggered(engine, prompts, first=4, max_tokens=16)
        status = engine.status()
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_tokens(path, prompt, 16), f"request {i} (prompt {len(prompt)} tokens)"
    assert status["counters"]["steps"] > len(prompts)


@pytest.mark.parametrize("gather", ["slots", "table"])
def test_bucketed_prefill_history_matches_mlx_lm(gather, tiny_qwen3):
    """The CUDA layout of prefill lanes on the CPU: history padded to a bucket behind a mask, read through slots
    or through the block table (the kernel's plain-MLX twin); chunks of 7 rows so most lanes have history."""
    from mlx_serve.kernels.paged_gather import table_gather

    prompts = [prompt_of(n, seed=i) for i, n in enumerate(LENGTHS[:5])]
    engine = _engine(tiny_qwen3, row_ceiling=7, row_floor=1)
    completions = generate_in_cuda_layout(engine, prompts, 8, table_gather if gather == "table" else None)
    for prompt, tokens in zip(prompts, completions):
        assert tokens == reference_tokens(tiny_qwen3, prompt, 8)
