"""4-bit steps of many rows through quantized tiles: the CUDA kernel's reference (dequantize, then matmul) on the
CPU gives mlx-lm's tokens, whole and with weights split over K; which linears take it; the kernel's K split."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import load

from mlx_serve import quantized_rows
from mlx_serve.config import EngineConfig
from mlx_serve.engine import Engine
from mlx_serve.errors import InvalidRequest
from mlx_serve.kernels import dequantize, quantized_tiles
from tests.engine.test_fused_decode import assert_fused_parity, assert_parity


@pytest.fixture
def counted_tiles(monkeypatch):
    """Products through the reference tiles, counted by rows; tiles from 8 rows (the tiny model's steps are short)."""
    rows = []

    def matmul(x, *args):
        rows.append(x.shape[0])
        return quantized_rows.reference_matmul(x, *args)

    counted = quantized_rows.QuantizedTiles(matmul, quantized_rows.affine_with_biases)
    monkeypatch.setattr(quantized_rows, "REFERENCE_TILES", counted)
    monkeypatch.setattr(quantized_rows, "TILES_FROM_ROWS", 8)
    return rows


def test_the_reference_equals_the_quantized_matmul_in_float32_whole_and_split(tiny_qwen3_4bit):
    model, _ = load(str(tiny_qwen3_4bit))
    quantized_rows.fold_quantized_rows(model)
    proj = model.model.layers[0].mlp.down_proj
    x = mx.random.normal((40, proj.scales.shape[-1] * proj.group_size), key=mx.random.key(3))
    want = nn.QuantizedLinear.__call__(proj, x)
    args = (proj.group_size, proj.bits)
    assert mx.allclose(quantized_rows.reference_matmul(x, proj.weight, proj.scales, proj.biases, *args), want,
                       atol=1e-5).item()  # fmt: skip
    quantized_rows.split_k(proj, 2)
    assert proj.weight.ndim == 3
    assert mx.allclose(quantized_rows.reference_matmul(x, proj.weight, proj.scales, proj.biases, *args), want,
                       atol=1e-5).item()  # fmt: skip


def test_eager_steps_through_quantized_tiles_match_mlx_lm(tiny_qwen3_4bit, counted_tiles):
    assert_parity(tiny_qwen3_4bit, seed=131, compile_decode="off", quantized_tiles="on")
    assert counted_tiles and min(counted_tiles) >= 8, "no step of 8 rows or more took the tiles, or a shorter one did"


@pytest.mark.parametrize("split", ["off", "all"])
def test_fused_steps_through_quantized_tiles_match_mlx_lm(tiny_qwen3_4bit, counted_tiles, narrow_k_splits, split):
    """The fused forward's q/k/v and gate/up, whole or split over K (the kernel reads the split layout as is)."""
    engine = assert_fused_parity(tiny_qwen3_4bit, seed=132, quantized_tiles="on", fuse_mixed="on",
                                 split_quantized_k=split)  # fmt: skip
    assert counted_tiles
    qkv = engine.runner.compiled.fused.layers[0].qkv
    assert (qkv.k_splits > 1) == (split == "all") and qkv.tiles is not None


def test_quantized_tiles_off_and_bad_values(tiny_qwen3_4bit, counted_tiles):
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3_4bit), quantized_tiles="off"))
    engine.shutdown()
    linears = [m for _, m in engine.runner.model.named_modules() if isinstance(m, quantized_rows.RowsQuantizedLinear)]
    assert linears and all(m.tiles is None for m in linears)
    with pytest.raises(InvalidRequest, match="quantized_tiles must be auto, on or off"):
        Engine.load(EngineConfig(model=str(tiny_qwen3_4bit), quantized_tiles="kernel"))


