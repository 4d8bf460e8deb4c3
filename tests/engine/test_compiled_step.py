"""Single-row steps replayed through mx.compile give mlx-lm's tokens, and pad lanes never touch real KV."""

from __future__ import annotations

import pytest

from mlx_serve.compiled_step import lane_bucket, width_bucket
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest
from tests.engine.reference import StreamReaders, prompt_of, reference_tokens

LENGTHS = [3, 17, 40, 9, 64, 5, 33, 21, 90]


def test_buckets_cover_and_repeat():
    for n in range(1, 300):
        assert lane_bucket(n) >= n and lane_bucket(n) - n < max(8, n // 2 + 1)
        assert width_bucket(n) >= n
    assert {lane_bucket(n) for n in range(1, 65)} == {1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64}
    assert {width_bucket(n) for n in range(1, 600)} == {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768}


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_moe", "tiny_llama"])
def test_compiled_decode_matches_mlx_lm(fixture, request):
    """Staggered requests: lane counts move across buckets (pad lanes) and histories across widths."""
    path = request.getfixturevalue(fixture)
    prompts = [prompt_of(n, seed=i) for i, n in enumerate(LENGTHS)]
    engine = Engine.load(EngineConfig(model=str(path), row_ceiling=50, row_floor=1, block_size=4, compile_decode="on"))
    try:
        assert engine.runner.compiled is not None
        first_wave = [engine.submit(GenerationRequest(prompt_ids=tuple(p), max_tokens=16)) for p in prompts[:3]]
        readers = StreamReaders(first_wave)
        assert readers.started.wait(60)
        later = [engine.submit(GenerationRequest(prompt_ids=tuple(p), max_tokens=16)) for p in prompts[3:]]
        for i, handle in enumerate(later, start=3):
            readers.read(i, handle)
        results = readers.join()
        # alone, a short prompt's history crosses several table widths
        [alone] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt_of(5, seed=99)), max_tokens=40)])
        shapes = engine.runner.compiled.shapes
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_tokens(path, prompt, 16), f"request {i} (prompt {len(prompt)} tokens)"
    assert list(alone.token_ids) == reference_tokens(path, prompt_of(5, seed=99), 40)
    assert len({lanes for lanes, _ in shapes}) > 1 and len({width for _, width in shapes}) > 1, shapes


def test_history_buckets_cover_with_bounded_padding():
    from mlx_serve.runner import history_bucket

    seen = set()
    for end in range(1, 40_000, 7):
        padded = history_bucket(end, 1024)
        assert padded >= end and padded % 1024 == 0
        assert padded <= max(2 * end, 1024) and (end <= 8192 or padded <= 1.5 * end)
        seen.add(padded)
    assert sorted(p // 1024 for p in seen if p <= 16 * 1024) == [1, 2, 4, 8, 12, 16]
