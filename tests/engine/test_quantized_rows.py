"""Folding ragged rows into one matrix for quantized linears changes the kernel, not the numbers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_serve import quantized_rows
from mlx_serve.quantized_rows import RowsQuantizedLinear, fold_quantized_rows


def test_folded_rows_equal_row_by_row_results():
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32))
    nn.quantize(model, group_size=32, bits=4)
    x = mx.random.normal((37, 1, 64))
    expected = model(x)
    assert fold_quantized_rows(model) == 2
    assert all(type(layer) is RowsQuantizedLinear for layer in model.layers)
    assert fold_quantized_rows(model) == 2  # a second engine over the same model still counts them (row tiles)
    got = model(x)
    assert got.shape == expected.shape == (37, 1, 32)
    assert mx.array_equal(got, expected)
    single = x[:1]  # one row stays a matrix-vector product, as mlx-lm's own decode
    assert model(single).shape == (1, 1, 32)


def _quantized(in_dims: int, out_dims: int, bias: bool = False) -> RowsQuantizedLinear:
    layer = nn.QuantizedLinear.from_linear(nn.Linear(in_dims, out_dims, bias=bias), group_size=64, bits=4)
    layer.__class__ = RowsQuantizedLinear
    return layer


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_products_split_over_k_equal_the_whole_product(splits, bias):
    mx.random.seed(splits)
    layer = _quantized(256, 96, bias)
    inputs = [mx.random.normal(shape) for shape in ((5, 1, 256), (1, 7, 256), (9, 256), (256,))]
    expected = [layer(x) for x in inputs]
    whole = quantized_rows._dense_weight(layer)
    mx.eval(expected, whole)
    quantized_rows.split_k(layer, splits)
    assert layer.k_splits == splits and layer.weight.shape[0] == splits and layer.scales.shape == (splits, 96, 4 // splits)
    for x, want in zip(inputs, expected):
        got = layer(x)
        assert got.shape == want.shape
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()  # float32: only the order of the sum differs
    assert mx.array_equal(quantized_rows._dense_weight(layer), whole).item()  # `--dequantize-rows` reads it back
    quantized_rows.split_k(layer, 2)  # already split: unchanged
    assert layer.k_splits == splits


def test_k_splits_fill_the_gpu_with_slices_of_whole_tiles():
    k_splits_for = quantized_rows.k_splits_for
    assert k_splits_for(4096, 4096, 64) == 8  # Qwen3-8B o_proj: 32 blocks -> 256
    assert k_splits_for(4096, 12288, 64) == 8  # down_proj
    assert k_splits_for(24576, 4096, 64) == 2  # gate/up fused: 192 blocks -> 384
    assert k_splits_for(151936, 4096, 64) == 1  # the LM head fills the GPU already
    assert k_splits_for(1024, 2048, 64) == 4  # slices no narrower than 512
    assert k_splits_for(1024, 1536, 64) == 2  # 768 wide; 384 would be too narrow
    assert k_splits_for(4096, 4096, 1024) == 4  # a slice holds whole quantization groups


def test_no_slice_is_narrower_than_cudas_quantized_gemm_sums_right(monkeypatch):
    monkeypatch.setattr(quantized_rows, "SPLIT_MIN_WIDTH", 16)
    assert quantized_rows.k_splits_for(128, 512, 32) == 4  # 128 wide; 64-wide slices came back NaN on the H200
    assert quantized_rows.k_splits_for(128, 128, 32) == 1


def _folded_and_fused(path):
    """The tiny 4-bit model loaded by mlx-lm, its rows folded and its q/k/v and gate/up fused, as the engine has it."""
    from mlx_lm import load

    from mlx_serve.fused_decode import FusedDecode
    from mlx_serve.kernels.decode_qkv import plain_qkv_rows
    from mlx_serve.kernels.paged_attention import batched_decode_attention

    model, _ = load(str(path))
    fold_quantized_rows(model)
    return model, FusedDecode(model, batched_decode_attention, plain_qkv_rows)


def test_only_projections_no_fused_layer_views_are_split(tiny_qwen3_4bit, narrow_k_splits):
    from mlx_serve.fused_decode import viewed_projections

    model, fused = _folded_and_fused(tiny_qwen3_4bit)
    layers = len(model.model.layers)
    split = quantized_rows.split_standalone_projections(model, viewed_projections(fused.layers))
    assert split == 2 * layers  # o_proj and down_proj of every block; q/k/v/gate/up are views of fused arrays
    block = model.model.layers[0]
    assert block.self_attn.o_proj.k_splits == 2 and block.mlp.down_proj.k_splits == 4
    assert block.self_attn.q_proj.k_splits == 1 and block.mlp.up_proj.k_splits == 1
    assert quantized_rows.split_standalone_projections(model, viewed_projections(fused.layers)) == 0


def test_splitting_the_fused_projections_keeps_one_copy_of_the_weights(tiny_qwen3_4bit, narrow_k_splits):
    import gc

    from mlx_serve.fused_decode import split_fused_projections

    _, fused = _folded_and_fused(tiny_qwen3_4bit)
    gc.collect()
    active = mx.get_active_memory()
    fused_bytes = sum(layer.qkv.weight.nbytes + layer.gate_up.weight.nbytes for layer in fused.layers)
    assert split_fused_projections(fused.layers) == 2 * len(fused.layers)
    gc.collect()
    # the block's projections are re-pointed at the new arrays: the old fused arrays are freed
    assert mx.get_active_memory() - active < fused_bytes / 4
    assert split_fused_projections(fused.layers) == 0  # idempotent


def test_split_auto_is_all_with_cuda_and_the_fused_mixed_forward(monkeypatch):
    from mlx_serve import engine_setup
    from mlx_serve.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "cuda_available", lambda: True)
    assert engine_setup.split_quantized_k("auto", fused_mixed=True) == "all"  # 8B 4-bit decode +13-26% over standalone
    assert engine_setup.split_quantized_k("auto", fused_mixed=False) == "standalone"
    assert engine_setup.split_quantized_k("on", fused_mixed=True) == "standalone"
    monkeypatch.setattr(paged_attention, "cuda_available", lambda: False)
    assert engine_setup.split_quantized_k("auto", fused_mixed=True) == "off"


def test_the_kv_layout_reads_the_same_heads_from_projections_split_over_k(tiny_qwen3_4bit, narrow_k_splits):
    # a second engine on the same model (the GPU bench's solo and contended sides) reads the heads off projections
    # an earlier engine split: weights [splits, out, in / splits], whose first axis is not the output width
    from mlx_serve.fused_decode import split_fused_projections, viewed_projections
    from mlx_serve.model_loading import kv_layout

    model, fused = _folded_and_fused(tiny_qwen3_4bit)
    before = kv_layout(model)
    assert quantized_rows.split_standalone_projections(model, viewed_projections(fused.layers)) > 0
    assert split_fused_projections(fused.layers) > 0
    assert model.model.layers[0].self_attn.k_proj.k_splits > 1
    assert kv_layout(model) == before
