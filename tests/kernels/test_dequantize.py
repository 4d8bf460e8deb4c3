"""The 4-bit dequantize kernel (CUDA) against `mx.dequantize`, and the dense product it serves."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve import quantized_rows
from mlx_serve.kernels import dequantize, quantized_tiles

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the dequantize kernel needs MLX's CUDA backend")


def _quantized(n: int, k: int, group_size: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    weight = mx.array((rng.standard_normal((n, k)) * 0.05).astype(np.float32)).astype(mx.bfloat16)
    return mx.quantize(weight, group_size=group_size, bits=4)


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("n,k", [(128, 128), (4096, 4096), (1024, 12288)])
@pytest.mark.parametrize("group_size", dequantize.GROUP_SIZES)
def test_equals_mlx_dequantize_bit_for_bit(n, k, group_size) -> None:
    weight, scales, biases = _quantized(n, k, group_size, seed=n + k + group_size)
    got = dequantize.dequantize_4bit(weight, scales, biases, group_size)
    want = mx.dequantize(weight, scales, biases, group_size, 4)
    assert got.shape == (n, k) and got.dtype == mx.bfloat16
    assert mx.array_equal(got, want).item()


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("splits", [2, 8])
def test_weights_split_over_k_come_out_whole(splits) -> None:
    """`quantized_rows.split_k`'s `[S, N, K/S]` layout gives the whole weight's `[N, K]`."""
    weight, scales, biases = _quantized(512, 4096, 64, seed=splits)
    parts = [mx.contiguous(a.reshape(a.shape[0], splits, -1).swapaxes(0, 1)) for a in (weight, scales, biases)]
    got = dequantize.dequantize_4bit(*parts, 64)
    assert mx.array_equal(got, mx.dequantize(weight, scales, biases, 64, 4)).item()


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("rows", [quantized_tiles.DENSE_FROM_ROWS, 1000])
def test_many_rows_run_dense_and_equal_dequantize_then_matmul(rows) -> None:
    weight, scales, biases = _quantized(4096, 4096, 64, seed=rows)
    x = mx.random.normal((rows, 4096), key=mx.random.key(rows)).astype(mx.bfloat16)
    got = quantized_tiles.many_rows_matmul(x, weight, scales, biases, 64)
    want = quantized_rows.reference_matmul(x, weight, scales, biases, 64, 4)
    assert mx.array_equal(got, want).item()
