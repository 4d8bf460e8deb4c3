"""The 4-bit GEMM (`kernels/quantized_gemm.py`): its launcher's choices, a numpy emulation of a thread block's index
mapping and pipeline, nvcc builds of every kernel the launcher produces (with ptxas' register and spill counts),
and, on CUDA, its products against a float64 reference and, unsplit, bit for bit against dequantize-then-matmul."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_serve import quantized_rows
from mlx_serve.kernels import dequantize, quantized_gemm
from mlx_serve.kernels.quantized_gemm import Tile
from mlx_serve.kernels.quantized_gemm import quantized_gemm as gemm
from tests.kernels.nvcc_check import nvcc, recorded_kernels

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the quantized GEMM needs MLX's CUDA backend")
needs_nvcc = pytest.mark.skipif(nvcc() is None, reason="nvcc (the CUDA toolkit) is not installed")

# Qwen3-8B's projections (N, K) and the layout the engine holds them in (K slices: `k_splits_for`)
PROJECTIONS = {"qkv": (6144, 4096, 1), "o_proj": (4096, 4096, 8), "gate_up": (24576, 4096, 1),
               "down": (4096, 12288, 8)}  # fmt: skip
# every tile the module's constants make and the larger ones `--variants` may ask for (dynamic shared memory)
TILES = [quantized_gemm.big_tile(), quantized_gemm.small_tile(), Tile(128, 128, 32, 8, 3), Tile(64, 128, 32, 8, 4),
         Tile(64, 128, 32, 2, 4), Tile(128, 256, 32, 8, 4), Tile(128, 128, 64, 4, 4)]  # fmt: skip


# ---- the launcher's choices ----------------------------------------------------------------------------------


def _arrays(n: int, k: int, group_size: int, slices: int = 1):
    words, groups = k // slices // 8, k // slices // group_size
    shape = (slices, n) if slices > 1 else (n,)
    return mx.zeros((*shape, words), mx.uint32), mx.zeros((*shape, groups), mx.bfloat16)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("slices", [1, 8])
def test_supports_4bit_affine_weights_of_128_column_multiples(group_size, slices) -> None:
    w, s = _arrays(4096, 4096, group_size, slices)
    assert quantized_gemm.supports(w, s, s, group_size, 4)
    assert not quantized_gemm.supports(w, s, None, group_size, 4)
    assert not quantized_gemm.supports(w, s, s, group_size, 8)
    assert not quantized_gemm.supports(w, s, s, group_size, 4, mode="mxfp4")
    assert not quantized_gemm.supports(w, s.astype(mx.float16), s.astype(mx.float16), group_size, 4)
    odd_w, odd_s = _arrays(4096 + 64, 4096, group_size, slices)
    assert not quantized_gemm.supports(odd_w, odd_s, odd_s, group_size, 4)  # N not a multiple of 128


def test_supports_rejects_other_group_sizes_and_mismatched_scales() -> None:
    w, s = _arrays(256, 512, 64)
    assert not quantized_gemm.supports(w, s, s, 16, 4)
    assert not quantized_gemm.supports(w, s[:, :4], s[:, :4], 64, 4)
    assert not quantized_gemm.supports(w.astype(mx.int32), s, s, 64, 4)


def test_fits_a_quantized_linear() -> None:
    linear = nn.QuantizedLinear(512, 256, bias=False, group_size=64, bits=4)
    linear.scales = linear.scales.astype(mx.bfloat16)
    linear.biases = linear.biases.astype(mx.bfloat16)
    assert quantized_gemm.fits(linear)
    assert not quantized_gemm.fits(nn.QuantizedLinear(512, 256, bias=False, group_size=64, bits=8))
    assert not quantized_gemm.fits(nn.QuantizedLinear(512, 200, bias=False, group_size=64, bits=4))


def test_default_tiles_fit_static_shared_memory() -> None:
    """Both defaults stay within 48 KB of static shared memory (no dynamic opt-in needed)."""
    for tile in (quantized_gemm.big_tile(), quantized_gemm.small_tile()):
        assert tile.valid() and not tile.dynamic and tile.smem <= 48 * 1024
    assert quantized_gemm.big_tile().smem == 46 * 1024
    assert Tile(128, 128, 64, 4, 4).dynamic and Tile(128, 128, 64, 4, 4).smem == 112 * 1024


def test_tile_validity_mirrors_the_kernel_asserts() -> None:
    assert all(tile.valid() for tile in TILES)
    assert not Tile(96, 128, 32, 4, 3).valid()  # rows a multiple of 64
    assert not Tile(128, 128, 48, 4, 3).valid()  # K steps of 32 or 64
    assert not Tile(128, 128, 32, 4, 1).valid()  # a slot in flight
    assert not Tile(64, 128, 32, 16, 4).valid()  # 8-column warp tiles: ldmatrix loads two n8 tiles
    assert not Tile(256, 256, 64, 8, 5).valid()  # past 227 KB of shared memory


@pytest.mark.parametrize("name", list(PROJECTIONS))
@pytest.mark.parametrize("rows", [1, 64, 65, 128, 129, 192, 256, 384, 512, 768, 1024, 2048, 4096])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_plans_are_launchable(name, rows, group_size) -> None:
    """Every plan: a valid tile taking N, parts that split K into whole K steps and groups, at least
    `MIN_SPLIT_WIDTH` wide, and the fewest of least estimated cost."""
    n, k, _ = PROJECTIONS[name]
    tile, parts = quantized_gemm.plan(rows, n, k, group_size)
    assert tile.valid() and n % tile.bn == 0 and group_size % tile.bk == 0
    assert tile.bm == (quantized_gemm.SMALL_BM if rows <= quantized_gemm.SMALL_TO_ROWS else quantized_gemm.BIG_BM)
    width = k // parts
    assert k % parts == 0 and width % max(tile.bk, group_size) == 0 and 1 <= parts <= quantized_gemm.MOST_PARTS
    assert parts == 1 or width >= quantized_gemm.MIN_SPLIT_WIDTH
    blocks = (n // tile.bn) * -(-rows // tile.bm)
    cost = quantized_gemm.split_cost(tile, blocks, parts, k)
    for fewer in (1, 2, 4)[: [1, 2, 4, 8].index(parts)]:
        assert quantized_gemm.split_cost(tile, blocks, fewer, k) > cost


@pytest.mark.parametrize(
    ("name", "rows", "bm", "parts"),
    [
        ("qkv", 64, 64, 8),  # 48 tiles: 384 blocks, 3 on the busiest SM
        ("o_proj", 128, 64, 4),  # 64 tiles -> 256 blocks
        ("gate_up", 128, 64, 1),  # 384 tiles fill the GPU
        ("down", 128, 64, 4),
        ("qkv", 256, 128, 4),  # 96 tiles
        ("o_proj", 512, 128, 2),  # 128 tiles -> 256 blocks: 2 a SM; 4 parts would only add partials
        ("gate_up", 512, 128, 1),
        ("o_proj", 1024, 128, 1),  # 256 tiles: 2 a SM already
        ("qkv", 2048, 128, 1),
    ],
)
def test_parts_for_the_8b_projections(name, rows, bm, parts) -> None:
    n, k, _ = PROJECTIONS[name]
    tile, got = quantized_gemm.plan(rows, n, k, 64)
    assert (tile.bm, got) == (bm, parts)


def test_resident_blocks_follow_registers_and_shared_memory() -> None:
    """ptxas: 203 registers for the big tile (2 blocks of 128 threads a SM), 126 for the small one (4)."""
    assert quantized_gemm.resident(quantized_gemm.big_tile()) == 2
    assert quantized_gemm.resident(quantized_gemm.small_tile()) == 4
    assert quantized_gemm.resident(Tile(128, 128, 64, 4, 4)) == 2  # 112 KB of shared memory
    assert quantized_gemm.resident(Tile(128, 256, 32, 8, 4)) == 1


def test_a_forced_tile_is_fitted_to_the_shape() -> None:
    tile, _ = quantized_gemm.plan(512, 384, 4096, 32, Tile(128, 256, 64, 8, 3))
    assert (tile.bn, tile.bk) == (128, 32)  # 384 columns: 128-wide tiles; groups of 32: 32-wide K steps


def test_the_launch_rejects_non_bf16_rows() -> None:
    w, s = _arrays(256, 512, 64)
    with pytest.raises(ValueError, match="bf16"):
        gemm(mx.zeros((4, 512), mx.float32), w, s, s, 64)
    with pytest.raises(ValueError, match="4-bit"):
        gemm(mx.zeros((4, 512), mx.bfloat16), w, s, s, 64, bits=8)
    with pytest.raises(ValueError, match="columns"):
        gemm(mx.zeros((4, 256), mx.bfloat16), w, s, s, 64)


# ---- a numpy emulation of one thread block -------------------------------------------------------------------
# The kernel's index expressions transcribed: each thread's copy streams, the shared-memory rings and swizzle, the
# dequantization units with their (scale, bias) stream, ldmatrix and mma.sync fragments, the epilogue. Shared
# memory records which cp.async group wrote each element: a read of an element whose group is not retired yet, or
# a write to an element another thread reads between the same two barriers, fails the test.


def _bf16(values: np.ndarray) -> np.ndarray:
    """Round float64 values to bf16, to nearest even, once (exact for what is already bf16)."""
    mantissa, exponent = np.frexp(values)
    return np.ldexp(np.rint(mantissa * 256.0), exponent - 8)


def _byte_perm(a: int, b: int, selector: int) -> int:
    data = a | (b << 32)
    return sum(((data >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _dequantize_word(word: int, scale: float, bias: float) -> np.ndarray:
    """The header's `dequantize_word`: byte_perm + lop3 to bf16 bit patterns of 128 + q, minus 128, one fma."""
    shifted, out = word >> 4, []
    for h in range(4):
        bits = (_byte_perm(word, shifted, h | ((4 + h) << 8)) & 0x000F000F) | 0x43004300
        for half in (bits & 0xFFFF, bits >> 16):
            value = np.frombuffer(np.uint32(half << 16).tobytes(), np.float32)[0].astype(np.float64)
            out.append(value - 128.0)
    return _bf16(np.array(out) * scale + bias)


