"""A prefill chunk's attention over its paged KV history (`kernels.chunk_attention`).

Here: the plain-MLX reference against float64 numpy attention with the exact mask; a numpy model of the CUDA
kernel (its index formulas, with `ldmatrix` and `mma.sync m16n8k16` fragments as the PTX ISA lays them out)
against the same; argument checks; nvcc compiles of every kernel the launcher builds (registers, no spills).
On the GPU (`device`): the kernel against float64 numpy over rows x histories x head shapes, padded rows and
tables, split and single-pass, inside `mx.compile`.

Tolerance, elementwise, against float64 math on the same bf16 inputs (float32 on the GPU, for speed: ~1e-6):
`|got - want| <= 2^-7 |want| + 2^-7 sum_j w_j |v_j|` (w: the exact softmax weights). The kernel's only
roundings are P to bf16 before P V (relative 2^-8 a weight: at most 2^-8 sum_j w_j |v_j| on an output) and the
output to bf16 (2^-8 |want|); fp32 sums and `ex2.approx` are orders below. The bound doubles both. A worst
case, it is loose where many keys average out, so the relative error norm must also stay under 1e-2 (random
roundings give ~3e-3; a wrong key or weight gives O(1)).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.kernels import chunk_attention
from mlx_serve.kernels.chunk_attention import (
    LOG2E,
    OLD,
    Variant,
    default_variant,
    paged_chunk_attention,
    reference_chunk_attention,
    split_count,
    supports,
)
from scheduler.buckets import history_bucket, query_bucket
from tests.kernels.nvcc_check import compile_source, nvcc, recorded_kernels

_needs_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel needs MLX's CUDA backend")
_needs_nvcc = pytest.mark.skipif(nvcc() is None, reason="nvcc (the CUDA toolkit) is not installed")


def on_cuda(test):
    return pytest.mark.device(_needs_cuda(test))


# --- problems and the float64 yardstick
# --------------------------------------------------------------------------


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 copies of the values rounded to bf16 (round to nearest even, as the kernel's conversions)."""
    return np.array(mx.array(np.asarray(x, dtype=np.float32)).astype(mx.bfloat16).astype(mx.float32))


@dataclass(frozen=True)
class Problem:
    q: np.ndarray  # [1, heads, rows, D], bf16 values
    pool_keys: np.ndarray  # [slots, kv_heads, D], bf16 values; NaN where no row may look
    pool_values: np.ndarray
    table: np.ndarray  # [blocks] int32
    length: np.ndarray  # [2] int32: visible tokens, padded length
    positions: np.ndarray  # [rows] int32
    scale: float
    block_size: int

    def inputs(self, dtype: mx.Dtype = mx.bfloat16) -> tuple:
        return (
            mx.array(self.q).astype(dtype), mx.array(self.pool_keys).astype(dtype),
            mx.array(self.pool_values).astype(dtype), mx.array(self.table), mx.array(self.length),
            mx.array(self.positions), self.scale, self.block_size,
        )  # fmt: skip


