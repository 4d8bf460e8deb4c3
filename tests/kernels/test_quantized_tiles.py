"""The quantized-tiles 4-bit GEMM (CUDA) against dequantize-then-matmul and MLX's own quantized matmul."""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_serve import quantized_rows
from mlx_serve.kernels import quantized_tiles
from mlx_serve.kernels.quantized_tiles import quantized_tiles_matmul

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the quantized-tiles kernel needs MLX's CUDA backend")


@functools.cache
def _quantized(n: int, k: int, group_size: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    weight = mx.array((rng.standard_normal((n, k)) * 0.05).astype(np.float32)).astype(mx.bfloat16)
    return mx.quantize(weight, group_size=group_size, bits=4)


def _close(got: mx.array, want: mx.array) -> None:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    scale = mx.abs(want).max().item()
    assert mx.abs(got - want).max().item() <= 1e-2 * scale  # bf16 outputs, fp32 sums in different orders


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("rows", [1, 33, 64, 100, 300, 2048])
@pytest.mark.parametrize("n,k", [(128, 128), (4096, 4096), (6144, 4096), (4096, 12288)])
@pytest.mark.parametrize("group_size", [64, 128])
def test_the_kernel_equals_dequantize_then_matmul(rows, n, k, group_size) -> None:
    weight, scales, biases = _quantized(n, k, group_size, seed=n + k)
    x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(mx.bfloat16)
    got = quantized_tiles_matmul(x, weight, scales, biases, group_size)
    assert got.shape == (rows, n) and got.dtype == mx.bfloat16
    _close(got, quantized_rows.reference_matmul(x, weight, scales, biases, group_size, 4))
    if k >= 1024:  # MLX 0.32's CUDA quantized GEMM returns garbage (1e38) for 128 x 128, groups of 128, 33-100 rows
        _close(got, mx.quantized_matmul(x, weight, scales, biases, transpose=True, group_size=group_size, bits=4))


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("rows", [40, 128, 1024])
@pytest.mark.parametrize("splits", [2, 8])
def test_weights_split_over_k_read_as_laid(rows, splits) -> None:
    """`quantized_rows.split_k`'s `[S, N, K/S]` layout, through a folded linear: the kernel's answer is the
    quantized matmul's over the whole weight."""
    dense = nn.Linear(4096, 4096, bias=False)
    dense.weight = (mx.random.normal((4096, 4096), key=mx.random.key(splits)) * 0.02).astype(mx.bfloat16)
    linear = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4)
    x = mx.random.normal((rows, 4096), key=mx.random.key(rows)).astype(mx.bfloat16)
    want = linear(x)
    linear.__class__ = quantized_rows.RowsQuantizedLinear
    quantized_rows.split_k(linear, splits)
    got = quantized_tiles_matmul(x, linear.weight, linear.scales, linear.biases, 64)
    _close(got, want)


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("group_size", [64, 128])
def test_unsplit_products_equal_dequantize_then_matmul_bit_for_bit(group_size) -> None:
    """Where no block splits K (2,048 rows fill the GPU), the kernel sums each output's K in order, 16 at a time in
    fp32, as MLX's bf16 GEMM does on the H200: its answer is the reference's exactly, so a weight dequantized other
    than as MLX does it (say `bf16(q * s)` rounded before `+ bias`: 1 bf16 ulp off here and there) fails here."""
    weight, scales, biases = _quantized(6144, 4096, group_size, seed=group_size)
    x = mx.random.normal((2048, 4096), key=mx.random.key(3)).astype(mx.bfloat16)
    assert quantized_tiles.k_parts(6144, 2048, 4096, group_size) == 1
    got = quantized_tiles_matmul(x, weight, scales, biases, group_size)
    want = quantized_rows.reference_matmul(x, weight, scales, biases, group_size, 4)
    assert mx.array_equal(got, want).item()
