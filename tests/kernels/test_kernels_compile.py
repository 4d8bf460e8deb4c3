"""Every CUDA kernel source compiles (nvcc, sm_90) as MLX's CUDA backend would build it: found here, on a
machine without a GPU, rather than in a device call. Skipped where nvcc is absent."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from mlx_serve.kernels import (
    dequantize,
    expert_tiles,
    paged_attention,
    quantized_gemv,
    quantized_tiles,
    tile_layout,
)
from mlx_serve.kernels.synthetic import random_decode_problem
from tests.kernels.nvcc_check import compile_source, nvcc, recorded_kernels

pytestmark = pytest.mark.skipif(nvcc() is None, reason="nvcc (the CUDA toolkit) is not installed")


@pytest.fixture
def kernels(monkeypatch):
    """The recorded launches; the kernel builders' caches are cleared around the test (a cached real kernel
    would bypass the recorder, a cached recorder would outlive it)."""
    builders = (
        dequantize._kernel, expert_tiles._kernel, paged_attention._kernels, quantized_gemv._kernel,
        quantized_tiles._kernel, tile_layout._kernel,
    )  # fmt: skip
    for builder in builders:
        builder.cache_clear()
    with recorded_kernels(monkeypatch) as recorded:
        yield recorded
    for builder in builders:
        builder.cache_clear()


def assert_compiles(recorded) -> None:
    assert recorded, "no kernel was launched"
    units = list({kernel.source: kernel for kernel in recorded}.values())  # each distinct unit once
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # nvcc is one process per unit
        results = list(pool.map(compile_source, units))
    for kernel, result in zip(units, results, strict=True):
        assert result.returncode == 0, f"{kernel.name}:\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("gather", [False, True])
def test_expert_tiles_compiles(kernels, gather) -> None:
    x = mx.zeros((64, 64), dtype=mx.bfloat16)
    weight = mx.zeros((4, 128, 64), dtype=mx.bfloat16)
    source = mx.zeros((64,), dtype=mx.int32) if gather else None
    expert_tiles.expert_tiles_matmul(x, weight, mx.zeros((2,), mx.uint32), mx.array([2], mx.int32), 32, source)
    assert_compiles(kernels)


def test_quantized_tiles_compiles(kernels) -> None:
    """bf16 output (one block per tile) and fp32 partials (K split across blocks), whole and split weights, both
    group sizes."""
    k = 4096
    for rows, slices in [(16, 1), (300, 1), (2048, 1), (64, 8)]:
        for group_size in quantized_tiles.GROUP_SIZES:
            weight = mx.zeros((slices, 1024, k // slices // 8), dtype=mx.uint32)
            scales = mx.zeros((slices, 1024, k // slices // group_size), dtype=mx.bfloat16)
            x = mx.zeros((rows, k), mx.bfloat16)
            quantized_tiles.quantized_tiles_matmul(x, weight, scales, scales, group_size)
    assert_compiles(kernels)


def test_quantized_gemv_compiles(kernels) -> None:
    """1 and 8 rows, every group size, whole and split weights, each tile width (N of 1024, 16384 and 32768) and
    an N no tile divides."""
    for rows in (1, 8):
        for group_size in quantized_gemv.GROUP_SIZES:
            for n, k, slices in [(1024, 4096, 1), (16384, 4096, 8), (32768, 1024, 1), (1000, 1024, 2)]:
                weight = mx.zeros((slices, n, k // slices // 8), dtype=mx.uint32)
                scales = mx.zeros((slices, n, k // slices // group_size), dtype=mx.bfloat16)
                x = mx.zeros((rows, k), mx.bfloat16)
                assert quantized_gemv.quantized_gemv(x, weight, scales, scales, group_size).shape == (rows, n)
    assert {quantized_gemv.tiles_for(n) for n in (1024, 16384, 32768)} == set(quantized_gemv.TILE_CHOICES)
    assert_compiles(kernels)


def test_tile_layout_compiles(kernels) -> None:
    for tile in (32, 64):
        tile_layout.cuda_tile_layout(mx.zeros((512, 8), dtype=mx.uint32), 128, tile)
    assert_compiles(kernels)


def test_a_broken_kernel_does_not_compile(kernels) -> None:
    """The check can fail: a body naming an undeclared variable is reported with nvcc's message."""
    kernel = mx.fast.cuda_kernel("broken", ["x"], ["y"], "  y[0] = x[0] + undeclared_name;")
    kernel(inputs=[mx.zeros((1,))], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
           threadgroup=(1, 1, 1))  # fmt: skip
    (recorded,) = kernels
    result = compile_source(recorded)
    assert result.returncode != 0 and "undeclared_name" in result.stderr


def test_dequantize_compiles(kernels) -> None:
    """Whole and split weights, every group size."""
    for slices in (1, 8):
        for group_size in dequantize.GROUP_SIZES:
            weight = mx.zeros((slices, 256, 4096 // slices // 8), dtype=mx.uint32)
            scales = mx.zeros((slices, 256, 4096 // slices // group_size), dtype=mx.bfloat16)
            assert dequantize.dequantize_4bit(weight, scales, scales, group_size).shape == (256, 4096)
    assert_compiles(kernels)


@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("lengths,kv_heads,group", [([544], 8, 4), ([544], 4, 8), ([3000, 40], 8, 4)])
def test_paged_decode_attention_compiles(kernels, monkeypatch, lengths, kv_heads, group, mma) -> None:
    """One pass (8B's group of 4 and 30B-A3B's of 8: static shared memory stays under 48 KB) and the split
    kernels with their merge, scalar and tensor-core (both tile counts; heads of 64 too)."""
    problem = random_decode_problem(lengths, kv_heads, group, 128, 16, dtype=mx.bfloat16, seed=0)
    monkeypatch.setattr(paged_attention, "kernel_supports", lambda *_: True)
    for tiles in (1, 2) if mma else (None,):
        paged_attention.paged_decode_attention(
            problem.queries, problem.pool_keys, problem.pool_values, problem.rows, problem.scale, mma=mma, tiles=tiles
        )
    if mma:
        small = random_decode_problem(lengths, kv_heads, group, 64, 32, dtype=mx.bfloat16, seed=0)
        paged_attention.paged_decode_attention(
            small.queries, small.pool_keys, small.pool_values, small.rows, small.scale, mma=True
        )
    assert_compiles(kernels)
