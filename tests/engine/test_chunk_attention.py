"""Prefill chunks attending through two matmuls and a softmax (`--chunk-attention matmul`) give MLX's attention."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve import engine_setup, ragged
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.kernels.paged_attention import cuda_available
from mlx_serve.kernels.paged_gather import table_gather
from mlx_serve.ragged import MatmulChunkAttention, sdpa_chunk_attention
from tests.engine.reference import generate_in_cuda_layout, prompt_of, reference_tokens


def _chunk(rows: int, history: int, heads: int, kv_heads: int, dtype: mx.Dtype, seed: int):
    """A chunk's queries, its padded history and the bucketed lane's mask (the last `rows` positions of `history`
    are the chunk; the history is padded by 16 masked slots, as `_bucketed_lane` pads it)."""
    rng = np.random.default_rng(seed)
    padded = history + 16
    q = mx.array(rng.standard_normal((1, heads, rows, 64)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((1, kv_heads, padded, 64)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, kv_heads, padded, 64)).astype(np.float32)).astype(dtype)
    query_pos = mx.arange(history - rows, history)[:, None]
    visible = mx.arange(padded)[None, :] <= query_pos
    mask = mx.where(visible, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))[None, None]
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (16, 2)])
def test_matmul_attention_equals_sdpa(dtype, heads, kv_heads):
    q, k, v, mask = _chunk(rows=24, history=200, heads=heads, kv_heads=kv_heads, dtype=dtype, seed=heads)
    want = sdpa_chunk_attention(q, k, v, 0.125, mask)
    got = MatmulChunkAttention()(q, k, v, 0.125, mask)
    assert got.shape == want.shape == q.shape and got.dtype == dtype
    tolerance = 1e-5 if dtype == mx.float32 else 1e-2
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), rtol=tolerance, atol=tolerance).item()


def test_matmul_attention_leaves_large_chunks_and_maskless_lanes_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(ragged, "sdpa_chunk_attention", lambda *a: calls.append(a[0].shape[2]) or a[0])
    attention = MatmulChunkAttention(max_rows=16)
    q, k, v, mask = _chunk(rows=24, history=100, heads=4, kv_heads=2, dtype=mx.float32, seed=0)
    attention(q, k, v, 0.125, mask)  # more rows than max_rows
    attention(q[:, :, :8], k[:, :, :100], v[:, :, :100], 0.125, "causal")  # exact history: no mask array
    assert calls == [24, 8]
    out = attention(q[:, :, :8], k, v, 0.125, mask[:, :, :8])
    assert calls == [24, 8] and out.shape == (1, 4, 8, 64)


def test_engine_with_matmul_chunk_attention_matches_mlx_lm(tiny_qwen3, monkeypatch):
    """The CUDA layout on the CPU (history padded to a bucket behind a mask, read through the block table), chunks
    of 7 rows beside decoding streams: mlx-lm's greedy tokens, and the chunks took the matmul path."""
    taken = []
    original = MatmulChunkAttention.__call__
    monkeypatch.setattr(MatmulChunkAttention, "__call__", lambda self, q, *a: taken.append(q.shape[2]) or original(self, q, *a))
    prompts = [prompt_of(n, seed=200 + i) for i, n in enumerate((45, 12, 70, 9, 33))]
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), row_ceiling=7, row_floor=1, chunk_attention="matmul",
                                      warm_up=False))  # fmt: skip
    for prompt, tokens in zip(prompts, generate_in_cuda_layout(engine, prompts, 8, table_gather)):
        assert tokens == reference_tokens(tiny_qwen3, prompt, 8)
    assert taken, "no chunk took the matmul attention"
    with pytest.raises(InvalidRequest, match="chunk_attention must be auto, sdpa, matmul or paged"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), chunk_attention="flash"))


