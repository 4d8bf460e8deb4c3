"""The 4-bit GEMV kernel (CUDA) against fp32 sums of the dequantized weights and MLX's quantized matmul; what it
takes, and the factorised arithmetic it runs, on the CPU."""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_serve import quantized_rows
from mlx_serve.kernels import quantized_gemv
from mlx_serve.kernels.quantized_gemv import MOST_ROWS
from mlx_serve.kernels.quantized_gemv import quantized_gemv as gemv

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the GEMV kernel needs MLX's CUDA backend")
# (N, K); 1000: no tile divides it; K 640: 5 groups of 128 (a scale word's high half at odd rows)
SHAPES = [(128, 128), (1000, 2048), (4096, 4096), (6144, 4096), (1024, 12288), (300, 640)]


@functools.cache
def _quantized(n: int, k: int, group_size: int, seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    weight = mx.array((rng.standard_normal((n, k)) * 0.05).astype(np.float32)).astype(mx.bfloat16)
    return tuple(mx.quantize(weight, group_size=group_size, bits=4))


def _split(arrays: tuple[mx.array, ...], splits: int) -> tuple[mx.array, ...]:
    """`quantized_rows.split_k`'s layout: `[splits, N, K / splits / ...]`."""
    return tuple(mx.contiguous(a.reshape(a.shape[0], splits, -1).swapaxes(0, 1)) for a in arrays)


def _rows(m: int, k: int, seed: int) -> mx.array:
    return mx.random.normal((m, k), key=mx.random.key(seed)).astype(mx.bfloat16)


def _fp32_reference(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int):
    """`x @ W.T` over the unrounded weights `q * scale + bias` (numpy, float64: MLX's CUDA float32 matmul may run as
    TF32), and the sums of magnitudes `|x| @ |W|.T` that bound how far any order of fp32 sums may stray."""
    packed = np.array(weight)
    q = (packed[..., None] >> np.arange(0, 32, 4, dtype=np.uint32)) & 0xF  # nibbles, lowest first
    q = q.reshape(packed.shape[0], -1, group_size).astype(np.float64)
    scale, bias = (np.array(a.astype(mx.float32), dtype=np.float64)[..., None] for a in (scales, biases))
    dense = (q * scale + bias).reshape(packed.shape[0], -1)
    rows = np.array(x.astype(mx.float32), dtype=np.float64)
    return mx.array((rows @ dense.T).astype(np.float32)), mx.array((np.abs(rows) @ np.abs(dense).T).astype(np.float32))


def _assert_within_bf16(got: mx.array, want: mx.array, magnitude: mx.array, atol: float = 2.0**-12) -> None:
    """`got` is `want` rounded to bf16 (half a unit: 2^-8 relative; allowed 2^-7), give or take fp32 sums in
    another order: `atol` of the summed magnitudes, room for the kernel's (a group's sum of `(128 + q) x`, ~30x its
    `q x`, summed by tensor cores that truncate) yet 16x under what rounding each weight to bf16 may move a sum."""
    error = mx.abs(got.astype(mx.float32) - want)
    bound = 2.0**-7 * mx.abs(want) + atol * magnitude
    assert mx.all(error <= bound).item(), f"worst excess {(error - bound).max().item()}"


def factorised_reference(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array,
                         group_size: int) -> mx.array:  # fmt: skip
    """The kernel's arithmetic in MLX ops, fp32: per group, `scale * sum (128 + q) x + (bias - 128 scale) * sum x`
    (`weight` whole `[N, K / 8]`)."""
    n, k = weight.shape[0], weight.shape[1] * 8
    q = (weight[..., None] >> mx.arange(0, 32, 4, dtype=mx.uint32)) & 0xF  # nibbles, lowest first
    lifted = (q.reshape(n, k // group_size, group_size) + 128).astype(mx.float32)  # [N, G, GS]
    xg = x.astype(mx.float32).reshape(x.shape[0], k // group_size, group_size)  # [M, G, GS]
    sums = mx.einsum("mgk,ngk->mng", xg, lifted)
    x_sums = xg.sum(axis=-1)[:, None, :]  # [M, 1, G]
    scale, bias = scales.astype(mx.float32)[None], biases.astype(mx.float32)[None]
    return (scale * sums + (bias - 128 * scale) * x_sums).sum(axis=-1).astype(mx.bfloat16)


# CPU: what the kernel takes, and its arithmetic


def test_rows_fit_one_mma_of_rows() -> None:
    assert [quantized_gemv.rows_fit(m) for m in (0, 1, MOST_ROWS, MOST_ROWS + 1)] == [False, True, True, False]


@pytest.mark.parametrize("group_size", quantized_gemv.GROUP_SIZES)
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_supports_affine_4bit_whole_and_split(group_size, splits) -> None:
    arrays = _quantized(256, 4096, group_size)
    parts = _split(arrays, splits) if splits > 1 else arrays
    assert quantized_gemv.supports(*parts, group_size, 4)


def test_supports_refuses_what_the_kernel_cannot_read() -> None:
    weight, scales, biases = _quantized(256, 4096, 64)
    assert not quantized_gemv.supports(weight, scales, biases, 64, 8)  # bits
    assert not quantized_gemv.supports(weight, scales, biases, 64, 4, mode="mxfp4")
    assert not quantized_gemv.supports(weight, scales, None, 64, 4)
    assert not quantized_gemv.supports(weight, scales, biases, 16, 4)  # group size
    assert not quantized_gemv.supports(weight, scales.astype(mx.float16), biases, 64, 4)
    assert not quantized_gemv.supports(weight, scales, biases.astype(mx.float32), 64, 4)
    assert not quantized_gemv.supports(weight.view(mx.int32), scales, biases, 64, 4)
    assert not quantized_gemv.supports(weight, scales[:, :-1], biases[:, :-1], 64, 4)  # scales of another shape
    assert not quantized_gemv.supports(weight[None, None], scales[None, None], biases[None, None], 64, 4)
    # a slice's K a whole number of 128-wide steps
    assert not quantized_gemv.supports(*_quantized(256, 192, 64), 64, 4)
    assert not quantized_gemv.supports(*_quantized(128, 96, 32), 32, 4)
    assert not quantized_gemv.supports(*_split(_quantized(128, 768, 64), 4), 64, 4)  # slices of 192
    assert quantized_gemv.supports(*_split(_quantized(128, 768, 128), 2), 128, 4)  # 3 groups a slice


def test_the_wrapper_refuses_rows_dtypes_and_widths_it_cannot_run() -> None:
    weight, scales, biases = _quantized(256, 4096, 64)
    shapes = [((MOST_ROWS + 1, 4096), mx.bfloat16), ((0, 4096), mx.bfloat16), ((1, 4096), mx.float32),
              ((1, 2048), mx.bfloat16), ((4096,), mx.bfloat16)]  # fmt: skip
    for shape, dtype in shapes:
        x = mx.zeros(shape, dtype)
        with pytest.raises(ValueError):
            gemv(x, weight, scales, biases, 64)
    with pytest.raises(ValueError):
        gemv(mx.zeros((1, 4096), mx.bfloat16), weight, scales, biases, 128)  # scales of groups of 64


def test_tiles_and_staging_fit_every_shape() -> None:
    """Each tile width keeps a block's staging in static shared memory, and wider tiles go to wider outputs."""
    for tiles in quantized_gemv.TILE_CHOICES:
        warps = quantized_gemv.TILE_WARPS // tiles
        for group_size in quantized_gemv.GROUP_SIZES:
            stages = warps * quantized_gemv.STAGES * quantized_gemv.stage_bytes(tiles, group_size)
            assert stages <= quantized_gemv.SHARED_BYTES
    widths = [quantized_gemv.tiles_for(n) for n in (128, 1024, 4096, 6144, 24576, 151936)]
    assert widths == sorted(widths) and set(widths) <= set(quantized_gemv.TILE_CHOICES)


@pytest.mark.parametrize("group_size", quantized_gemv.GROUP_SIZES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_the_factorised_sums_are_the_dequantized_product(group_size, m) -> None:
    """scale * sum (128 + q) x + (bias - 128 scale) * sum x, summed in fp32, is x @ W.T over the unrounded weights
    to within bf16 rounding, and so within the tolerance the device tests allow MLX's bf16-weight product."""
    weight, scales, biases = _quantized(384, 1024, group_size)
    x = _rows(m, 1024, seed=m)
    want, magnitude = _fp32_reference(x, weight, scales, biases, group_size)
    with mx.stream(mx.cpu):  # full fp32 sums (CUDA's float32 matmul may be TF32)
        factorised = factorised_reference(x, weight, scales, biases, group_size)
        bf16_weights = quantized_rows.reference_matmul(x, weight, scales, biases, group_size, 4)
    _assert_within_bf16(factorised, want, magnitude)
    _assert_within_bf16(bf16_weights, want, magnitude, atol=2.0**-8)  # + each weight's bf16 rounding


# device: the kernel


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("group_size", quantized_gemv.GROUP_SIZES)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_the_kernel_is_the_fp32_product_rounded_to_bf16(m, group_size, n, k) -> None:
    arrays = _quantized(n, k, group_size, seed=n + k)
    x = _rows(m, k, seed=m + k)
    got = gemv(x, *arrays, group_size)
    assert got.shape == (m, n) and got.dtype == mx.bfloat16
    _assert_within_bf16(got, *_fp32_reference(x, *arrays, group_size))


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 12288), (1000, 2048)])
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("splits", [2, 8])
def test_weights_split_over_k_give_the_whole_product(splits, m, group_size, n, k) -> None:
    """`quantized_rows.split_k`'s `[S, N, K/S]` layout: the same product as the whole weight (sums in another
    order at most)."""
    arrays = _quantized(n, k, group_size, seed=n + k)
    x = _rows(m, k, seed=splits)
    want, magnitude = _fp32_reference(x, *arrays, group_size)
    whole = gemv(x, *arrays, group_size)
    split = gemv(x, *_split(arrays, splits), group_size)
    _assert_within_bf16(split, want, magnitude)
    _assert_within_bf16(split, whole.astype(mx.float32), magnitude)


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("m", [1, 4, 8])
def test_a_folded_linear_split_by_split_k_matches_mlx(m) -> None:
    """Through a folded linear split as the engine splits it: the fp32 product rounded to bf16, and MLX's own
    quantized matmul's answer (weights rounded to bf16) to `test_quantized_tiles`' 1% of the largest output. (Not
    MLX's CPU form: in bf16 it strays ~15% of the largest output from the fp32 product here.)"""
    dense = nn.Linear(4096, 6144, bias=False)
    dense.weight = (mx.random.normal((6144, 4096), key=mx.random.key(m)) * 0.02).astype(mx.bfloat16)
    linear = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4)
    x = _rows(m, 4096, seed=m)
    mlx_product = linear(x).astype(mx.float32)
    want, magnitude = _fp32_reference(x, linear.weight, linear.scales, linear.biases, 64)
    linear.__class__ = quantized_rows.RowsQuantizedLinear
    quantized_rows.split_k(linear, quantized_rows.k_splits_for(6144, 4096, 64))
    got = gemv(x, linear.weight, linear.scales, linear.biases, 64)
    _assert_within_bf16(got, want, magnitude)
    assert mx.abs(got.astype(mx.float32) - mlx_product).max().item() <= 1e-2 * mx.abs(mlx_product).max().item()


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("group_size,k", [(64, 4096), (128, 640)])
def test_row_views_of_a_fused_weight_read_from_their_offset(group_size, k) -> None:
    """A fused projection's q/k/v are row slices of one array (a data offset): each reads its own rows, the
    scales of a view from an odd row over 5 groups of 128 starting mid-word."""
    weight, scales, biases = _quantized(6144, k, group_size, seed=1)
    x = _rows(8, k, seed=2)
    want, magnitude = _fp32_reference(x, weight, scales, biases, group_size)
    for start, stop in [(0, 4096), (4096, 5120), (5120, 6144), (40, 1000), (41, 1000)]:
        part = gemv(x, weight[start:stop], scales[start:stop], biases[start:stop], group_size)
        _assert_within_bf16(part, want[:, start:stop], magnitude[:, start:stop])


def test_odd_row_counts_run_as_the_next_power_of_two(monkeypatch) -> None:
    """Rows 1-8 build four kernels, not eight (each is seconds of NVRTC the first time a step meets it); the rows
    added are zeros and cut from the result."""
    from tests.kernels.nvcc_check import recorded_kernels

    assert [quantized_gemv.padded_rows(m) for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    quantized_gemv._kernel.cache_clear()
    weight, scales = mx.zeros((256, 128 // 8), mx.uint32), mx.zeros((256, 2), mx.bfloat16)
    with recorded_kernels(monkeypatch) as recorded:
        for rows in range(1, MOST_ROWS + 1):
            y = quantized_gemv.quantized_gemv(mx.zeros((rows, 128), mx.bfloat16), weight, scales, scales, 64)
            assert y.shape == (rows, 256)
    quantized_gemv._kernel.cache_clear()
    assert len(recorded) == MOST_ROWS and len({kernel.source for kernel in recorded}) == 4
