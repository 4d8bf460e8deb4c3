"""A prefill lane's history out of the paged pool: the CUDA kernel and its plain-MLX twin against the slot gather."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.kernels.paged_gather import gather_supports, paged_gather, select_prefill_gather, table_gather
from mlx_serve.kv_pool import KVLayout, KVPool
from mlx_serve.ragged import LaneRows

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the paged-gather kernel needs MLX's CUDA backend")

CASES = [  # (length, kv_len, kv_heads, head_dim, block_size, dtype)
    (1, 16, 1, 64, 16, mx.float32),
    (37, 64, 2, 128, 16, mx.bfloat16),
    (100, 128, 4, 64, 32, mx.float16),
    (1024, 1024, 8, 128, 16, mx.bfloat16),
]


def _problem(length: int, kv_len: int, kv_heads: int, head_dim: int, block_size: int, dtype: mx.Dtype, seed: int):
    """A pool of random rows and a lane whose blocks are scattered over it in random order."""
    rng = np.random.default_rng(seed)
    blocks = -(-kv_len // block_size) + 3
    pool = KVPool(KVLayout(1, kv_heads, head_dim, dtype), blocks, block_size)
    shape = pool.keys[0].shape
    pool.keys[0] = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    pool.values[0] = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    table = rng.permutation(blocks)[: -(-length // block_size)].astype(np.int32)
    lane = LaneRows(0, 1, mx.zeros((0,), mx.int32), None, mx.array(table), mx.array([length, kv_len], mx.int32), kv_len)
    slots = (table[:, None] * block_size + np.arange(block_size)).reshape(-1)[:length]
    return pool, lane, slots


def _expected(pool: KVPool, slots: np.ndarray, kv_len: int) -> tuple[np.ndarray, np.ndarray]:
    keys, values = pool.gather(0, mx.array(slots))  # [1, kv_heads, length, head_dim]
    pad = [(0, 0), (0, 0), (0, kv_len - len(slots)), (0, 0)]
    as_np = lambda a: np.pad(np.array(a.astype(mx.float32)), pad)  # noqa: E731
    return as_np(keys), as_np(values)


@pytest.mark.parametrize("case", CASES)
def test_table_gather_equals_slot_gather_and_zero_pads(case):
    pool, lane, slots = _problem(*case, seed=1)
    keys, values = table_gather(pool.keys[0], pool.values[0], lane, pool.block_size)
    want_keys, want_values = _expected(pool, slots, lane.kv_len)
    assert keys.shape == (1, case[2], lane.kv_len, case[3])
    np.testing.assert_array_equal(np.array(keys.astype(mx.float32)), want_keys)
    np.testing.assert_array_equal(np.array(values.astype(mx.float32)), want_values)


def test_selection_off_cuda_is_the_slot_gather():
    pool_keys = mx.zeros((16, 2, 64), mx.float32)
    assert gather_supports(pool_keys)
    assert not gather_supports(mx.zeros((16, 2, 6), mx.float16))  # 12-byte heads: no 16-byte loads
    if not mx.cuda.is_available():
        assert select_prefill_gather(pool_keys) is None


@on_cuda
@pytest.mark.device
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_slot_gather(case):
    for seed in (2, 3):  # fresh inputs each time: a right answer on one draw proves little
        pool, lane, slots = _problem(*case, seed=seed)
        keys, values = paged_gather(pool.keys[0], pool.values[0], lane, pool.block_size)
        want_keys, want_values = _expected(pool, slots, lane.kv_len)
        np.testing.assert_array_equal(np.array(keys.astype(mx.float32)), want_keys)
        np.testing.assert_array_equal(np.array(values.astype(mx.float32)), want_values)