def test_auto_chunk_attention_takes_matmuls_only_for_long_histories_within_the_score_budget():
    """The CUDA rule: 4 history tokens per score row (query head x row), at most 256 rows and 2**27 scores."""
    rule = ragged.CUDA_CHUNK_ATTENTION
    assert rule.takes(heads=32, rows=64, length=8192)  # 8B: 64-row chunk over 8k (cuDNN 0.21, matmuls 0.15 ms)
    assert not rule.takes(heads=32, rows=128, length=8192)  # 128 rows over 8k: cuDNN's 0.24 beat 0.25 ms
    assert rule.takes(heads=16, rows=256, length=16384) and not rule.takes(heads=16, rows=512, length=32768)
    assert not rule.takes(heads=64, rows=256, length=1 << 16)  # 2**30 scores: over the budget
    on_cuda = cuda_available()
    auto = engine_setup.chunk_attention("auto")
    if on_cuda:  # the paged kernel, falling back to the rule for a lane it does not take
        assert isinstance(auto, ragged.PagedChunkAttention) and auto.fallback is rule
    else:
        assert auto is ragged.sdpa_chunk_attention
    assert engine_setup.chunk_attention("matmul").history_per_score_row == 0


@pytest.mark.parametrize("rows_first", [True, False])
def test_engine_with_paged_chunk_attention_matches_mlx_lm(tiny_qwen3, monkeypatch, rows_first):
    """`--chunk-attention paged` on the CPU (the kernel's MLX-ops reference reading the pool through the block
    table, each row's positions passed down): chunks of 7 rows beside decoding streams give mlx-lm's greedy
    tokens, every chunk went through the paged path with its queries as the step lays them (`[rows, heads, D]`,
    no pad rows, the decode rows' attention passed as `head` to lead the output; or `[1, heads, rows, D]` copies
    with `PAGED_ROWS_FIRST` off, the A/B's other side), and the scheduler counts exact (unpadded) history."""
    from dataclasses import replace

    from mlx_serve.kernels import chunk_attention as paged

    monkeypatch.setattr(ragged, "PAGED_ROWS_FIRST", rows_first)

    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), row_ceiling=7, row_floor=1, chunk_attention="paged",
                                      warm_up=False))  # fmt: skip
    chunk = engine.runner.chunk_attention
    assert isinstance(chunk, ragged.PagedChunkAttention) and chunk.attend is paged.reference_chunk_attention
    assert not engine.scheduler.config.pads_history
    seen = []

    def attend(q, *args, **kwargs):
        rows = q.shape[0] if q.ndim == 3 else q.shape[2]
        head = kwargs.get("head")
        seen.append((q.ndim, rows, args[4].shape[0], 0 if head is None else head.shape[0]))
        if head is not None:
            assert head.shape[1:] == q.shape[1:] and head.dtype == q.dtype
        return paged.reference_chunk_attention(q, *args, **kwargs)

    engine.runner.chunk_attention = replace(chunk, attend=attend)
    prompts = [prompt_of(n, seed=300 + i) for i, n in enumerate((45, 12, 70, 9, 33))]
    for prompt, tokens in zip(prompts, generate_in_cuda_layout(engine, prompts, 8, table_gather)):
        assert tokens == reference_tokens(tiny_qwen3, prompt, 8)
    layout = 3 if rows_first else 4
    assert seen and all(ndim == layout and 1 <= rows <= min(7, positions) for ndim, rows, positions, _ in seen)
    heads = [ahead for *_, ahead in seen]
    assert (max(heads) > 0) if rows_first else not any(heads)  # decoding streams beside chunks: their rows lead


