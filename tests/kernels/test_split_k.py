"""Quantized products split over K on MLX's CUDA backend: its batched 4-bit GEMM (`qmm_sm80` with a batch of
weight slices) against the whole product, then greedy tokens through an engine that splits every projection.
The CPU tests (tests/engine/test_quantized_rows.py) check the same layout against MLX's CPU kernels."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_serve import quantized_rows
from mlx_serve.quantized_rows import RowsQuantizedLinear, split_k

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the split-K path is CUDA's (auto = on there)")


def _layer(in_dims: int, out_dims: int, seed: int) -> RowsQuantizedLinear:
    rng = np.random.default_rng(seed)
    dense = nn.Linear(in_dims, out_dims, bias=False)
    dense.weight = mx.array(rng.standard_normal((out_dims, in_dims)).astype(np.float32) * 0.02).astype(mx.bfloat16)
    layer = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4)
    layer.__class__ = RowsQuantizedLinear
    return layer


@on_cuda
@pytest.mark.device
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 200])
@pytest.mark.parametrize(("in_dims", "out_dims", "splits"), [(4096, 4096, 8), (12288, 4096, 8), (4096, 6144, 4), (256, 4096, 2)])
def test_split_product_equals_the_whole_product_on_cuda(rows, in_dims, out_dims, splits):
    layer = _layer(in_dims, out_dims, seed=rows)
    x = mx.array(np.random.default_rng(rows + 1).standard_normal((rows, 1, in_dims)).astype(np.float32))
    x = x.astype(mx.bfloat16)
    want = layer(x).astype(mx.float32)
    mx.eval(want)
    split_k(layer, splits)
    got = layer(x).astype(mx.float32)
    assert got.shape == want.shape
    # each slice's product rounds to bf16 before the sum: a few bf16 ulps of the largest output
    scale = float(mx.abs(want).max())
    assert float(mx.abs(got - want).max()) <= 4 * 2**-8 * scale


@on_cuda
@pytest.mark.device
@pytest.mark.parametrize("mode", ["on", "all"])
def test_engine_with_split_projections_matches_mlx_lm_on_cuda(tiny_qwen3_4bit, monkeypatch, mode):
    """The tiny checkpoint's float32 activations take MLX's generic quantized kernels on the GPU (the bf16 GEMM is
    the test above), batched over the slices; the GPU's sums are not in mlx-lm's order: most greedy tokens agree."""
    from mlx_serve.engine import Engine, EngineConfig
    from tests.engine.reference import prompt_of, reference_tokens, run_staggered

    monkeypatch.setattr(quantized_rows, "SPLIT_MIN_WIDTH", 128)  # down_proj: 2 slices (64 wide: MLX is wrong)
    prompts = [prompt_of(n, seed=140 + n) for n in (23, 7, 41)]
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3_4bit), split_quantized_k=mode, fuse_mixed="on"))
    try:
        results = run_staggered(engine, prompts, first=2, max_tokens=8)
        assert engine.runner.model.model.layers[0].mlp.down_proj.k_splits > 1
    finally:
        engine.shutdown()
    agree = sum(a == b for i, p in enumerate(prompts) for a, b in zip(results[i], reference_tokens(tiny_qwen3_4bit, p, 8)))
    assert agree >= 0.9 * 8 * len(prompts)
