"""Embedding requests: a prompt's final hidden states pooled (last row, or the mean of all rows) and normalised equal
mlx-lm's own forward over the whole prompt, read in chunks beside decoding streams, after the prefix cache holds
the prompt, and after a preemption."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.types import GenerationRequest
from tests.engine.reference import load_reference, prompt_of


def reference_embedding(path, prompt: list[int], pooling: str) -> np.ndarray:
    model, _ = load_reference(str(path))
    hidden = model.model(mx.array(prompt)[None])[0].astype(mx.float32)
    vector = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
    return np.array(vector / mx.linalg.norm(vector))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_prompts_equal_mlx_lms_forward_in_chunks_beside_streams_and_after_a_cached_prefix(tiny_qwen3, pooling):
    prompts = [prompt_of(n, seed=70 + i) for i, n in enumerate((45, 8, 90))]
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=128, row_ceiling=16, row_floor=4))
    try:
        stream = iter(engine.submit(GenerationRequest(prompt_ids=tuple(prompt_of(20, seed=79)), max_tokens=60)))
        next(stream)  # a decoding stream: the prompts are read in 16-row chunks beside it
        # the first prompt is also generated from: its blocks are in the prefix cache for the embedding after it
        engine.generate([GenerationRequest(prompt_ids=tuple(prompts[0]), max_tokens=2)])
        done = engine.generate([GenerationRequest(prompt_ids=tuple(p), pooling=pooling) for p in prompts])
        assert list(stream)[-1].finish_reason == "length"
    finally:
        engine.shutdown()
    for prompt, completion in zip(prompts, done):
        np.testing.assert_allclose(completion.embedding, reference_embedding(tiny_qwen3, prompt, pooling), atol=2e-5)
    assert done[0].usage.cached_tokens == (32 if pooling == "last" else 0)  # the mean needs every row computed


def test_a_preempted_mean_starts_its_sum_again(tiny_qwen3):
    prompts = [prompt_of(60, seed=80 + i) for i in range(5)]
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=12, block_size=8, row_ceiling=16, row_floor=4))
    try:
        streams = [engine.submit(GenerationRequest(prompt_ids=tuple(p), max_tokens=30)) for p in prompts[:3]]
        done = engine.generate([GenerationRequest(prompt_ids=tuple(p), pooling="mean") for p in prompts[3:]])
        for stream in streams:
            list(stream)
        assert engine.status()["counters"]["preemptions"] > 0
    finally:
        engine.shutdown()
    for prompt, completion in zip(prompts[3:], done):
        np.testing.assert_allclose(completion.embedding, reference_embedding(tiny_qwen3, prompt, "mean"), atol=2e-5)


def test_an_unknown_pooling_is_refused(tiny_qwen3):
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=16))
    try:
        with pytest.raises(InvalidRequest, match="pooling must be last or mean"):
            engine.submit(GenerationRequest(prompt_ids=(1, 2), pooling="max"))
    finally:
        engine.shutdown()


def test_pooled_prompts_in_the_cuda_layout(tiny_qwen3):
    """As on CUDA: prompt chunks padded to query and history buckets, their history read through the block table."""
    from mlx_serve.kernels.paged_gather import table_gather

    prompts = [prompt_of(n, seed=90 + i) for i, n in enumerate((37, 70))]
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=128, row_ceiling=16, row_floor=4,
                                      compile_decode="on", warm_up=False))  # fmt: skip
    engine.runner.kv_bucket, engine.runner.prefill_gather = 32, table_gather
    try:
        done = engine.generate([GenerationRequest(prompt_ids=tuple(p), pooling=pooling) for p in prompts
                                for pooling in ("last", "mean")])  # fmt: skip
    finally:
        engine.shutdown()
    for completion, (prompt, pooling) in zip(done, [(p, k) for p in prompts for k in ("last", "mean")]):
        np.testing.assert_allclose(completion.embedding, reference_embedding(tiny_qwen3, prompt, pooling), atol=2e-5)