def test_paged_chunk_attention_takes_lanes_with_a_table_positions_and_few_enough_head_rows():
    """The kernel takes a lane read through its block table with a position for each of its query rows (q
    `[rows, heads, D]`), up to `max_head_rows` (rows x query heads, however many a kv head), or `long_head_rows`
    over a long enough table; any other lane attends through the fallback."""
    chunk = ragged.PagedChunkAttention(lambda *a, **k: None, lambda q, keys, size: True, max_head_rows=4096)
    keys = mx.zeros((64, 8, 64))
    table, length = mx.zeros((4,), dtype=mx.int32), mx.array([40, 64], dtype=mx.int32)

    def lane(rows: int, positions: int | None, with_table: bool = True) -> ragged.LaneRows:
        return ragged.LaneRows(0, rows, mx.zeros((0,), dtype=mx.int32), None, table if with_table else None, length,
                               64, rows, None if positions is None else mx.arange(positions))  # fmt: skip

    q = mx.zeros((128, 32, 64))  # 32 query heads: 4,096 head rows
    assert chunk.takes(q, keys, lane(128, 128), 16)
    assert chunk.takes(q, keys, lane(128, 192), 16)  # positions padded to a bucket: the first 128 are read
    assert not chunk.takes(mx.zeros((192, 32, 64)), keys, lane(192, 192), 16)  # 6,144 head rows
    # 30B-A3B's grouping (8 query heads a kv head) counts as 8B's (4): the same rows of the same query heads
    assert chunk.takes(q, mx.zeros((64, 4, 64)), lane(128, 128), 16)
    assert not chunk.takes(mx.zeros((192, 32, 64)), mx.zeros((64, 4, 64)), lane(192, 192), 16)
    assert chunk.takes(mx.zeros((256, 16, 64)), keys, lane(256, 256), 16)  # 0.6B's 16 heads: twice the rows
    assert ragged.PagedChunkAttention(chunk.attend, chunk.supports).takes(mx.zeros((192, 32, 64)), keys,
                                                                        lane(192, 192), 16)  # fmt: skip
    assert not chunk.takes(q, keys, lane(128, 127), 16)  # a row without a position
    assert not chunk.takes(q, keys, lane(128, None), 16) and not chunk.takes(q, keys, lane(128, 128, False), 16)
    # up to `long_head_rows` where the table holds at least `long_history` tokens (4 blocks of 16 here)
    wide = ragged.PagedChunkAttention(chunk.attend, chunk.supports, max_head_rows=4096, long_head_rows=6144,
                                      long_history=64)  # fmt: skip
    assert wide.takes(mx.zeros((192, 32, 64)), keys, lane(192, 192), 16)
    assert not wide.takes(mx.zeros((256, 32, 64)), keys, lane(256, 256), 16)  # 8,192 head rows
    assert not replace(wide, long_history=80).takes(mx.zeros((192, 32, 64)), keys, lane(192, 192), 16)


@pytest.mark.parametrize("rows_first", [True, False])
def test_warm_up_runs_the_paged_kernel_in_each_form_a_step_may_launch(tiny_qwen3, monkeypatch, rows_first):
    """One pass and split histories, each with and without the in-place ordering input and (rows first) with and
    without decode rows leading the output, queries laid out as steps lay them: every form compiles at first use
    on CUDA (a contended run's streams stalled 4.1 s on it), so the warm-up runs each once."""
    from dataclasses import replace

    from mlx_serve.kernels import chunk_attention as paged

    monkeypatch.setattr(ragged, "PAGED_ROWS_FIRST", rows_first)
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), chunk_attention="paged", warm_up=False))
    try:
        calls = []

        def attend(q, keys, values, table, length, positions, scale, block_size, after=None, head=None):
            assert q.ndim == (3 if ragged.PAGED_ROWS_FIRST else 4)  # as `RaggedLayerCache` passes them
            calls.append((table.shape[0] * block_size, after is not None, head is not None))
            return paged.reference_chunk_attention(q, keys, values, table, length, positions, scale, block_size,
                                                   head=head)  # fmt: skip

        runner = engine.runner
        runner.kv_bucket, runner.prefill_gather = 32, table_gather
        runner.chunk_attention = replace(runner.chunk_attention, attend=attend)
        size = engine.pool.block_size
        forms = [(tokens, after, head) for tokens in (size, 1024) for after in (False, True)
                 for head in ((False, True) if rows_first else (False,))]  # fmt: skip
        assert runner.warm_paged_chunk_attention() == len(forms) == (8 if rows_first else 4)
        assert sorted(calls) == forms
        runner.chunk_attention = sdpa_chunk_attention
        assert runner.warm_paged_chunk_attention() == 0
    finally:
        engine.shutdown()