def make_problem(
    rows: int,
    history: int,
    heads: int,
    kv_heads: int,
    head_dim: int = 128,
    block_size: int = 16,
    *,
    query_rows: int | None = None,
    table_tokens: int | None = None,
    spare_blocks: int = 2,
    seed: int = 0,
    sharpness: float = 1.0,
) -> Problem:
    """A chunk of `rows` rows after `history` tokens, its blocks scattered over a pool in random order. The
    query rows are padded to `query_rows` (pad rows repeat the last position) and the table to `table_tokens`
    with a scratch block; every pool slot no row may see (scratch, spare blocks, the last block past the end)
    is NaN, so that a read of one shows."""
    rng = np.random.default_rng(seed)
    end = history + rows
    query_rows = query_rows or rows
    used = -(-end // block_size)
    table_len = max(used, -(-(table_tokens or end) // block_size))
    blocks = used + spare_blocks + 1
    scratch = blocks - 1
    table = np.full(table_len, scratch, dtype=np.int32)
    table[:used] = rng.permutation(blocks - 1)[:used]
    shape = (blocks * block_size, kv_heads, head_dim)
    keys = rng.standard_normal(shape, dtype=np.float32)
    values = rng.standard_normal(shape, dtype=np.float32)
    visible = np.zeros(blocks * block_size, dtype=bool)
    visible[(table[:used, None] * block_size + np.arange(block_size)).reshape(-1)[:end]] = True
    keys[~visible] = np.nan
    values[~visible] = np.nan
    q = sharpness * rng.standard_normal((1, heads, query_rows, head_dim), dtype=np.float32)
    positions = np.minimum(np.arange(history, history + query_rows), end - 1).astype(np.int32)
    return Problem(
        _bf16(q), _bf16(keys), _bf16(values), table, np.array([end, table_len * block_size], dtype=np.int32),
        positions, head_dim**-0.5, block_size,
    )  # fmt: skip


def numpy_attention(p: Problem, dtype: type = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Attention with the exact mask in `dtype` (float64; the device tests' long histories take float32, ~1e-6
    relative, 4x faster): (output, sum_j w_j |v_j|), each `[1, heads, rows, D]` float64."""
    _, heads, rows, head_dim = p.q.shape
    kv_heads = p.pool_keys.shape[1]
    group = heads // kv_heads
    end = int(p.length[0])
    out, abs_weighted = np.zeros(p.q.shape), np.zeros(p.q.shape)
    if end == 0:
        return out, abs_weighted
    slots = (p.table[:, None] * p.block_size + np.arange(p.block_size)).reshape(-1)[:end]
    limit = np.clip(np.minimum(p.positions.astype(np.int64) + 1, end), 0, None)
    visible = np.tile(np.arange(end)[None, :] < limit[:, None], (group, 1))  # [group * rows, end]
    for kvh in range(kv_heads):
        keys = p.pool_keys[slots, kvh].astype(dtype)
        values = p.pool_values[slots, kvh].astype(dtype)
        q = p.q[0, kvh * group : (kvh + 1) * group].astype(dtype).reshape(group * rows, head_dim)
        s = np.where(visible, (q @ keys.T) * dtype(p.scale), dtype(-np.inf))
        m = s.max(axis=1, keepdims=True)
        w = np.exp(s - np.where(np.isfinite(m), m, 0), out=s)
        total = w.sum(axis=1, keepdims=True, dtype=np.float64).astype(dtype)
        w = np.divide(w, np.where(total > 0, total, 1), out=w)
        out[0, kvh * group : (kvh + 1) * group] = (w @ values).reshape(group, rows, head_dim)
        abs_weighted[0, kvh * group : (kvh + 1) * group] = (w @ np.abs(values)).reshape(group, rows, head_dim)
    return out, abs_weighted


def assert_close(
    got: np.ndarray, p: Problem, label: str = "", dtype: type = np.float64, reference: tuple | None = None
) -> None:
    """The bf16 bound of the module docstring, elementwise, and a relative error norm under 1e-2 (`reference`:
    `numpy_attention(p, dtype)` computed beforehand, to check several outputs against one)."""
    want, abs_weighted = reference or numpy_attention(p, dtype)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, label
    assert np.isfinite(got).all(), f"{label}: non-finite output"
    error = np.abs(got - want)
    bound = 2.0**-7 * np.abs(want) + 2.0**-7 * abs_weighted + 1e-6
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), (
        f"{label}: at [0, head {worst[1]}, row {worst[2]}, dim {worst[3]}] got {got[worst]:.6f}, want "
        f"{want[worst]:.6f} (bound {bound[worst]:.2e}); {int((error > bound).sum())} elements out"
    )
    norm = np.linalg.norm(want)
    relative = np.linalg.norm(got - want) / norm if norm > 0 else 0.0
    assert relative < 1e-2, f"{label}: relative error {relative:.2e}"


# --- the MLX reference
# -------------------------------------------------------------------------------------------

REFERENCE_CASES = [  # rows, history, heads, kv_heads, head_dim, block_size, query_rows, table_tokens
    (1, 0, 8, 8, 64, 16, None, None),
    (5, 37, 8, 4, 64, 16, 8, 64),  # padded rows and table
    (16, 100, 16, 8, 128, 32, 24, 256),
    (33, 0, 16, 4, 64, 16, None, None),  # G = 4, no history
    (7, 50, 16, 2, 64, 32, 16, 128),  # G = 8
    (20, 16, 4, 4, 128, 16, 20, 96),  # G = 1
]


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_matches_float64_attention(case) -> None:
    rows, history, heads, kv_heads, head_dim, block_size, query_rows, table_tokens = case
    p = make_problem(rows, history, heads, kv_heads, head_dim, block_size, query_rows=query_rows,
                     table_tokens=table_tokens, seed=rows + history)  # fmt: skip
    out = reference_chunk_attention(*p.inputs(mx.float32))
    assert out.shape == p.q.shape and out.dtype == mx.float32
    want, _ = numpy_attention(p)
    np.testing.assert_allclose(np.array(out), want, rtol=1e-4, atol=1e-5)


def test_reference_keeps_the_dtype_and_zeroes_rows_that_see_nothing() -> None:
    p = make_problem(4, 12, 8, 2, 64, 16, seed=1)
    out = reference_chunk_attention(*p.inputs())
    assert out.dtype == mx.bfloat16
    empty = dataclasses.replace(p, length=np.array([0, 16], np.int32))
    out = reference_chunk_attention(*empty.inputs(mx.float32))
    assert not np.array(out).any()


# --- arguments
# ---------------------------------------------------------------------------------------------------


def test_supports_bf16_heads_of_64_and_128_and_whole_groups() -> None:
    q = mx.zeros((1, 32, 8, 128), mx.bfloat16)
    pool = mx.zeros((64, 8, 128), mx.bfloat16)
    assert supports(q, pool, 16) and supports(q, pool, 32)
    assert supports(q[..., :64], pool[..., :64], 16)
    assert supports(q[:, :8], pool, 16)  # G = 1
    assert supports(q, mx.zeros((64, 4, 128), mx.bfloat16), 16)  # G = 8
    assert not supports(q.astype(mx.float16), pool.astype(mx.float16), 16)
    assert not supports(q, pool.astype(mx.float32), 16)
    assert not supports(q[..., :96], pool[..., :96], 16)
    assert not supports(mx.zeros((1, 12, 8, 128), mx.bfloat16), pool, 16)  # 12 heads over 8 kv heads
    assert not supports(mx.zeros((2, 32, 8, 128), mx.bfloat16), pool, 16)  # a batch of two
    assert not supports(q, pool, 0)
    rows_first = mx.zeros((8, 32, 128), mx.bfloat16)  # [rows, heads, D], as steps lay their queries
    assert supports(rows_first, pool, 16) and supports(rows_first[:, :8], pool, 16)
    assert not supports(mx.zeros((8, 12, 128), mx.bfloat16), pool, 16)
    assert not supports(mx.zeros((8, 32, 1, 128), mx.bfloat16), pool, 16)  # a batch of eight


def test_kernel_refuses_what_it_does_not_support() -> None:
    p = make_problem(4, 12, 8, 2, 64, 16)
    q, keys, values, table, length, positions, scale, block_size = p.inputs()
    with pytest.raises(ValueError, match="bf16"):
        paged_chunk_attention(q.astype(mx.float32), keys, values, table, length, positions, scale, block_size)
    with pytest.raises(ValueError, match="64, 128"):
        paged_chunk_attention(q[..., :32], keys[..., :32], values[..., :32], table, length, positions, 1, 16)
    with pytest.raises(ValueError, match="positions"):
        paged_chunk_attention(q, keys, values, table, length, positions[:3], scale, block_size)
    with pytest.raises(ValueError, match="positions"):  # rows first: still a position for each row
        paged_chunk_attention(q[0].transpose(1, 0, 2), keys, values, table, length, positions[:3], scale, block_size)
    with pytest.raises(ValueError, match="differ"):
        paged_chunk_attention(q, keys, values[:16], table, length, positions, scale, block_size)
    assert paged_chunk_attention.orders_after


def test_split_count(monkeypatch) -> None:
    monkeypatch.setattr(chunk_attention, "WAVE_SPLITS", False)  # the first policy
    # 8B, 128 rows: 8 query tiles x 8 kv heads = 64 blocks; split to two blocks a SM, each split >= 512 tokens
    assert split_count(64, 16384) == 5
    assert split_count(64, 1024) == 2
    assert split_count(64, 256) == 1
    assert split_count(8, 16384) == chunk_attention.MAX_SPLITS  # one row
    assert split_count(chunk_attention.SMS, 16384) == 1  # the query tiles fill the SMs
    assert split_count(256, 16384) == 1


def test_wave_splits(monkeypatch) -> None:
    monkeypatch.setattr(chunk_attention, "WAVE_SPLITS", True)
    # 8B, 1024 rows: 512 blocks are 1.3 waves of three a SM (two waves of work): three splits make four waves
    # of a third of the work each; of two a SM, 512 blocks are whole waves already
    assert split_count(512, 16512, per_sm=3) == 3
    assert split_count(512, 16512, per_sm=2) == 1
    assert split_count(32, 16512, per_sm=3) == 12  # 64 rows: 384 blocks of 396 places
    assert split_count(8, 16512, per_sm=3) == chunk_attention.MAX_SPLITS
    assert split_count(64, 1024, per_sm=3) == 2  # each split still at least MIN_SPLIT_TOKENS


def test_default_build_splits_fill_whole_waves_of_one_block_a_sm() -> None:
    """The default build holds one block a SM: splits make whole waves of 132 blocks, not 2.4 of them (the
    first policy's 5 splits of 8B's 256-row chunk: 0.479 ms a layer at 16k on the H200, 0.394 at 2 splits)."""
    assert chunk_attention.WAVE_SPLITS
    per_sm = chunk_attention.default_variant().blocks_per_sm(128)
    assert per_sm == 1
    for blocks in (24, 48, 64, 96, 128, 256):  # 8B / 0.6B chunks of 96-1024 rows
        count = split_count(blocks, 16512, per_sm)
        waves = blocks * count / chunk_attention.SMS
        assert waves <= 1 or waves > 0.85 * math.ceil(waves), (blocks, count)  # the last wave mostly full
    assert split_count(64, 16512, per_sm) == 2  # 8B, 256 rows: 128 blocks, one wave


# --- a numpy model of the kernel
# ---------------------------------------------------------------------------------

LANE = np.arange(32)
GID, TIG = LANE >> 2, LANE & 3  # a fragment's row (and row + 8) and column pair


def ldmatrix_x4(smem: np.ndarray, address: np.ndarray, trans: bool) -> np.ndarray:
    """`ldmatrix.sync.aligned.m8n8.x4[.trans].b16`: lanes 8i..8i+7 give matrix i's row addresses (bf16
    offsets); lane t receives (row t/4, cols 2(t%4), +1), or with .trans (rows 2(t%4), +1, col t/4).
    Returns [4 registers, 32 lanes, 2 halves]."""
    regs = np.empty((4, 32, 2))
    for i in range(4):
        rows = address[8 * i : 8 * i + 8]
        for half in range(2):
            regs[i, :, half] = smem[rows[2 * TIG + half] + GID] if trans else smem[rows[GID] + 2 * TIG + half]
    return regs


def mma(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` on per-lane fragments: acc [32, 4], a [32, 4, 2],
    b [32, 2, 2] (registers of two bf16, the lower column or k first), laid out as the PTX ISA's figures."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for e in range(2):
        A[GID, 2 * TIG + e], A[GID + 8, 2 * TIG + e] = a[:, 0, e], a[:, 1, e]
        A[GID, 8 + 2 * TIG + e], A[GID + 8, 8 + 2 * TIG + e] = a[:, 2, e], a[:, 3, e]
        B[2 * TIG + e, GID], B[8 + 2 * TIG + e, GID] = b[:, 0, e], b[:, 1, e]
        C[GID, 2 * TIG + e], C[GID + 8, 2 * TIG + e] = acc[:, e], acc[:, 2 + e]
    product = A @ B + C
    out = np.empty((32, 4))
    for e in range(2):
        out[:, e], out[:, 2 + e] = product[GID, 2 * TIG + e], product[GID + 8, 2 * TIG + e]
    return out


def quad_reduce(x: np.ndarray, op) -> np.ndarray:
    """`__shfl_xor_sync` over lane bits 0 and 1: the 4 lanes of a fragment row."""
    x = op(x, x[LANE ^ 1])
    return op(x, x[LANE ^ 2])


def warp_reduce(x: np.ndarray, op) -> np.ndarray:
    for o in (16, 8, 4, 2, 1):
        x = op(x, x[LANE ^ o])
    return x


def emulate_kernel(p: Problem, splits: int, variant: Variant, rows_first: bool = False) -> tuple[np.ndarray, int]:
    """The CUDA source's steps, one lane per array element, in float64 but for its bf16 roundings (P, the
    output): the same block ranges, table window (loads and refills), copies into the pipeline's padded stages
    (issued in the kernel's order: a stage is refilled only once its tile is done), fragment addresses, masks,
    online softmax and merge; q and the outputs read and written through the kernel's `q_index` (`rows_first`:
    the QR build, `[rows, heads, D]`). Returns the output `[1, heads, rows, D]` and the most table window loads
    one block made."""
    BN, STAGES, warps, TC, MT = variant.bn, variant.stages, variant.warps, variant.table_entries, variant.row_tiles
    _, heads, rows_q, D = p.q.shape
    kv_heads = p.pool_keys.shape[1]
    G, BS, NB = heads // kv_heads, p.block_size, len(p.table)
    CH, KT, ST, OT, TILE = D // 8, D // 16, BN // 8, D // 8, BN * (D + 8)
    WM, threads = 16 * MT, 32 * warps
    BM = WM * warps
    copies = BN * CH // threads
    rows = rows_q * G
    tiles = -(-rows // BM)
    length = min(int(p.length[0]), NB * BS)
    sl2 = p.scale * LOG2E
    positions = p.positions.astype(np.int64)
    q_rows = (p.q[0].transpose(1, 0, 2) if rows_first else p.q[0]).reshape(-1, D)  # q as the kernel sees it
    o_part = np.zeros((splits, heads * rows_q, D))  # the partials' rows in q's order
    ml_part = np.zeros((splits, heads * rows_q, 2))
    window_loads = []  # table window loads a block made

    def q_index(head, i):  # the kernel's: (head, query row) -> its row of q and the outputs
        return i * heads + head if rows_first else head * rows_q + i

    def at(row, chunk):
        return row * (D + 8) + chunk * 8

    def row_limit(s):
        return np.maximum(0, np.minimum(positions[np.minimum(s // G, rows_q - 1)] + 1, length))

    def q_value(kvh, s, d):  # Q of score row s (zero past the rows), dims d
        ok = s < rows
        s = np.where(ok, s, 0)
        return np.where(ok, q_rows[q_index(kvh * G + s % G, s // G), d], 0.0)

    k_row, k_chunk = (LANE & 7) + ((LANE >> 4) << 3), (LANE >> 3) & 1
    v_row, v_chunk = (LANE & 7) + (((LANE >> 3) & 1) << 3), LANE >> 4
    q_lrow, q_lchunk = LANE & 15, LANE >> 4  # Q's ldmatrix lanes (two row tiles: Q in shared memory)
    for block_x in range(tiles):
        tile = tiles - 1 - block_x
        for kvh in range(kv_heads):
            for split in range(splits):
                s_block = tile * BM
                i_lo, i_hi = s_block // G, min((s_block + BM - 1) // G, rows_q - 1)
                block_lim = max(0, max(min(int(positions[i]) + 1, length) for i in range(i_lo, i_hi + 1)))
                per = (block_lim + splits * BN - 1) // (splits * BN) * BN
                start = split * per
                end = min(start + per, block_lim)
                n_tiles = (end - start + BN - 1) // BN if end > start else 0
                # shared memory never written reads as NaN (the table window as -1: no block)
                ks, vs = np.full(STAGES * TILE, np.nan), np.full(STAGES * TILE, np.nan)
                tab, window = np.full(TC, -1, dtype=np.int64), {"wb": 0, "loads": 0}
                e_end = (end - 1) // BS + 1 if end > start else 0

                def load_window(e0, tab=tab, window=window, e_end=e_end):
                    count = min(TC, e_end - e0)
                    tab[:count] = p.table[e0 : e0 + count]
                    window["wb"], window["loads"] = e0, window["loads"] + 1

                def block_of(e, ok, tab=tab, window=window):  # the table entries the copies read
                    if not variant.table:
                        return np.where(ok, p.table[np.where(ok, e, 0)], 0)
                    at = np.where(ok, e - window["wb"], 0)
                    assert ((at >= 0) & (at < TC))[ok].all(), "a copy reads outside the table window"
                    block = np.where(ok, tab[at], 0)
                    assert (block >= 0).all(), "a copy reads a table window entry never loaded"
                    return block

                if variant.table and n_tiles > 0:
                    load_window(start // BS)

                def copy_tile(it, start=start, end=end, ks=ks, vs=vs, kvh=kvh, window=window):
                    stage, t0 = it % STAGES, start + it * BN
                    if variant.table and (min(t0 + BN, end) - 1) // BS >= window["wb"] + TC:
                        load_window(t0 // BS)
                    tid = np.arange(threads)
                    for c in range(copies):
                        piece = tid + threads * c
                        tok, chunk = piece // CH, piece % CH
                        t = t0 + tok
                        ok = t < end
                        slot = np.where(ok, block_of(t // BS, ok) * BS + t % BS, 0)
                        dims = chunk[:, None] * 8 + np.arange(8)
                        dst = (stage * TILE + at(tok, chunk))[:, None] + np.arange(8)
                        ks[dst] = np.where(ok[:, None], p.pool_keys[slot[:, None], kvh, dims], 0.0)
                        vs[dst] = np.where(ok[:, None], p.pool_values[slot[:, None], kvh, dims], 0.0)

                qs = np.full(BM * (D + 8), np.nan)  # Q's rows in shared memory (two row tiles), zero past the rows
                for r in range(BM):
                    dims = np.arange(D)
                    qs[at(r, dims // 8) + dims % 8] = q_value(kvh, np.full(D, s_block + r), dims)
                states = []
                for warp in range(warps):
                    tiles_of_warp = []
                    for mt in range(MT):
                        s0 = s_block + warp * WM + mt * 16 + GID
                        s1 = s0 + 8
                        lim = [np.minimum(row_limit(s0), end), np.minimum(row_limit(s1), end)]
                        qa = np.empty((KT, 32, 4, 2))
                        for kk in range(KT):
                            if MT > 1:  # ldmatrix from the staged rows at each k step
                                address = at(warp * WM + 16 * mt + q_lrow, 2 * kk + q_lchunk)
                                qa[kk] = ldmatrix_x4(qs, address, trans=False).transpose(1, 0, 2)
                                continue
                            for e in range(2):
                                qa[kk, :, 0, e] = q_value(kvh, s0, 16 * kk + 2 * TIG + e)
                                qa[kk, :, 1, e] = q_value(kvh, s1, 16 * kk + 2 * TIG + e)
                                qa[kk, :, 2, e] = q_value(kvh, s0, 16 * kk + 8 + 2 * TIG + e)
                                qa[kk, :, 3, e] = q_value(kvh, s1, 16 * kk + 8 + 2 * TIG + e)
                        tiles_of_warp.append({
                            "s": (s0, s1), "lim": lim, "qa": qa, "o": np.zeros((OT, 32, 4)),
                            "m": [np.full(32, -np.inf), np.full(32, -np.inf)], "l": [np.zeros(32), np.zeros(32)],
                        })  # fmt: skip
                    lims = [lim for t in tiles_of_warp for lim in t["lim"]]
                    wmin = warp_reduce(np.minimum.reduce(lims), np.minimum)[0]
                    wmax = warp_reduce(np.maximum.reduce(lims), np.maximum)[0]
                    for t in tiles_of_warp:  # a warp's row tiles skip and mask by the warp's limits
                        t["wmin"], t["wmax"] = wmin, wmax
                    states.extend(tiles_of_warp)

                for it in range(min(STAGES - 1, n_tiles)):  # pipe_start
                    copy_tile(it)
                for it in range(n_tiles):
                    if it + STAGES - 1 < n_tiles:  # pipe_next: past the barrier, refill the last tile's stage
                        copy_tile(it + STAGES - 1)
                    t0 = start + it * BN
                    stage_k, stage_v = ks[(it % STAGES) * TILE :], vs[(it % STAGES) * TILE :]
                    for w in states:
                        if t0 >= w["wmax"]:
                            continue
                        s = np.zeros((ST, 32, 4))
                        for kk in range(KT):
                            for j in range(0, ST, 2):
                                r = ldmatrix_x4(stage_k, at(8 * j + k_row, 2 * kk + k_chunk), trans=False)
                                s[j] = mma(s[j], w["qa"][kk], np.stack([r[0], r[1]], axis=1))
                                s[j + 1] = mma(s[j + 1], w["qa"][kk], np.stack([r[2], r[3]], axis=1))
                        if t0 + BN > w["wmin"]:
                            for j in range(ST):
                                for e in range(4):
                                    token = t0 + 8 * j + 2 * TIG + (e & 1)
                                    s[j, :, e] = np.where(token >= w["lim"][e >> 1], -np.inf, s[j, :, e])
                        corr, ms = [None, None], [None, None]
                        for h in range(2):
                            tmax = quad_reduce(s[:, :, 2 * h : 2 * h + 2].max(axis=(0, 2)), np.maximum)
                            m_new = np.maximum(w["m"][h], tmax)
                            m_use = np.where(m_new == -np.inf, 0.0, m_new)
                            corr[h] = np.exp2((w["m"][h] - m_use) * sl2)
                            ms[h] = m_use * sl2
                            w["m"][h] = m_new
                        for e in range(4):
                            s[:, :, e] = np.exp2(s[:, :, e] * sl2 - ms[e >> 1])
                        for h in range(2):
                            w["l"][h] = w["l"][h] * corr[h] + s[:, :, 2 * h : 2 * h + 2].sum(axis=(0, 2))
                            w["o"][:, :, 2 * h : 2 * h + 2] *= corr[h][None, :, None]
                        pb = _bf16(s)  # P as bf16 A fragments (ca_pack)
                        for t in range(BN // 16):
                            pa = np.stack([pb[2 * t][:, 0:2], pb[2 * t][:, 2:4], pb[2 * t + 1][:, 0:2],
                                           pb[2 * t + 1][:, 2:4]], axis=1)  # fmt: skip
                            for nd in range(0, OT, 2):
                                r = ldmatrix_x4(stage_v, at(16 * t + v_row, nd + v_chunk), trans=True)
                                w["o"][nd] = mma(w["o"][nd], pa, np.stack([r[0], r[1]], axis=1))
                                w["o"][nd + 1] = mma(w["o"][nd + 1], pa, np.stack([r[2], r[3]], axis=1))

                for w in states:
                    for h in range(2):
                        total = quad_reduce(w["l"][h], np.add)
                        for lane in np.nonzero(w["s"][h] < rows)[0]:
                            sr = w["s"][h][lane]
                            row = q_index(kvh * G + sr % G, sr // G)
                            for nd in range(OT):
                                dims = 8 * nd + 2 * TIG[lane] + np.arange(2)
                                o_part[split, row, dims] = w["o"][nd, lane, 2 * h : 2 * h + 2]
                            ml_part[split, row] = (w["m"][h][lane] * sl2, total[lane])
                window_loads.append(window["loads"])
    # the merge (with one split: the kernel's own normalisation, the same arithmetic)
    mmax = ml_part[..., 0].max(axis=0)
    shifted = ml_part[..., 0] - np.where(mmax == -np.inf, 0.0, mmax)
    c = np.where(ml_part[..., 0] == -np.inf, 0.0, np.exp2(shifted))
    total = (c * ml_part[..., 1]).sum(axis=0)
    out = (c[..., None] * o_part).sum(axis=0) / np.where(total > 0, total, 1.0)[..., None]
    out = _bf16(np.where(total[..., None] > 0, out, 0.0))
    out = out.reshape(rows_q, heads, D).transpose(1, 0, 2) if rows_first else out.reshape(heads, rows_q, D)
    return out[None], max(window_loads, default=0)


# rows, history, heads, kv_heads, head_dim, block_size, query_rows, table_tokens, splits, variant
# (`Variant.parse`)
EMULATED_CASES = [
    # G = 2, padded rows and table, a tile straddling the rows' limits; the same split three ways (the first
    # version's build)
    (20, 70, 4, 2, 64, 16, 24, 128, 1, "BN=64,STAGES=3"),
    (20, 70, 4, 2, 64, 16, 24, 128, 3, "old"),
    (3, 40, 8, 1, 64, 32, None, None, 2, "BN=32,STAGES=4"),  # G = 8: 24 score rows, warps past them
    (70, 5, 2, 2, 64, 16, None, 96, 1, "BN=32,STAGES=3"),  # G = 1: two query tiles (the second mostly pad)
    (9, 25, 4, 1, 128, 16, 16, 64, 4, "BN=64,STAGES=2,TABLE=0"),  # G = 4, D = 128, splits past the tiles
    (40, 30, 4, 2, 64, 16, 48, 96, 2, "BN=64,STAGES=4,WARPS=8"),  # blocks of 8 warps
    # two row tiles a warp (Q through shared memory): G = 4, D = 128, a row tile past the rows, splits
    (12, 90, 8, 2, 128, 16, None, 128, 2, "BN=64,STAGES=4,WARPS=8,RT=2"),
    (33, 20, 2, 2, 64, 16, 40, None, 1, "BN=32,STAGES=3,WARPS=4,RT=2"),  # G = 1: rows straddle the row tiles
    # table windows smaller than a split's entries: refilled in the prologue and in the loop (blocks of 1
    # token: a 64-token tile spans 64 entries of a 65-entry window), tiles straddling blocks of 3 tokens
    (6, 300, 2, 1, 64, 1, None, None, 1, "BN=64,STAGES=4,TC=65"),
    (10, 300, 4, 2, 64, 3, 16, 384, 2, "BN=32,STAGES=3,TC=40"),
    (20, 400, 4, 2, 64, 3, None, None, 1, "BN=64,STAGES=3,TC=65"),
    # windows of exactly 3 tiles (every entry read), and one entry short of that (the third tile reloads)
    (8, 250, 4, 2, 64, 2, None, None, 1, "BN=32,STAGES=2,TC=48"),
    (8, 250, 4, 2, 64, 2, None, None, 1, "BN=32,STAGES=3,TC=47"),
]


@pytest.mark.parametrize("case", EMULATED_CASES, ids=lambda case: f"{case[0]}x{case[1]}-{case[-1]}")
def test_numpy_model_of_the_kernel_matches_float64_attention(case) -> None:
    """The kernel's fragment layouts (S from ldmatrix'd K, P reused from S's accumulators, V through
    ldmatrix.trans, the output's columns), block ranges, splits, masks, pipeline stages and table windows,
    checked without a GPU."""
    rows, history, heads, kv_heads, head_dim, block_size, query_rows, table_tokens, splits, spec = case
    variant = Variant.parse(spec)
    p = make_problem(rows, history, heads, kv_heads, head_dim, block_size, query_rows=query_rows,
                     table_tokens=table_tokens, seed=7 + rows)  # fmt: skip
    out, window_loads = emulate_kernel(p, splits, variant)
    assert_close(out, p, f"emulated {case}")
    if variant.table and variant.table_entries < 100:
        assert window_loads >= 2, "the case meant to refill the table window does not"


@pytest.mark.parametrize("case", [EMULATED_CASES[i] for i in (0, 2, 6, 7)], ids=lambda case: f"{case[0]}x{case[1]}-{case[-1]}")
def test_numpy_model_of_the_rows_first_build_gives_the_same_output(case) -> None:
    """The QR build (q and outputs `[rows, heads, D]`, as the engine's steps pass them) reads every score row's
    queries and writes its output where the other layout has them: the same arithmetic, the same bits. Cases: G
    = 2 with pad rows, G = 8, two row tiles a warp with splits, G = 1 straddling the row tiles."""
    rows, history, heads, kv_heads, head_dim, block_size, query_rows, table_tokens, splits, spec = case
    p = make_problem(rows, history, heads, kv_heads, head_dim, block_size, query_rows=query_rows,
                     table_tokens=table_tokens, seed=11 + rows)  # fmt: skip
    heads_first, _ = emulate_kernel(p, splits, Variant.parse(spec))
    rows_first, _ = emulate_kernel(p, splits, Variant.parse(spec), rows_first=True)
    np.testing.assert_array_equal(rows_first, heads_first)
    assert_close(rows_first, p, f"emulated rows first {case}")


def emulate_head_copy(head: np.ndarray, kv_heads: int, split: bool) -> np.ndarray:
    """Where the kernel puts `head` `[P, H, D]` in its `[P + R, H, D]` output, by its loops: one pass, each kv
    head's block of the last-started query tile copies 16-byte pieces (8 bf16) of its G heads, a row at a time;
    split, the merge's first P * H * D / 4 threads copy 4 values each. Unwritten elements stay NaN."""
    rows, heads, dim = head.shape
    group, flat_head = heads // kv_heads, head.reshape(-1)
    out = np.full(rows * heads * dim, np.nan)
    if split:
        for idx in range(rows * heads * dim // 4):
            out[4 * idx : 4 * idx + 4] = flat_head[4 * idx : 4 * idx + 4]
        return out.reshape(head.shape)
    span = group * dim // 8
    for kvh in range(kv_heads):
        for tid in range(256):  # a block's threads, 8 warps
            for e in range(tid, rows * span, 256):
                at = ((e // span) * heads + kvh * group) * dim + (e % span) * 8
                assert np.isnan(out[at : at + 8]).all(), "a piece of head copied twice"
                out[at : at + 8] = flat_head[at : at + 8]
    return out.reshape(head.shape)


@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(1, 8, 8, 64), (8, 16, 8, 128), (5, 32, 4, 128), (3, 4, 1, 64)])
@pytest.mark.parametrize("split", [False, True])
def test_the_head_copy_writes_every_element_once(rows, heads, kv_heads, dim, split) -> None:
    head = np.random.default_rng(rows).normal(size=(rows, heads, dim))
    np.testing.assert_array_equal(emulate_head_copy(head, kv_heads, split), head)


def test_variants() -> None:
    assert Variant.parse("old") == OLD and OLD.smem_bytes(128) == 2 * 2 * 32 * 136 * 2 and not OLD.dynamic
    assert Variant.parse("BN=32,STAGES=4,TC=128") == dataclasses.replace(
        default_variant(), bn=32, stages=4, table_entries=128
    )
    assert Variant.parse("BN=64,STAGES=3,RT=1").smem_bytes(128) == 3 * 2 * 64 * 136 * 2 + 4 * 1024
    rt2 = Variant.parse("BN=64,STAGES=3,WARPS=8,RT=2")  # Q's 256 rows staged too
    assert rt2.score_rows == 256 and rt2.smem_bytes(128) == 3 * 2 * 64 * 136 * 2 + 256 * 136 * 2 + 4 * 1024
    assert Variant.parse("BN=64,STAGES=3,WARPS=4,TABLE=0,SMEM=static,RT=1").name == "bn64s3_gtable_static"
    assert Variant.parse("WARPS=8,TC=96,RT=1").name.endswith("_w8_tc96")
    assert Variant.parse("BN=64,STAGES=2,WARPS=4,RT=1,MINB=3").name == "bn64s2_mb3"
    assert Variant.parse("WARPS=8,RT=2").name.endswith("_w8_rt2")
    # blocks a SM: three of 32-token tiles (168 registers), two of 64 (175), one past 113 KB of shared memory
    blocks = {variant.name: variant.blocks_per_sm() for variant in chunk_attention.VARIANTS}
    assert blocks == {"bn32s2_gtable_static": 3, "bn32s2": 3, "bn32s3": 3, "bn32s4": 3, "bn64s2": 2,
                      "bn64s3": 2, "bn64s4": 1, "bn64s4_w8": 1, "bn32s4_w8_rt2": 1, "bn64s4_w8_rt2": 1,
                      "bn32s3_rt2": 2}  # fmt: skip
    assert Variant.parse("BN=64,STAGES=2,WARPS=4,RT=1,MINB=3").blocks_per_sm() == 3
    assert {variant.name for variant in chunk_attention.VARIANTS} >= {
        f"bn{bn}s{s}" for bn in (32, 64) for s in (2, 3, 4)
    }
    for bad in ("BN=16", "STAGES=5", "WARPS=2", "TC=64", "SMEM=huge", "PIPE=2", "MINB=17", "WARPS=8,MINB=9", "RT=3"):
        with pytest.raises(ValueError):
            Variant.parse(bad)
    p = make_problem(4, 12, 8, 2, 128, 16)
    with pytest.raises(ValueError, match="static"):  # 4 stages of 64 tokens: past 48 KB of static memory
        paged_chunk_attention(*p.inputs(), variant=Variant.parse("BN=64,STAGES=4,SMEM=static"))


# --- nvcc
# --------------------------------------------------------------------------------------------------------

# every template combination and output form the launcher can produce, in a handful of units: (rows, history,
# heads, kv_heads, head_dim, block_size, table_tokens, splits, warps, after, variant: None for the default)
COMPILE_UNITS = [
    (128, 16000, 32, 8, 128, 16, 16384, None, None, False, None),  # 8B: split (partial + merge)
    (2048, 8000, 16, 8, 128, 16, 10240, None, None, True, None),  # 0.6B, many rows: one pass, after a pool writer
    (64, 100, 32, 4, 128, 32, 1024, 1, 8, False, None),  # 30B-A3B's G = 8, blocks of 32 tokens, of 8 warps
    (16, 1000, 8, 8, 64, 16, 2048, 3, None, True, None),  # G = 1, heads of 64: split and ordered
    (16, 1000, 8, 8, 64, 16, 2048, 3, 8, False, "BN=32,STAGES=4"),  # heads of 64, 8 warps: one copy a thread
    (128, 16000, 32, 8, 128, 16, 16384, None, None, False, "old"),  # static shared memory
    (1024, 8000, 16, 8, 128, 16, 9216, 1, None, False, "old"),  # static, one pass
]


def _launch(unit, rows_first: bool = False, ahead: int = 0) -> None:
    """`rows_first`: q `[rows, heads, D]`, as the engine's steps pass it (the QR build); `ahead` > 0: a `head` of
    that many rows (the step's decode rows) leads the output."""
    rows, history, heads, kv_heads, head_dim, block_size, table_tokens, splits, warps, after, spec = unit
    q = mx.zeros((rows, heads, head_dim) if rows_first else (1, heads, rows, head_dim), mx.bfloat16)
    head = mx.zeros((ahead, heads, head_dim), mx.bfloat16) if ahead else None
    pool = mx.zeros((table_tokens, kv_heads, head_dim), mx.bfloat16)
    table = mx.zeros((table_tokens // block_size,), mx.int32)
    length = mx.array([history + rows, table_tokens], mx.int32)
    positions = mx.arange(history, history + rows, dtype=mx.int32)
    after = mx.zeros((1,)) if after else None
    variant = Variant.parse(spec) if isinstance(spec, str) else spec
    out = paged_chunk_attention(q, pool, pool, table, length, positions, head_dim**-0.5, block_size, after, head,
                                splits=splits, warps=warps, variant=variant)  # fmt: skip
    assert out.shape == ((ahead + rows, heads, head_dim) if ahead else q.shape) and out.dtype == mx.bfloat16


@contextlib.contextmanager
def _recording(monkeypatch):
    """The recorded launches (the builders' caches cleared around them, so none bypasses the recorder)."""
    for builder in (chunk_attention._kernel, chunk_attention._merge_kernel):
        builder.cache_clear()
    try:
        with recorded_kernels(monkeypatch) as recorded:
            yield recorded
    finally:
        for builder in (chunk_attention._kernel, chunk_attention._merge_kernel):
            builder.cache_clear()


def _distinct(recorded) -> list:
    return list({kernel.source: kernel for kernel in recorded}.values())  # each distinct unit once


def _ptxas(kernel) -> subprocess.CompletedProcess:
    """nvcc with ptxas's resource report (registers, spills, shared memory)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / f"{kernel.name}.cu"
        path.write_text(kernel.source)
        command = [nvcc(), "-arch=sm_90", "-std=c++17", "-c", str(path), "-o", str(Path(scratch) / "k.o"),
                   "-Xptxas", "-v"]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, timeout=300)


@_needs_nvcc
def test_kernels_compile(monkeypatch) -> None:
    with _recording(monkeypatch) as recorded:
        for unit in COMPILE_UNITS:
            _launch(unit)
        for unit in COMPILE_UNITS[:4]:  # each output form of the default build, rows first, alone and after a head
            _launch(unit, rows_first=True)
            _launch(unit, rows_first=True, ahead=8)
        kernels = _distinct(recorded)
    assert sum("constexpr int QR = 1;" in kernel.source for kernel in kernels) == 6  # the partial builds: no head
    names = {kernel.name.removesuffix(f"_{chunk_attention.SOURCE_DIGEST}") for kernel in kernels}
    assert names == {
        "mlx_serve_chunk_attention", "mlx_serve_chunk_attention_partial", "mlx_serve_chunk_attention_dyn",
        "mlx_serve_chunk_attention_after_dyn", "mlx_serve_chunk_attention_partial_dyn",
        "mlx_serve_chunk_attention_partial_after_dyn", "mlx_serve_chunk_attention_merge",
        "mlx_serve_chunk_attention_head_after_dyn", "mlx_serve_chunk_attention_head_dyn",
        "mlx_serve_chunk_attention_merge_head",
    }  # fmt: skip
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # nvcc is one process per unit
        results = list(pool.map(compile_source, kernels))
    for kernel, result in zip(kernels, results, strict=True):
        assert result.returncode == 0, f"{kernel.name}:\n{result.stderr[-4000:]}"


def _resources(report: str) -> tuple[int, int, int]:
    """ptxas -v's registers, static shared memory and bytes of spill stores."""
    registers = int(report.split("Used ")[-1].split(" registers")[0])
    static = int(report.split(" bytes smem")[0].rsplit(" ", 1)[-1]) if " bytes smem" in report else 0
    return registers, static, int(report.split(" bytes spill stores")[0].rsplit(" ", 1)[-1])


@_needs_nvcc
def test_every_variant_compiles_within_its_registers(monkeypatch) -> None:
    """Each build of `VARIANTS` at heads of 128 (the most registers), split (partial outputs) and one pass: no
    spills but those `SPILL_BYTES` allows; shared memory as `Variant.smem_bytes` says (static builds: ptxas's
    count; dynamic ones: none static); registers within `REGISTERS`, so that `Variant.blocks_per_sm` (which the
    split policy may use) holds: three blocks a SM of 32-token tiles, two of 64 (but one of 64 x 4 stages: 140 KB), one of 8 warps.
    And a build with launch bounds (`MINB`, the `__global__` redefinition) keeps to them. The resources print
    with `pytest -s`."""
    units = []
    bounded = Variant.parse("BN=64,STAGES=2,WARPS=4,RT=1,MINB=3")
    with _recording(monkeypatch) as recorded:
        for variant in (*chunk_attention.VARIANTS, bounded):
            for splits in (4, 1) if variant != bounded else (4,):
                _launch((128, 16000, 32, 8, 128, 16, 16384, splits, None, False, variant))
                units.append((variant, splits, next(k for k in reversed(recorded) if "merge" not in k.name)))
        for splits, ahead in ((4, 0), (1, 0), (1, 8)):  # the default build as steps launch it: rows first, a head
            unit = (128, 16000, 32, 8, 128, 16, 16384, splits, None, False, default_variant())
            _launch(unit, rows_first=True, ahead=ahead)
            units.append((default_variant(), splits, next(k for k in reversed(recorded) if "merge" not in k.name)))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(_ptxas, [kernel for *_, kernel in units]))
    lines = []
    for (variant, splits, _), result in zip(units, results, strict=True):
        label = f"{variant.name} ({'split' if splits > 1 else 'one pass'})"
        assert result.returncode == 0, f"{label}:\n{result.stderr[-4000:]}"
        registers, static, spilled = _resources(result.stderr)
        smem = variant.smem_bytes(128)
        lines.append(f"{label:26} {registers} registers, {smem} bytes of shared memory, spills: {spilled}, "
                     f"{variant.blocks_per_sm()} blocks a SM")  # fmt: skip
        assert static == (0 if variant.dynamic else smem), f"{label}: {result.stderr}"
        if variant == bounded:
            assert registers <= 65536 // (3 * 128), (
                f"{label}: the launch bounds did not hold: {result.stderr}"
            )
            continue
        key = variant.bn, variant.table, variant.row_tiles
        assert spilled <= chunk_attention.SPILL_BYTES.get(key, 0), f"{label}: {result.stderr}"
        assert registers <= chunk_attention.REGISTERS[key], f"{label}: {result.stderr}"
    print("\n" + "\n".join(lines))


# --- on the GPU (run on the lent H200: see benchmarks/gpu/README.md)
# ---------------------------------------------
# ~55 tests; each kernel build is compiled (NVRTC) on its first use, so the builds a run takes drive its time:
# CHUNK_ATTENTION_VARIANTS="old;BN=64,STAGES=3" (`Variant.parse` specs) narrows the variant test to those.


def _device_variants() -> tuple[Variant, ...]:
    specs = os.environ.get("CHUNK_ATTENTION_VARIANTS", "")
    return tuple(Variant.parse(spec) for spec in specs.split(";") if spec.strip()) or chunk_attention.VARIANTS


VARIANT_ROWS = [1, 64, 100, 512]
VARIANT_HISTORIES = [0, 37, 1000, 16384]
VARIANT_HEADS = [(32, 8), (16, 8)]


def _run(p: Problem, **kwargs) -> np.ndarray:
    out = paged_chunk_attention(*p.inputs(), **kwargs)
    mx.eval(out)
    assert out.dtype == mx.bfloat16
    return np.array(out.astype(mx.float32))


def _seed() -> int:
    return int(np.random.default_rng().integers(1 << 30))  # fresh inputs on every run


@on_cuda
@pytest.mark.parametrize("heads", VARIANT_HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("history", VARIANT_HISTORIES)
@pytest.mark.parametrize("rows", VARIANT_ROWS)
def test_variants_match_float64_attention(rows, history, heads) -> None:
    """Every build (`VARIANTS`: the first version's, 32 or 64-token tiles in 2-4 stages, 8 warps) with the
    launcher's choice of splits (512 rows of 32 heads: one pass, whose 16.9k-token range refills the
    1024-entry table window), against one float32 reference, and again bit for bit (no race). The table padded
    to the engine's history bucket with a scratch block (NaN, as is every slot past the chunk's end), blocks
    of 16."""
    seed = _seed()
    p = make_problem(rows, history, *heads, table_tokens=history_bucket(history + rows, 1024), seed=seed)
    reference = numpy_attention(p, np.float32)
    failures = []
    for variant in _device_variants():
        try:
            out = _run(p, variant=variant)
            assert_close(out, p, f"seed {seed}", np.float32, reference)
            np.testing.assert_array_equal(_run(p, variant=variant), out, err_msg="a race")
        except AssertionError as error:
            failures.append(f"{variant.name}: {error}")
    assert not failures, "\n".join(failures)


# rows, history, heads, block size: rows padded to the engine's query bucket; G = 4, 2, 8 (30B-A3B), 1
PADDED_CASES = [
    (1, 0, (32, 8), 16), (37, 1000, (32, 8), 16), (100, 4096, (16, 8), 16), (192, 16384, (32, 8), 16),
    (700, 2000, (16, 8), 16), (37, 1000, (32, 4), 32), (192, 16384, (32, 4), 16), (100, 4096, (8, 8), 32),
    (700, 2000, (8, 8), 16),
]  # fmt: skip


@on_cuda
@pytest.mark.parametrize("rows,history,heads,block_size", PADDED_CASES)
def test_kernel_with_padded_rows(rows, history, heads, block_size) -> None:
    """The default build, rows padded to the engine's query bucket (pad rows repeat the last position), blocks
    of 16 and 32, every group size the models have."""
    seed = _seed()
    p = make_problem(rows, history, *heads, block_size=block_size, query_rows=query_bucket(rows),
                     table_tokens=history_bucket(history + rows, 1024), seed=seed)  # fmt: skip
    assert_close(_run(p), p, f"seed {seed}", np.float32)


# rows, history, head dim, heads
SPLIT_CASES = [
    (1, 5000, 128, (32, 8)), (64, 37, 128, (16, 2)), (128, 12000, 128, (32, 8)), (300, 3000, 128, (16, 2)),
    (1, 5000, 64, (16, 8)), (64, 37, 64, (8, 8)), (128, 12000, 64, (16, 8)), (300, 3000, 64, (8, 8)),
]  # fmt: skip


@on_cuda
@pytest.mark.parametrize("rows,history,head_dim,heads", SPLIT_CASES)
def test_split_and_single_pass_agree(rows, history, head_dim, heads) -> None:
    """One pass, the launcher's splits and odd split counts (some empty) all meet the bound, agree with each
    other, and repeat bit for bit (no race); heads of 64 too."""
    seed = _seed()
    p = make_problem(rows, history, *heads, head_dim, table_tokens=history_bucket(history + rows, 1024),
                     seed=seed, sharpness=2.0)  # fmt: skip
    reference = numpy_attention(p, np.float32)
    outputs = {}
    for splits in (1, None, 3, 16):
        outputs[splits] = _run(p, splits=splits)
        assert_close(outputs[splits], p, f"seed {seed}, splits {splits}", np.float32, reference)
        again = _run(p, splits=splits)
        np.testing.assert_array_equal(outputs[splits], again, err_msg=f"splits {splits}: a race")
    for splits, out in outputs.items():
        np.testing.assert_allclose(out, outputs[1], rtol=2**-6, atol=2**-7, err_msg=f"{splits} splits, 1")


@on_cuda
@pytest.mark.parametrize("rows,history", [(64, 3000), (5, 700)])
def test_table_windows_refill(rows, history) -> None:
    """Table windows far smaller than a split's entries (65 or 40 entries of blocks of one token: a window a
    tile), one pass and split: reloaded between tiles behind their barriers, never racing a copy's read. (The
    default window's refill: 512 rows over 16k in `test_variants_match_float64_attention`.)"""
    seed = _seed()
    p = make_problem(rows, history, 32, 8, block_size=1, seed=seed)
    reference = numpy_attention(p, np.float32)
    for spec in ("BN=64,STAGES=3,TC=65", "BN=32,STAGES=4,TC=40"):
        for splits in (1, 3):
            out = _run(p, splits=splits, variant=Variant.parse(spec))
            assert_close(out, p, f"seed {seed}, {spec}, splits {splits}", np.float32, reference)
            again = _run(p, splits=splits, variant=Variant.parse(spec))
            np.testing.assert_array_equal(out, again, err_msg=f"{spec}, splits {splits}: a race")


@on_cuda
def test_one_compiled_graph_serves_every_history_of_a_bucket() -> None:
    """Lengths and positions are read on the device: one compiled function gives each history its answer."""
    table_tokens = 4096
    compiled = mx.compile(functools.partial(paged_chunk_attention, scale=128**-0.5, block_size=16))
    for history in (0, 900, 3000, 4096 - 128):
        p = make_problem(128, history, 32, 8, table_tokens=table_tokens, seed=history, spare_blocks=1)
        q, keys, values, table, length, positions, _, _ = p.inputs()
        pool_pad = table_tokens + 32 - keys.shape[0]  # one pool shape for every history
        keys = mx.pad(keys, [(0, pool_pad), (0, 0), (0, 0)])
        values = mx.pad(values, [(0, pool_pad), (0, 0), (0, 0)])
        out = compiled(q, keys, values, table, length, positions)
        assert_close(np.array(out.astype(mx.float32)), p, f"history {history}", np.float32)


@on_cuda
def test_after_orders_without_changing_the_result() -> None:
    p = make_problem(64, 500, 32, 8, seed=3)
    plain = _run(p)
    np.testing.assert_array_equal(_run(p, after=mx.zeros((4,))), plain)


@on_cuda
@pytest.mark.parametrize("rows,history,head_dim,heads", SPLIT_CASES[:4] + [(700, 2000, 128, (16, 8))])
def test_rows_first_queries_give_the_same_bits(rows, history, head_dim, heads) -> None:
    """q `[rows, heads, D]` (a slice of a step's queries, as `RaggedLayerCache` passes it: the QR build) gives
    the `[1, heads, rows, D]` output transposed, bit for bit, one pass and split, ordered after a writer, and
    from a slice of a larger queries array read in place; positions may run past the rows (a padded lane)."""
    seed = _seed()
    p = make_problem(rows, history, *heads, head_dim, table_tokens=history_bucket(history + rows, 1024), seed=seed)
    q, keys, values, table, length, positions, scale, block_size = p.inputs()
    step = mx.concatenate([mx.zeros((3, heads[0], head_dim), q.dtype), q[0].transpose(1, 0, 2)])  # 3 rows before
    padded = mx.concatenate([positions, mx.repeat(positions[-1:], 5)])
    for splits in (1, None, 3):
        want = _run(p, splits=splits)
        got = paged_chunk_attention(step[3:], keys, values, table, length, padded, scale, block_size,
                                    mx.zeros((2,)), splits=splits)  # fmt: skip
        assert got.shape == (rows, heads[0], head_dim)
        got = np.array(got.astype(mx.float32)).transpose(1, 0, 2)[None]
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}, splits {splits}")
    reference = reference_chunk_attention(step[3:], keys, values, table, length, padded, scale, block_size)
    assert_close(np.array(reference.astype(mx.float32)).transpose(1, 0, 2)[None], p, f"seed {seed}", np.float32)


@on_cuda
@pytest.mark.parametrize("rows,history,head_dim,heads", SPLIT_CASES[:4] + [(700, 2000, 128, (16, 8))])
@pytest.mark.parametrize("ahead", [1, 8, 32])
def test_a_head_leads_the_output_bit_for_bit(rows, history, head_dim, heads, ahead) -> None:
    """`head` (a step's decode rows' attention, `[P, heads, D]`) comes out first, then the chunk's rows exactly as
    without it: one pass (its last query tile's blocks copy head) and split (the merge copies it), ordered after a
    writer or not."""
    seed = _seed()
    p = make_problem(rows, history, *heads, head_dim, table_tokens=history_bucket(history + rows, 1024), seed=seed)
    q, keys, values, table, length, positions, scale, block_size = p.inputs()
    q = q[0].transpose(1, 0, 2)
    head = mx.random.normal((ahead, heads[0], head_dim), key=mx.random.key(seed)).astype(mx.bfloat16)
    for splits, after in ((1, None), (None, None), (3, mx.zeros((2,))), (1, mx.zeros((2,)))):
        alone = paged_chunk_attention(q, keys, values, table, length, positions, scale, block_size, after,
                                      splits=splits)  # fmt: skip
        led = paged_chunk_attention(q, keys, values, table, length, positions, scale, block_size, after, head,
                                    splits=splits)  # fmt: skip
        assert led.shape == (ahead + rows, heads[0], head_dim)
        want = np.array(mx.concatenate([head, alone]).astype(mx.float32))
        np.testing.assert_array_equal(np.array(led.astype(mx.float32)), want, err_msg=f"seed {seed}, splits {splits}")


def test_the_reference_takes_rows_first_queries_and_longer_positions() -> None:
    """`reference_chunk_attention` (the path off CUDA) in the steps' layout: q `[rows, heads, D]` gives the
    `[1, heads, rows, D]` answer transposed, reading the first `rows` of padded positions."""
    p = make_problem(13, 90, 8, 2, 64, table_tokens=128, seed=5)
    q, keys, values, table, length, positions, scale, block_size = p.inputs(mx.float32)
    want = reference_chunk_attention(q, keys, values, table, length, positions, scale, block_size)
    padded = mx.concatenate([positions, mx.repeat(positions[-1:], 3)])
    got = reference_chunk_attention(q[0].transpose(1, 0, 2), keys, values, table, length, padded, scale, block_size)
    assert got.shape == (13, 8, 64)
    np.testing.assert_allclose(np.array(got.transpose(1, 0, 2)[None]), np.array(want), rtol=1e-6, atol=1e-6)
    assert_close(np.array(got.transpose(1, 0, 2)[None]), p, "rows first")
    head = mx.ones((4, 8, 64))
    led = reference_chunk_attention(q[0].transpose(1, 0, 2), keys, values, table, length, padded, scale, block_size,
                                    None, head)  # fmt: skip
    assert led.shape == (17, 8, 64)
    np.testing.assert_array_equal(np.array(led[:4]), np.array(head))
    np.testing.assert_array_equal(np.array(led[4:]), np.array(got))


def test_a_head_needs_rows_first_queries_of_its_shape() -> None:
    p = make_problem(4, 12, 8, 2, 64, 16)
    q, keys, values, table, length, positions, scale, block_size = p.inputs()
    rows_first = q[0].transpose(1, 0, 2)
    for q_in, head in ((q, mx.zeros((2, 8, 64), mx.bfloat16)), (rows_first, mx.zeros((2, 4, 64), mx.bfloat16)),
                       (rows_first, mx.zeros((2, 8, 64), mx.float32)), (rows_first, mx.zeros((2, 8, 1, 64), mx.bfloat16))):  # fmt: skip
        with pytest.raises(ValueError, match="head"):
            paged_chunk_attention(q_in, keys, values, table, length, positions, scale, block_size, None, head)