def test_the_kernel_takes_only_4bit_affine_bf16_weights_of_whole_tiles():
    n, k = 256, 512
    w, s = mx.zeros((n, k // 8), mx.uint32), mx.zeros((n, k // 64), mx.bfloat16)
    assert quantized_tiles.supports(w, s, s, 64, 4)
    assert quantized_tiles.supports(w[None], s[None], s[None], 64, 4)  # split over K
    assert not quantized_tiles.supports(w, s, None, 64, 4)  # no biases (not affine)
    assert not quantized_tiles.supports(w, s, s, 32, 4)  # a K step would cross groups
    assert not quantized_tiles.supports(w, s, s, 64, 8)
    assert not quantized_tiles.supports(w, s.astype(mx.float32), s.astype(mx.float32), 64, 4)
    assert not quantized_tiles.supports(w[:200], s[:200], s[:200], 64, 4)  # N not a multiple of 128
    assert not quantized_tiles.supports(w, s, s, 64, 4, mode="mxfp4")
    with pytest.raises(ValueError, match="bf16 rows"):
        quantized_tiles.quantized_tiles_matmul(mx.zeros((64, k)), w, s, s, 64)


def test_many_rows_dequantize_once_fewer_run_the_tiles_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(quantized_tiles, "dense_matmul", lambda x, *rest: calls.append(("dense", x.shape[0])))
    monkeypatch.setattr(quantized_tiles, "quantized_tiles_matmul", lambda x, *rest: calls.append(("tiles", x.shape[0])))
    w, s = mx.zeros((128, 64), mx.uint32), mx.zeros((128, 8), mx.bfloat16)
    for rows in (quantized_tiles.DENSE_FROM_ROWS - 1, quantized_tiles.DENSE_FROM_ROWS):
        quantized_tiles.many_rows_matmul(mx.zeros((rows, 512), mx.bfloat16), w, s, s, 64)
    assert calls == [("tiles", quantized_tiles.DENSE_FROM_ROWS - 1), ("dense", quantized_tiles.DENSE_FROM_ROWS)]


def test_the_dequantize_kernel_takes_4bit_affine_bf16_weights():
    w, s = mx.zeros((256, 64), mx.uint32), mx.zeros((256, 8), mx.bfloat16)
    assert dequantize.supports(w, s, s, 64, 4) and dequantize.supports(w[None], s[None], s[None], 64, 4)
    assert dequantize.supports(w, mx.zeros((256, 16), mx.bfloat16), mx.zeros((256, 16), mx.bfloat16), 32, 4)
    assert not dequantize.supports(w, s, None, 64, 4)
    assert not dequantize.supports(w, s, s, 64, 8)
    assert not dequantize.supports(w, s.astype(mx.float16), s.astype(mx.float16), 64, 4)
    with pytest.raises(ValueError, match="4-bit"):
        dequantize.dense_matmul(mx.zeros((4, 512), mx.bfloat16), w, s, s, 64, bits=8)


@pytest.mark.parametrize(
    ("n", "rows", "k", "parts"),
    [
        (4096, 128, 4096, 8),  # 64 tiles -> 512 blocks, parts of 512 columns
        (4096, 2048, 4096, 1),  # 1,024 tiles fill the GPU
        (4096, 64, 1024, 2),  # parts of 512; 256 would be too narrow
        (24576, 64, 4096, 2),  # 192 tiles -> 384 blocks
        (1024, 16, 1536, 2),  # parts of 768 columns; 384 would be narrower than 512
        (1024, 16, 1600, 1),  # 800 is not a whole number of 64-wide steps
    ],
)
def test_k_parts_fill_the_gpu_with_whole_steps(n, rows, k, parts):
    assert quantized_tiles.k_parts(n, rows, k, 64) == parts


def test_dequantize_rows_goes_before_the_tiles(tiny_qwen3_4bit, counted_tiles, monkeypatch):
    """A user's --dequantize-rows is explicit; the tiles are an auto default: a product of enough rows for both
    runs dense."""
    model, _ = load(str(tiny_qwen3_4bit))
    quantized_rows.fold_quantized_rows(model, dequantize_from=16, tiles=quantized_rows.REFERENCE_TILES)
    proj = model.model.layers[0].mlp.gate_proj
    dense_calls = []
    original = quantized_rows._dense_weight
    monkeypatch.setattr(quantized_rows, "_dense_weight", lambda m: dense_calls.append(m) or original(m))
    for rows in (20, 10):  # 20: dense (>= 16), 10: tiles (>= 8, the fixture's threshold)
        proj(mx.random.normal((rows, proj.scales.shape[-1] * proj.group_size), key=mx.random.key(rows)))
    assert len(dense_calls) == 1 and counted_tiles == [10]
