"""The decode QKV kernel against mlx-lm's ops (`plain_qkv_rows`): the queries it returns and the pool rows it writes."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_serve.kernels.decode_qkv import HeadSpec, kernel_qkv_rows, plain_qkv_rows, select_qkv_rows
from mlx_serve.kv_pool import KVLayout, KVPool

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the decode QKV kernel needs MLX's CUDA backend")

CASES = [  # (rows, heads, kv_heads, head_dim, dtype, q/k norm, traditional RoPE)
    (1, 2, 1, 64, mx.float32, True, False),
    (7, 16, 4, 128, mx.bfloat16, True, False),
    (33, 32, 8, 128, mx.bfloat16, True, False),
    (5, 8, 8, 64, mx.float16, False, True),
    (64, 8, 2, 128, mx.bfloat16, False, False),
]
BLOCKS, BLOCK_SIZE = 12, 16


def _problem(rows, heads, kv_heads, head_dim, dtype, norm, traditional, seed=0):
    rng = np.random.default_rng(seed)
    spec = HeadSpec(heads, kv_heads, head_dim, 1e-6 if norm else None, 1_000_000.0, 1.0, traditional)
    attn = SimpleNamespace(rope=nn.RoPE(head_dim, traditional=traditional, base=spec.rope_base))
    if norm:
        attn.q_norm, attn.k_norm = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
        attn.q_norm.weight = mx.array(rng.uniform(0.5, 1.5, head_dim).astype(np.float32)).astype(dtype)
        attn.k_norm.weight = mx.array(rng.uniform(0.5, 1.5, head_dim).astype(np.float32)).astype(dtype)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = mx.array(rng.standard_normal((rows, width)).astype(np.float32) * 3).astype(dtype)
    # long-context positions too: RoPE angles of tens of thousands of radians
    positions = mx.array(rng.integers(0, 40_000, rows).astype(np.int32))
    slots = mx.array(rng.permutation(BLOCKS * BLOCK_SIZE)[:rows].astype(np.int32))
    shape = ((BLOCKS + 1) * BLOCK_SIZE, kv_heads, head_dim)
    keys, values = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    pools = []
    for _ in range(2):  # two pools with the same rows in separate buffers (the kernel writes in place)
        pool = KVPool(KVLayout(1, kv_heads, head_dim, dtype), BLOCKS, BLOCK_SIZE)
        pool.keys[0], pool.values[0] = mx.array(keys).astype(dtype), mx.array(values).astype(dtype)
        mx.eval(pool.keys, pool.values)
        pools.append(pool)
    return spec, attn, qkv, positions, slots, pools


@on_cuda
@pytest.mark.device
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_mlx_lm_ops_and_writes_only_its_slots(case):
    spec, attn, qkv, positions, slots, (plain_pool, kernel_pool) = _problem(*case)
    dtype = case[4]
    want_q = plain_qkv_rows(qkv, spec, attn, positions, slots, plain_pool, 0)
    got_q = kernel_qkv_rows(qkv, spec, attn, positions, slots, kernel_pool, 0)
    mx.eval(want_q, got_q, plain_pool.keys, kernel_pool.keys, kernel_pool.values)
    assert got_q.shape == want_q.shape == (case[0], spec.heads, 1, spec.head_dim) and got_q.dtype == dtype
    # a 1-ulp tie can round either way when MLX's norm sums in another order; more is a bug
    ulp = {mx.float32: 2**-23, mx.float16: 2**-10, mx.bfloat16: 2**-7}[dtype]
    for got, want in ((got_q, want_q), (kernel_pool.keys[0], plain_pool.keys[0])):
        got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        diff = np.abs(got - want)
        assert (diff <= 2 * ulp * np.maximum(np.abs(want), 1e-6) + 1e-6).all(), diff.max()
        if dtype != mx.float32:  # in fp32 every op's last bit shows; in 16 bits rounding hides most
            assert (diff > 0).mean() < 0.02, f"{(diff > 0).mean():.1%} of elements differ"
    # values are copied bit for bit, and every row outside the step's slots is untouched
    as_np = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    np.testing.assert_array_equal(as_np(kernel_pool.values[0]), as_np(plain_pool.values[0]))


def test_selection_off_cuda_is_mlx_lm_ops():
    spec = HeadSpec(4, 2, 64, 1e-6, 10_000.0, 1.0, False)
    if not mx.cuda.is_available():
        assert select_qkv_rows(spec) is plain_qkv_rows
    assert select_qkv_rows(HeadSpec(4, 2, 80, None, 10_000.0, 1.0, False)) is plain_qkv_rows