def test_the_bit_trick_gives_each_nibble_in_order() -> None:
    rng = np.random.default_rng(0)
    for word in [0, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98, *rng.integers(0, 2**32, 64).tolist()]:
        nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
        assert _dequantize_word(word, 1.0, 0.0).tolist() == nibbles


def _swz(bk: int, row: int, chunk: int) -> int:
    if bk == 32:
        return row * 32 + ((chunk ^ ((row >> 1) & 3)) << 3)
    return row * 64 + ((chunk ^ (row & 7)) << 3)


@pytest.mark.parametrize("bk", [32, 64])
def test_swizzle_keeps_ldmatrix_phases_on_distinct_banks(bk) -> None:
    """Each 8-row ldmatrix phase (and each 8 consecutive rows a store touches at one chunk) hits 8 distinct
    16-byte bank groups, for every row base and chunk; the XOR on the chunk bits is the `^ kk` the loop uses."""
    for base in range(0, 256, 8):
        for chunk in range(bk // 8):
            groups = {(_swz(bk, base + r, chunk) * 2 // 16) % 8 for r in range(8)}
            assert len(groups) == 8
    for row in range(128):
        for c0 in (0, 1):
            for kk in range(0, bk, 16):
                assert _swz(bk, row, c0) ^ kk == _swz(bk, row, c0 + kk // 8)
                assert _swz(bk, row + 16, c0) == _swz(bk, row, c0) + 16 * bk


class _Smem:
    """One shared-memory array: values, the cp.async group that last wrote each element (-1: landed), and this
    phase's reads and writes."""

    def __init__(self, size: int) -> None:
        self.values = np.zeros(size)
        self.group = np.full(size, -1)
        self.read = np.zeros(size, bool)
        self.wrote = np.zeros(size, bool)

    def write(self, at: np.ndarray, values: np.ndarray, group: int = -1) -> None:
        self.values[at], self.group[at], self.wrote[at] = values, group, True

    def load(self, at: np.ndarray) -> np.ndarray:
        assert (self.group[at] < 0).all(), "read before its cp.async group was waited for"
        self.read[at] = True
        return self.values[at]

    def barrier(self, landed_before: int) -> None:
        assert not (self.read & self.wrote).any(), "an element written and read between the same barriers"
        self.read[:], self.wrote[:] = False, False
        self.group[(self.group >= 0) & (self.group < landed_before)] = -1


def _emulate_block(x, w, scales, biases, group_size, tile: Tile, parts, bx, by, bz, out, hits) -> None:
    """One block of the kernel (`SOURCE`), transcribed; adds its outputs into `out` ([parts, M, N]) and counts
    the writes in `hits`."""
    bm, bn, bk, warps, slots = tile.bm, tile.bn, tile.bk, tile.warps, tile.slots
    threads, warps_m = warps * 32, bm // 64
    warps_n = warps // warps_m
    wn_cols, mt, nt, ch = bn // warps_n, 4, bn // warps_n // 8, bk // 8
    a_tile, b_tile, p_tile = bm * bk, bn * bk, bn * ch
    uw = min(bn * ch // threads, 4)
    units = bn * ch // threads // uw
    gs = group_size
    m, k = x.shape
    n, ks = w.shape[1], w.shape[2] * 8
    kp = k // parts
    steps, k_begin = kp // bk, bz * kp
    slice0 = k_begin // ks
    off0 = k_begin - slice0 * ks
    m0, n0 = bx * bm, by * bn
    a_s, b_s, p_s = _Smem(slots * a_tile), _Smem(2 * b_tile), _Smem(slots * p_tile)
    xf, wf, sf, bf = x.reshape(-1), w.reshape(-1), scales.reshape(-1), biases.reshape(-1)
    committed = [0]

    # copy streams, per thread
    a_per, a_rows = bm * ch // threads, threads // ch
    a_src = [(m0 + t // ch) * k + k_begin + (t % ch) * 8 for t in range(threads)]
    row_pieces = ch // 4
    pieces, p_rows = bn * row_pieces, threads // row_pieces
    p_per = -(-pieces // threads)
    w_src = [((slice0 * n) + n0 + t // row_pieces) * (ks // 8) + off0 // 8 + (t % row_pieces) * 4
             for t in range(threads)]  # fmt: skip
    w_left = [(ks - off0) // bk] * threads

    def copy_input(slot: int) -> None:
        for t in range(threads):
            row, left = t // ch, m - m0 - t // ch
            for i in range(a_per):
                dst = slot * a_tile + _swz(bk, row, t % ch) + i * a_rows * bk + np.arange(8)
                ok = i * a_rows < left
                src = a_src[t] + i * a_rows * k
                a_s.write(dst, xf[src + np.arange(8)] if ok else np.zeros(8), committed[0])
            a_src[t] += bk

    def copy_packed(slot: int) -> None:
        for t in range(threads):
            p_dst = (t // row_pieces) * ch + (t % row_pieces) * 4
            for i in range(p_per):
                if tid_ok := t + threads * i < pieces:
                    dst = slot * p_tile + p_dst + i * p_rows * ch + np.arange(4)
                    src = w_src[t] + i * p_rows * (ks // 8) + np.arange(4)
                    p_s.write(dst, wf[src].astype(np.float64), committed[0])
                assert tid_ok or pieces % threads
            w_src[t] += ch
            w_left[t] -= 1
            if w_left[t] == 0:
                w_src[t] += (n - 1) * (ks // 8)
                w_left[t] = ks // bk

    def commit() -> None:
        committed[0] += 1

    def wait_and_barrier(pending: int) -> None:
        for smem in (a_s, b_s, p_s):
            smem.barrier(committed[0] - pending)

    # dequantization units and their (scale, bias) streams, per thread
    d_rows = threads // (ch // uw)
    state = []
    for t in range(threads):
        st = {"row": t // (ch // uw), "word": (t % (ch // uw)) * uw, "g_step": gs // bk,
              "g_at": (slice0 * n + n0 + t // (ch // uw)) * (ks // gs) + off0 // gs,
              "g_slice": (ks - off0) // gs, "g_part": kp // gs}  # fmt: skip

        def load_group(st=st):
            pair = [(sf[st["g_at"] + u * d_rows * (ks // gs)], bf[st["g_at"] + u * d_rows * (ks // gs)])
                    for u in range(units)]  # fmt: skip
            st["g_at"] += 1
            st["g_part"] -= 1
            st["g_slice"] -= 1
            if st["g_slice"] == 0:
                st["g_at"] += (n - 1) * (ks // gs)
                st["g_slice"] = ks // gs
            return pair

        st["load"] = load_group
        st["cur"] = load_group()
        st["nxt"] = load_group() if st["g_part"] > 0 else None
        state.append(st)

    def dequantize_step(slot: int, buf: int, first: bool) -> None:
        """The kernel's `fetch` then `store` (its first k16 MMAs between them read other buffers)."""
        for st in state:
            if not first:
                st["g_step"] -= 1
                if st["g_step"] == 0:
                    st["g_step"] = gs // bk
                    st["cur"] = st["nxt"]
                    if st["g_part"] > 0:
                        st["nxt"] = st["load"]()
            for u in range(units):
                row = st["row"] + u * d_rows
                at = slot * p_tile + row * ch + st["word"] + np.arange(uw)
                words = p_s.load(at)  # the last step's (after the final step) is a stale slot, never read
                for i in range(uw):
                    scale, bias = st["cur"][u] if st["cur"] is not None else (0.0, 0.0)
                    values = _dequantize_word(int(words[i]), scale, bias)
                    b_s.write(buf * b_tile + _swz(bk, row, st["word"] + i) + np.arange(8), values)

    lanes = np.arange(32)
    g, q = lanes >> 2, lanes & 3

    def ldmatrix(smem: _Smem, addresses: np.ndarray) -> np.ndarray:
        """`ldmatrix.x4`: lanes 8j-8j+7 address matrix j's rows; lane l gets row l / 4, columns 2 (l % 4) + {0, 1}
        of each: [32 lanes, 4 registers, 2 values]."""
        regs = np.zeros((32, 4, 2))
        for j in range(4):
            for e in range(2):
                regs[:, j, e] = smem.load(addresses[8 * j + g] + 2 * q + e)
        return regs

    def mma(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """`mma.sync m16n8k16` on fragments: A 16 x 16 from a (rows g, g + 8; k 2q, 2q + 8), B 16 x 8 from b."""
        am, bmat = np.zeros((16, 16)), np.zeros((16, 8))
        for e in range(2):
            am[g, 2 * q + e], am[g + 8, 2 * q + e] = a[:, 0, e], a[:, 1, e]
            am[g, 2 * q + 8 + e], am[g + 8, 2 * q + 8 + e] = a[:, 2, e], a[:, 3, e]
            bmat[2 * q + e, g], bmat[2 * q + 8 + e, g] = b[:, 0, e], b[:, 1, e]
        c = am @ bmat
        for e in range(2):
            acc[:, e] += c[g, 2 * q + e]
            acc[:, 2 + e] += c[g + 8, 2 * q + e]

    accs = np.zeros((warps, mt, nt, 32, 4))
    for j in range(slots):
        if j < steps:
            copy_packed(j)
        if j >= 1 and j - 1 < steps:
            copy_input(j - 1)
        commit()
    wait_and_barrier(slots - 1)
    dequantize_step(0, 0, True)
    ring = 0
    for step in range(steps):
        wait_and_barrier(slots - 2)
        ring_prev, ring_next = (ring - 1) % slots, (ring + 1) % slots
        if step + slots < steps:
            copy_packed(ring)
        if step + slots - 1 < steps:
            copy_input(ring_prev)
        commit()
        dequantize_step(ring_next, (step + 1) & 1, False)
        for warp in range(warps):
            wm, wn = (warp // warps_n) * 64, (warp % warps_n) * wn_cols
            a_off = np.array([_swz(bk, wm + (lane & 15), lane >> 4) for lane in lanes])
            b_off = np.array([_swz(bk, wn + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1) for lane in lanes])
            mt_on = int(np.trunc((m - m0 - wm + 15) / 16))  # C's division: m16 tiles with rows of x
            for kk in range(0, bk, 16):
                a = [ldmatrix(a_s, ring * a_tile + (a_off ^ kk) + i * 16 * bk) if i < mt_on else None
                     for i in range(mt)]  # fmt: skip
                for j in range(0, nt, 2):
                    b = ldmatrix(b_s, ((step & 1) * b_tile) + (b_off ^ kk) + j * 8 * bk)
                    for i in range(min(mt, mt_on)):
                        mma(accs[warp, i, j], a[i], b[:, 0:2])
                        mma(accs[warp, i, j + 1], a[i], b[:, 2:4])
        ring = ring_next
    for warp in range(warps):
        wm, wn = (warp // warps_n) * 64, (warp % warps_n) * wn_cols
        for i in range(mt):
            for j in range(nt):
                c = n0 + wn + j * 8 + q * 2
                for half in range(2):
                    r = m0 + wm + i * 16 + g + 8 * half
                    for e in range(2):
                        keep = r < m
                        np.add.at(out[bz], (r[keep], c[keep] + e), accs[warp, i, j][keep, 2 * half + e])
                        np.add.at(hits[bz], (r[keep], c[keep] + e), 1)


def _problem(m: int, n: int, k: int, group_size: int, slices: int, seed: int):
    rng = np.random.default_rng(seed)
    x = _bf16(rng.standard_normal((m, k)))
    packed = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint64)
    scales = _bf16(rng.uniform(0.01, 0.05, (n, k // group_size)))
    biases = _bf16(rng.uniform(-0.4, -0.1, (n, k // group_size)))
    dense = np.stack([_dequantize_word(int(word), scales[r, c * 8 // group_size], biases[r, c * 8 // group_size])
                      for r in range(n) for c, word in enumerate(packed[r])]).reshape(n, k)  # fmt: skip

    def split(a):
        return np.ascontiguousarray(a.reshape(a.shape[0], slices, -1).swapaxes(0, 1))

    return x, split(packed), split(scales), split(biases), x @ dense.T


@pytest.mark.parametrize(
    ("tile", "m", "n", "k", "group_size", "slices", "parts"),
    [
        (Tile(128, 128, 32, 4, 3), 150, 128, 256, 64, 1, 1),  # the big tile, a ragged second row tile
        (Tile(128, 128, 32, 4, 3), 40, 128, 512, 64, 2, 2),  # K in slices and in parts (a part per slice)
        (Tile(128, 128, 32, 4, 3), 70, 128, 1024, 128, 2, 4),  # parts inside slices
        (Tile(64, 128, 32, 4, 4), 70, 256, 384, 32, 3, 1),  # the small tile, groups of 32, 3 slices
        (Tile(64, 128, 32, 4, 2), 64, 128, 256, 64, 1, 1),  # 2 slots: no copies in flight at the waits
        (Tile(128, 128, 32, 8, 3), 128, 128, 256, 128, 1, 1),  # 8 warps: half-row dequantization units
        (Tile(64, 128, 32, 8, 4), 33, 128, 192, 64, 1, 1),  # 8 warps of 64 x 16
        (Tile(64, 128, 32, 2, 4), 80, 128, 256, 64, 2, 2),  # 2 warps of 64 x 64: two units a thread
        (Tile(128, 256, 32, 8, 4), 130, 256, 256, 64, 2, 1),  # 256 columns
        (Tile(128, 128, 64, 4, 4), 100, 128, 512, 64, 1, 2),  # 64-wide K steps: two units a thread
        (Tile(128, 128, 64, 4, 3), 20, 128, 128, 64, 1, 1),  # fewer steps than slots
    ],
)
def test_the_emulated_block_computes_its_tile(tile, m, n, k, group_size, slices, parts) -> None:
    x, packed, scales, biases, want = _problem(m, n, k, group_size, slices, seed=m + k)
    assert tile.valid()
    out, hits = np.zeros((parts, m, n)), np.zeros((parts, m, n), int)
    for bz in range(parts):
        for by in range(n // tile.bn):
            for bx in range(-(-m // tile.bm)):
                _emulate_block(x, packed, scales, biases, group_size, tile, parts, bx, by, bz, out, hits)
    assert (hits == 1).all()  # every output of every part written once
    np.testing.assert_allclose(out.sum(axis=0), want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


# ---- nvcc builds: every kernel the launcher makes, with ptxas' resource usage ---------------------------------


@pytest.fixture
def kernels(monkeypatch):
    """The recorded launches; the builders' caches cleared around the test (see test_kernels_compile)."""
    builders = (quantized_gemm._kernel, quantized_gemm._reduce_kernel, dequantize._kernel)
    for builder in builders:
        builder.cache_clear()
    with recorded_kernels(monkeypatch) as recorded:
        yield recorded
    for builder in builders:
        builder.cache_clear()


def _ptxas(source: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "kernels.cu"
        path.write_text(source)
        command = [nvcc(), "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-c", str(path), "-o",
                   str(Path(scratch) / "k.o")]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, timeout=900)


CUT = "namespace cg = cooperative_groups;\n"


def _compile_all(recorded) -> list[tuple[str, str]]:
    """Each distinct recorded unit compiled with `-Xptxas -v`, the units of one kernel (same name and header) as
    one translation unit, each as `<name>__k<i>` (nvcc's front end is most of the time: seconds a unit). Returns
    (kernel and template constants, ptxas' resource lines) for each; asserts success, no spills and static shared
    memory within 48 KB."""
    assert recorded, "no kernel was launched"
    units = list({kernel.source: kernel for kernel in recorded}.values())
    families: dict[str, list] = {}
    for kernel in units:
        families.setdefault(kernel.source.split(CUT)[0], []).append(kernel)
    sources, labels = [], {}
    for prefix, kernels in families.items():
        bodies = []
        for kernel in kernels:
            index = len(labels)
            body = kernel.source.split(CUT, 1)[1].rstrip()
            assert body.endswith("}"), "the unit ends by closing its namespace"
            body = body[:-1].replace(f"__global__ void {kernel.name}(", f"__global__ void {kernel.name}__k{index}(", 1)
            constants = " ".join(re.findall(r"constexpr (?:int|bool) (\w+ = \w+);", body.split("__global__")[1]))
            labels[index] = f"{kernel.name} {constants}"
            bodies.append(body)
        sources.append(prefix + CUT + "\n".join(bodies) + "\n}\n")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(_ptxas, sources))
    info: dict[int, list[str]] = {}
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]
        current = None
        for line in result.stderr.splitlines():
            if found := re.search(r"Compiling entry function '\S*__k(\d+)E", line):
                current = int(found.group(1))
            elif current is not None and ("registers" in line or "spill" in line):
                info.setdefault(current, []).append(line.split("info    : ")[-1].strip())
    usage = []
    for index, label in labels.items():
        lines = info[index]
        assert any("Used" in line for line in lines), (label, lines)
        assert all(" 0 bytes spill stores" in line for line in lines if "spill" in line), (label, lines)
        assert all(int(v) <= 48 * 1024 for line in lines for v in re.findall(r"(\d+) bytes smem", line)), (label, lines)
        usage.append((label, "; ".join(lines)))
    return usage


@needs_nvcc
def test_every_gemm_kernel_the_launcher_makes_compiles_without_spills(kernels) -> None:
    """The default tiles over every group size, bf16 output and fp32 partials (K split), whole and split weights,
    and the reduction; ptxas' resource lines are printed (`pytest -s`)."""
    shapes = [(64, 4096, 4096), (512, 4096, 4096), (2048, 4096, 4096), (128, 24576, 512)]
    for rows, n, k in shapes:  # small split, big split, big whole, small whole
        for group_size in quantized_gemm.GROUP_SIZES:
            for slices in (1, 8) if k > 512 else (1,):
                w, s = _arrays(n, k, group_size, slices)
                gemm(mx.zeros((rows, k), mx.bfloat16), w, s, s, group_size)
    assert {quantized_gemm.plan(rows, n, k, 64)[1] > 1 for rows, n, k in shapes} == {True, False}
    for name, info in _compile_all(kernels):
        print(name, "|", info)


@needs_nvcc
def test_the_larger_tiles_compile_without_spills(kernels) -> None:
    """The variants `--variants` can ask for: 8 warps, 256 columns, 64-wide K steps (dynamic shared memory)."""
    w, s = _arrays(4096, 4096, 64)
    for tile in TILES[2:]:
        for rows in (64, 2048):
            gemm(mx.zeros((rows, 4096), mx.bfloat16), w, s, s, 64, tile=tile)
    for name, info in _compile_all(kernels):
        print(name, "|", info)


@needs_nvcc
def test_every_dequantize_mapping_compiles_without_spills(kernels, monkeypatch) -> None:
    for vec, contiguous in ((1, 0), (4, 0), (8, 0), (4, 1), (8, 1)):
        monkeypatch.setattr(dequantize, "WORDS_PER_THREAD", vec)
        monkeypatch.setattr(dequantize, "CONTIGUOUS", contiguous)
        for group_size in dequantize.GROUP_SIZES:  # the contiguous mapping reads 2 groups a thread at 32
            w, s = _arrays(256, 4096, group_size, 8)
            assert dequantize.dequantize_4bit(w, s, s, group_size).shape == (256, 4096)
    for name, info in _compile_all(kernels):
        print(name, "|", info)


# ---- on the device --------------------------------------------------------------------------------------------


@functools.cache
def _quantized(n: int, k: int, group_size: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    weight = mx.array((rng.standard_normal((n, k)) * 0.05).astype(np.float32)).astype(mx.bfloat16)
    arrays = mx.quantize(weight, group_size=group_size, bits=4)
    mx.eval(arrays)
    return arrays


@functools.cache
def _dense64(n: int, k: int, group_size: int, seed: int) -> np.ndarray:
    """The dequantized weight (MLX's CUDA dequantization: one rounding) in float64."""
    weight, scales, biases = _quantized(n, k, group_size, seed)
    return np.array(mx.dequantize(weight, scales, biases, group_size, 4).astype(mx.float32)).astype(np.float64)


def _split(arrays, slices: int):
    if slices == 1:
        return arrays
    return tuple(mx.contiguous(a.reshape(a.shape[0], slices, -1).swapaxes(0, 1)) for a in arrays)


def _check_against_float64(got: mx.array, x: mx.array, dense: np.ndarray) -> None:
    """Sampled rows (each row tile's first and last, a few more) against float64 sums: within bf16's rounding of
    the output (2^-8 relative) plus fp32 summation (1e-3 of the largest output)."""
    rows = got.shape[0]
    picked = sorted({0, rows - 1, *range(63, rows, 64), *range(64, rows, 64)} | set(
        np.random.default_rng(rows).integers(0, rows, 8).tolist()))[:40]  # fmt: skip
    want = np.array(x[mx.array(picked)].astype(mx.float32)).astype(np.float64) @ dense.T
    ours = np.array(got[mx.array(picked)].astype(mx.float32)).astype(np.float64)
    bound = 2.0**-8 * np.abs(want) + 1e-3 * np.abs(want).max()
    assert np.isfinite(ours).all() and (np.abs(ours - want) <= bound).all(), np.abs(ours - want).max()


DEVICE_ROWS = [1, 7, 64, 65, 128, 129, 200, 256, 512, 1000, 2048]


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("rows", DEVICE_ROWS)
@pytest.mark.parametrize("name", list(PROJECTIONS))
@pytest.mark.parametrize("group_size", [64, 128])
def test_8b_projections_against_float64(rows, name, group_size) -> None:
    """Qwen3-8B's projections in the layout the engine holds them (o_proj and down in 8 K slices)."""
    n, k, slices = PROJECTIONS[name]
    arrays = _split(_quantized(n, k, group_size, seed=n + k), slices)
    x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(mx.bfloat16)
    got = gemm(x, *arrays, group_size)
    assert got.shape == (rows, n) and got.dtype == mx.bfloat16
    _check_against_float64(got, x, _dense64(n, k, group_size, seed=n + k))


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("rows", DEVICE_ROWS)
@pytest.mark.parametrize(("n", "k", "group_size", "slices"),
                         [(128, 128, 64, 1), (256, 96, 32, 1), (384, 320, 64, 1), (128, 1536, 128, 3),
                          (4096, 4096, 32, 1), (4096, 4096, 64, 2)])  # fmt: skip
def test_small_and_odd_shapes_against_float64(rows, n, k, group_size, slices) -> None:
    arrays = _split(_quantized(n, k, group_size, seed=n * k), slices)
    x = mx.random.normal((rows, k), key=mx.random.key(rows + 1)).astype(mx.bfloat16)
    _check_against_float64(gemm(x, *arrays, group_size), x, _dense64(n, k, group_size, seed=n * k))


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("tile", TILES, ids=lambda tile: tile.name)
@pytest.mark.parametrize("rows", [64, 200, 1000])
@pytest.mark.parametrize("slices", [1, 8])
def test_every_tile_against_float64(tile, rows, slices) -> None:
    """Each configuration, forced (the larger ones take dynamic shared memory), whole and split over K."""
    arrays = _split(_quantized(4096, 4096, 64, seed=7), slices)
    x = mx.random.normal((rows, 4096), key=mx.random.key(rows + 2)).astype(mx.bfloat16)
    _check_against_float64(gemm(x, *arrays, 64, tile=tile), x, _dense64(4096, 4096, 64, seed=7))


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("tile", TILES, ids=lambda tile: tile.name)
@pytest.mark.parametrize(("group_size", "slices"), [(64, 1), (128, 1), (64, 8)])
def test_unsplit_products_equal_dequantize_then_matmul_bit_for_bit(tile, group_size, slices) -> None:
    """Where no block splits K (2,048 rows of 6,144 columns fill the GPU), each output's K is summed in order, 16
    at a time in fp32, as MLX's bf16 GEMM does on the H200 (see test_quantized_tiles): the answer is
    dequantize-then-matmul's exactly, so a weight rounded other than as MLX dequantizes it fails here."""
    weight, scales, biases = _quantized(6144, 4096, group_size, seed=group_size)
    x = mx.random.normal((2048, 4096), key=mx.random.key(3)).astype(mx.bfloat16)
    assert quantized_gemm.plan(2048, 6144, 4096, group_size, tile)[1] == 1
    got = gemm(x, *_split((weight, scales, biases), slices), group_size, tile=tile)
    want = quantized_rows.reference_matmul(x, weight, scales, biases, group_size, 4)
    assert mx.array_equal(got, want).item()


@pytest.mark.device
@on_cuda
def test_split_products_are_deterministic() -> None:
    """fp32 partials summed in a fixed order: the same bits every call."""
    arrays = _quantized(4096, 4096, 64, seed=11)
    x = mx.random.normal((100, 4096), key=mx.random.key(5)).astype(mx.bfloat16)
    assert quantized_gemm.plan(100, 4096, 4096, 64)[1] > 1
    first = gemm(x, *arrays, 64)
    for _ in range(3):
        assert mx.array_equal(gemm(x, *arrays, 64), first).item()


@pytest.mark.device
@on_cuda
def test_rows_of_a_folded_linear_equal_mlx_quantized_matmul() -> None:
    """Through `quantized_rows.split_k`'s layout (as the engine holds o_proj): MLX's own quantized matmul of the
    whole weight, within bf16 tolerance."""
    dense = nn.Linear(4096, 4096, bias=False)
    dense.weight = (mx.random.normal((4096, 4096), key=mx.random.key(1)) * 0.02).astype(mx.bfloat16)
    linear = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4)
    x = mx.random.normal((300, 4096), key=mx.random.key(2)).astype(mx.bfloat16)
    want = linear(x).astype(mx.float32)
    linear.__class__ = quantized_rows.RowsQuantizedLinear
    quantized_rows.split_k(linear, 8)
    got = gemm(x, linear.weight, linear.scales, linear.biases, 64).astype(mx.float32)
    assert mx.abs(got - want).max().item() <= 1e-2 * mx.abs(want).max().item()
