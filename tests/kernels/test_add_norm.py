"""The fused residual add + RMSNorm kernel against mlx-lm's two ops."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_serve.kernels.add_norm import MAX_WIDTH, kernel_add_norm, plain_add_norm, select_add_norm

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the add-norm kernel needs MLX's CUDA backend")
ULP = {mx.float32: 2**-23, mx.float16: 2**-10, mx.bfloat16: 2**-7}


def _problem(rows: int, width: int, dtype: mx.Dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    norm = nn.RMSNorm(width, eps=1e-6)
    norm.weight = mx.array(rng.uniform(0.5, 1.5, width).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((rows, width)).astype(np.float32) * 4).astype(dtype)
    r = mx.array(rng.standard_normal((rows, width)).astype(np.float32)).astype(dtype)
    return x, r, norm


@on_cuda
@pytest.mark.device
@pytest.mark.parametrize(
    "rows,width,dtype",
    [(1, 1024, mx.bfloat16), (7, 4096, mx.bfloat16), (64, 2048, mx.float16), (3, 1000, mx.float32), (2, 5120, mx.bfloat16)],
)
def test_kernel_matches_add_then_rms_norm(rows, width, dtype):
    x, r, norm = _problem(rows, width, dtype)
    want_h, want_y = plain_add_norm(x, r, norm)
    got_h, got_y = kernel_add_norm(x, r, norm)
    as_np = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    assert got_h.dtype == got_y.dtype == dtype and got_y.shape == (rows, width)
    np.testing.assert_array_equal(as_np(got_h), as_np(want_h))
    # the sum of squares is reduced in another order than MLX's: the norm may move a tie by one ulp
    diff = np.abs(as_np(got_y) - as_np(want_y))
    assert (diff <= 2 * ULP[dtype] * np.abs(as_np(want_y)) + 1e-6).all(), diff.max()
    if dtype != mx.float32:
        assert (diff > 0).mean() < 0.02


def test_off_cuda_and_for_mixed_dtypes_the_plain_ops_run():
    x, r, norm = _problem(2, 64, mx.float32)
    if not mx.cuda.is_available():
        assert select_add_norm() is plain_add_norm
    # promotion cases never reach the kernel (its outputs have one dtype)
    h, y = kernel_add_norm(x, r.astype(mx.float16), norm)
    want_h, want_y = plain_add_norm(x, r.astype(mx.float16), norm)
    assert mx.array_equal(h, want_h).item() and mx.array_equal(y, want_y).item()
    wide = _problem(1, MAX_WIDTH + 64, mx.float32)
    assert mx.array_equal(kernel_add_norm(*wide)[1], plain_add_norm(*wide)[1]).item()
