"""Decode attention over paged KV: the batched pure-MLX path and the CUDA kernel against the per-lane reference."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.kernels import paged_attention
from mlx_serve.kernels.paged_attention import (
    batched_decode_attention,
    blockwise_fits,
    kernel_supports,
    mma_fits,
    paged_decode_attention,
    partition_size,
    select_decode_attention,
)
from mlx_serve.kernels.synthetic import DecodeProblem, random_decode_problem
from mlx_serve.ragged import reference_decode_attention

_needs_cuda = pytest.mark.skipif(
    not mx.cuda.is_available(), reason="the paged-attention kernel needs MLX's CUDA backend"
)


def on_cuda(test):
    return pytest.mark.device(_needs_cuda(test))


CASES = [  # lengths, kv_heads, group, head_dim, block_size
    ([1, 17, 5], 2, 1, 64, 16),
    ([33, 64, 1, 100], 2, 4, 128, 16),
    ([300, 7, 129], 4, 2, 64, 32),
    ([16, 32, 48], 1, 8, 128, 16),
]


def reference_fp32(problem: DecodeProblem) -> np.ndarray:
    """The reference on float32 copies of the inputs, as float64 numpy."""
    out = reference_decode_attention(
        problem.queries.astype(mx.float32),
        problem.pool_keys.astype(mx.float32),
        problem.pool_values.astype(mx.float32),
        problem.rows,
        problem.scale,
    )
    return np.array(out, dtype=np.float64)


def relative_error(out: mx.array, ref: np.ndarray) -> float:
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    assert np.isfinite(got).all(), "non-finite output"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def run(fn, problem: DecodeProblem) -> mx.array:
    out = fn(problem.queries, problem.pool_keys, problem.pool_values, problem.rows, problem.scale)
    mx.eval(out)
    return out


@pytest.mark.parametrize("case", CASES)
def test_batched_matches_reference(case) -> None:
    lengths, kv_heads, group, head_dim, block_size = case
    problem = random_decode_problem(lengths, kv_heads, group, head_dim, block_size, seed=len(lengths))
    out = run(batched_decode_attention, problem)
    assert out.shape == problem.queries.shape and out.dtype == problem.queries.dtype
    assert relative_error(out, reference_fp32(problem)) < 1e-5


def test_batched_handles_sharp_softmax() -> None:
    problem = random_decode_problem([40, 3, 90], 2, 2, 64, 16, seed=9, sharpness=30.0)
    assert relative_error(run(batched_decode_attention, problem), reference_fp32(problem)) < 1e-5


def test_batched_ignores_padding_blocks() -> None:
    # block tables are padded with block 0: poisoning it must not change lanes that don't own it
    problem = random_decode_problem([16, 160], 2, 2, 64, 16, seed=3, spare_blocks=0)
    owner = [i for i, lane in enumerate(problem.rows.lanes) if 0 in (np.array(lane.kv_slots) // 16).tolist()]
    keys = problem.pool_keys.at[:16].add(1e4)
    poisoned = DecodeProblem(problem.queries, keys, problem.pool_values, problem.rows, problem.scale)
    ref, out = reference_fp32(poisoned), np.array(run(batched_decode_attention, poisoned))
    for lane in range(2):
        if lane not in owner:
            np.testing.assert_allclose(out[lane], ref[lane], rtol=1e-4, atol=1e-5)


def test_blockwise_fits() -> None:
    assert blockwise_fits(128, 2, 16, 64)  # bf16 head of 128: 2 tokens an iteration, chunks of 16
    assert not blockwise_fits(128, 2, 24, 64)
    assert blockwise_fits(128, 4, 16, 64)  # fp32: 1 token an iteration, chunks of 8


def test_partition_size_splits_long_histories_unless_the_lanes_fill_the_gpu() -> None:
    assert partition_size(lanes=1, kv_heads=8, max_len=1024) == 1024  # one pass
    assert partition_size(lanes=32, kv_heads=8, max_len=16) == 16
    assert partition_size(lanes=1, kv_heads=8, max_len=4096) == paged_attention.PARTITION
    assert partition_size(lanes=8, kv_heads=8, max_len=2048) == paged_attention.PARTITION
    assert partition_size(lanes=32, kv_heads=8, max_len=4096) == 4096  # 256 blocks: one pass
    assert partition_size(lanes=64, kv_heads=4, max_len=2048) == 2048
    assert partition_size(lanes=64, kv_heads=8, max_len=8192) == paged_attention.PARTITION  # too long for one


def test_partition_size_of_the_tensor_core_kernel() -> None:
    assert partition_size(lanes=1, kv_heads=8, max_len=1104, mma=True) == 1104  # one pass
    assert partition_size(lanes=1, kv_heads=8, max_len=2048, mma=True) == paged_attention.MMA_PARTITION
    assert partition_size(lanes=4, kv_heads=8, max_len=4096, mma=True) == paged_attention.MMA_PARTITION
    assert partition_size(lanes=8, kv_heads=8, max_len=8192, mma=True) == 8192  # 64 blocks: one pass
    assert partition_size(lanes=64, kv_heads=8, max_len=16384, mma=True) == paged_attention.MMA_PARTITION


def test_mma_fits_bf16_groups_of_up_to_8_and_whole_tiles() -> None:
    q = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    keys = mx.zeros((16, 8, 128), mx.bfloat16)
    assert mma_fits(q, keys, 16)
    assert mma_fits(q[..., :64], keys[..., :64], 32)
    assert not mma_fits(q, keys, 24)  # a 16-token tile would straddle two KV blocks
    assert not mma_fits(q.astype(mx.float16), keys.astype(mx.float16), 16)
    assert not mma_fits(q, mx.zeros((16, 2, 128), mx.bfloat16), 16)  # a group of 16
    assert not mma_fits(q[..., :32], keys[..., :32], 16)


def test_kernel_supports_common_head_dims() -> None:
    q = mx.zeros((1, 8, 1, 128), mx.bfloat16)
    assert kernel_supports(q, mx.zeros((16, 2, 128), mx.bfloat16))
    assert kernel_supports(q[..., :64], mx.zeros((16, 2, 64), mx.float32))
    assert not kernel_supports(q[..., :80], mx.zeros((16, 2, 80), mx.bfloat16))
    assert not kernel_supports(mx.zeros((1, 8, 1, 256)), mx.zeros((16, 2, 256)))  # fp32: 64 threads a head


def test_select_decode_attention() -> None:
    assert select_decode_attention("reference") is reference_decode_attention
    assert select_decode_attention("batched") is batched_decode_attention
    if mx.cuda.is_available():
        expected = paged_decode_attention
    elif mx.default_device() == mx.cpu:
        expected = batched_decode_attention
    else:
        expected = reference_decode_attention
    assert select_decode_attention("auto") is expected
    with pytest.raises(ValueError):
        select_decode_attention("fastest")


@pytest.mark.skipif(mx.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_kernel_refused_without_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        select_decode_attention("kernel")


# --- on the GPU (run on the lent H200: see benchmarks/gpu/README.md) -------------------------------------------

BOUNDS = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 1.2e-2}
GPU_CASES = CASES + [
    ([1024] * 8, 8, 4, 128, 16),  # the 8B shape, several partitions
    ([3000, 1, 700, 2049], 4, 8, 128, 16),  # 30B-A3B's group of 8, ragged and split
    ([5000], 8, 2, 128, 16),  # one long lane: many partitions
    ([1, 2, 3], 8, 4, 128, 16),
    ([40, 77], 2, 2, 128, 24),  # a block size the blockwise order cannot tile: falls back
    ([130, 64], 2, 4, 64, 32),
]


@on_cuda
@pytest.mark.parametrize("blockwise", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_kernel_matches_reference(case, dtype, blockwise) -> None:
    lengths, kv_heads, group, head_dim, block_size = case
    seed = int(np.random.default_rng().integers(1 << 30))  # fresh inputs on every run
    problem = random_decode_problem(lengths, kv_heads, group, head_dim, block_size, dtype=dtype, seed=seed)
    out = run(functools.partial(paged_decode_attention, blockwise=blockwise), problem)
    assert out.shape == problem.queries.shape and out.dtype == dtype
    error = relative_error(out, reference_fp32(problem))
    assert error < BOUNDS[dtype], f"seed {seed}: relative error {error:.2e}"


@on_cuda
@pytest.mark.parametrize("partition", [None, 64])
@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("case", GPU_CASES)
def test_mma_kernel_matches_reference(case, tiles, partition) -> None:
    """The tensor-core kernel (bf16; where `mma_fits` refuses, the scalar kernel answers), one pass and split."""
    lengths, kv_heads, group, head_dim, block_size = case
    seed = int(np.random.default_rng().integers(1 << 30))
    problem = random_decode_problem(lengths, kv_heads, group, head_dim, block_size, dtype=mx.bfloat16, seed=seed)
    kernel = functools.partial(paged_decode_attention, mma=True, tiles=tiles, partition=partition)
    out = run(kernel, problem)
    assert out.shape == problem.queries.shape and out.dtype == mx.bfloat16
    error = relative_error(out, reference_fp32(problem))
    assert error < BOUNDS[mx.bfloat16], f"seed {seed}: relative error {error:.2e}"
    assert mx.array_equal(out, run(kernel, problem)).item(), "results differ between runs: a race"


@on_cuda
@pytest.mark.parametrize("blockwise", [False, True, "mma"])
def test_kernel_sharp_softmax_and_repeatable(blockwise) -> None:
    problem = random_decode_problem([900, 40, 2], 8, 4, 128, 16, dtype=mx.bfloat16, seed=11, sharpness=30.0)
    mma = blockwise == "mma"
    kernel = functools.partial(paged_decode_attention, blockwise=blockwise is True, mma=mma)
    first = run(kernel, problem)
    assert relative_error(first, reference_fp32(problem)) < BOUNDS[mx.bfloat16]
    again = run(kernel, problem)
    assert mx.array_equal(first, again).item(), "results differ between runs: a race"


@on_cuda
def test_kernel_matches_batched_bf16() -> None:
    problem = random_decode_problem([1024] * 32, 8, 4, 128, 16, dtype=mx.bfloat16, seed=5)
    ref = np.array(run(batched_decode_attention, problem).astype(mx.float32), dtype=np.float64)
    assert relative_error(run(paged_decode_attention, problem), ref) < BOUNDS[mx.bfloat16]


def test_one_pass_warps_fit_their_partial_sums_in_shared_memory() -> None:
    assert paged_attention.one_pass_warps(4, 128) == paged_attention.SINGLE_PASS_WARPS  # Qwen3-8B / 0.6B
    assert paged_attention.one_pass_warps(8, 128) <= 8  # Qwen3-30B-A3B: 16 warps would need 66 KB
    assert paged_attention.one_pass_warps(16, 256) == paged_attention.WARPS  # never fewer than the split kernel's
    for group, head_dim in [(1, 64), (2, 128), (4, 128), (8, 128), (8, 64)]:
        warps = paged_attention.one_pass_warps(group, head_dim)
        assert warps * group * (head_dim + 2) * 4 <= paged_attention.MERGE_SHARED_BYTES


@on_cuda
@pytest.mark.parametrize("warps", [8, 16])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("kv_heads,group", [(8, 4), (4, 8)])
def test_one_pass_blocks_of_any_warps_match_reference(warps, dtype, kv_heads, group, monkeypatch) -> None:
    """Histories of up to `SINGLE_PASS_TOKENS` take one pass whose block has up to `SINGLE_PASS_WARPS` warps
    (as many as `one_pass_warps` fits: 8B's group of 4, 30B-A3B's group of 8); 16 passed on the H200 too (the
    tensor-core kernel, bf16 here, keeps to `MMA_MOST_WARPS`: 16 of its warps do not fit a block's registers)."""
    monkeypatch.setattr(paged_attention, "SINGLE_PASS_WARPS", warps)
    problem = random_decode_problem([544], kv_heads, group, 128, 16, dtype=dtype, seed=warps)
    out = run(paged_decode_attention, problem)
    assert relative_error(out, reference_fp32(problem)) < BOUNDS[dtype]
    several = random_decode_problem([1000, 3, 517, 64], kv_heads, group, 128, 16, dtype=dtype, seed=warps + 1)
    assert relative_error(run(paged_decode_attention, several), reference_fp32(several)) < BOUNDS[dtype]


@on_cuda
@pytest.mark.parametrize("partition", [64, 256, 4096])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("case", [([1150], 8, 4), ([1, 600, 33, 2049], 8, 4), ([3000, 1, 700], 4, 8)])
def test_any_partition_matches_reference(case, dtype, partition) -> None:
    """Split histories of any partition size (tables wider than the shortest lanes: partitions with no token of
    theirs), and one pass over long histories (4096), as `partition_size` now picks for many lanes."""
    lengths, kv_heads, group = case
    problem = random_decode_problem(lengths, kv_heads, group, 128, 16, dtype=dtype, seed=partition + len(lengths))
    kernel = functools.partial(paged_decode_attention, partition=partition)
    out = run(kernel, problem)
    assert relative_error(out, reference_fp32(problem)) < BOUNDS[dtype]
    assert mx.array_equal(out, run(kernel, problem)).item(), "results differ between runs: a race"
