"""A 4-bit GEMM for prefill-sized products: `y = x @ dequantize(W).T`, each weight slice dequantized once per block.

Why: a contended 8B step (8 decode rows + a 64-1,024-row prefill chunk) runs every projection as one `[M, K] x
[N, K]^T` product. `quantized_tiles` (33-128 rows) dequantizes each weight fragment in every warp's registers
(~110 TFLOP/s at 128 rows on the H200, ALU-bound: ncu at 512 rows showed issue slots 44% busy, ALU the busiest
pipe); from 129 rows the engine writes the whole bf16 weight (`dequantize`, ~0.25 ms an 8B layer) and runs cuBLAS.

Here a thread block computes a `BM x BN` output tile with bf16 tensor-core MMAs (`mma.sync m16n8k16`, fp32 sums):
- `cp.async` stages each step's `BM x BK` input slice and `BN x BK` packed weight slice (a quarter of its bf16
  size) `SLOTS - 1` K steps ahead, in `SLOTS` shared-memory slots;
- one step ahead of the MMAs, the block's threads turn the packed slice into a bf16 `BN x BK` tile in shared memory
  (two buffers), each weight once per block (a few words a thread: `w = bf16(q * scale + bias)`, one rounding, as
  MLX dequantizes), and every warp reads its B fragments from that tile with `ldmatrix`, as a bf16 GEMM does. The
  dequantization per MMA falls with the block's rows (`BM`), not a warp's: 128 rows cost ~1 ALU instruction per
  MMA (the register form ~2.5);
- warps own 64-row tiles (`WARPS = 4` at `BM = BN = 128`: 64 x 64 each, 4 A and 4 B `ldmatrix.x4` per 32 MMAs,
  the shared-memory traffic that keeps `mma.sync` fed; 8 warps of 64 x 32 need 1.5x the traffic per MMA);
- a group's (scale, bias) is loaded by the thread that dequantizes its row, one group ahead (plain loads: a step
  never crosses a group, so a thread loads a pair only when its group changes);
- one barrier a K step: the wait and barrier at the top of step `s` cover the copies of step `s`'s input slice
  and step `s + 1`'s packed slice (one `cp.async` group), the dequantized tile of step `s` written in the
  previous step, and every warp being done with the buffers the step's copies and dequantization refill;
- a warp skips the loads and MMAs of its m16 tiles wholly past M: a step's `chunk + 8` decode rows leave the last
  row tile nearly empty, and it then costs its weight-side work, not its MMAs.

Shared memory: `SLOTS * (BM * BK * 2 + BN * BK / 2) + 2 * BN * BK * 2` bytes. Static up to 48 KB (128 x 128 x 32
with 3 slots: 46 KB); larger tiles go to dynamic shared memory (MLX 0.32's `cuda_kernel(shared_memory=)` opts a
kernel past 48 KB), only where the module's constants ask for them.

Weights whole `[N, K/8]` or in `S` slices of K `[S, N, K/S/8]` (`quantized_rows.split_k`'s layout): a K step never
crosses a slice, so either layout gives the same product. Where the output tiles would not fill the GPU, K is
split across blocks (`gridDim.z` parts) into fp32 partial sums `[Z, M, N]`, summed in order by a second kernel:
deterministic, unlike atomics. Unsplit, each output's K is summed in order 16 at a time, as the bf16 GEMM over
the dequantized weights does (`dequantize.dense_matmul`), so the two give the same bits.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import mlx.core as mx

from mlx_serve.kernels.dequantize import DEQUANTIZE_HEADER
from mlx_serve.kernels.mma import MMA_HEADER

GROUP_SIZES = (32, 64, 128)
STATIC_SMEM = 48 * 1024  # past this, a kernel takes its shared memory dynamically (opted in at launch)
MOST_SMEM = 227 * 1024  # the H200's most shared memory a block

# The two tiles the launcher picks between (module constants, so `bench_quantized --variants` can set them):
# rows (BM), output columns (BN), K a step (BK, 32 or 64), warps (4 or 8, each 64 rows), shared-memory slots
# (K steps of copies in flight + 1)
BIG_BM, BIG_BN, BIG_BK, BIG_WARPS, BIG_SLOTS = 128, 128, 32, 4, 3  # 46 KB static
SMALL_BM, SMALL_BN, SMALL_BK, SMALL_WARPS, SMALL_SLOTS = 64, 128, 32, 4, 4  # 40 KB static
SMALL_TO_ROWS = 128  # products of at most this many rows take the small tile (more blocks, less split K)
# K split into parts (`k_parts`) by an estimate of the product's time: the busiest SM's blocks, at the share of
# its tensor throughput their resident warps reach, plus the fp32 partials each part writes and the reduction
# reads back
SMS = 132  # the H200's SMs
SATURATION_WARPS = 8  # resident warps an SM needs to keep mma.sync busy (2 blocks of 4 warps; to be measured)
# one part's partials against the whole product's time: 4 bytes written and read per output and part over
# 2K flops per output: 4 * 2 * (achieved FLOP/s ~4e14) / (2 * bandwidth ~5e12, mostly L2) = 320 / K
SPLIT_COST = 320.0
MIN_SPLIT_WIDTH = 512  # narrowest K range a block's part takes
MOST_PARTS = 8

HEADER = MMA_HEADER + DEQUANTIZE_HEADER + r"""
// Where 16-byte chunk `chunk` of row `row` of a BK-wide bf16 tile sits, in elements from the tile's start: rows
// unpadded, chunks XOR-swizzled so that the 8 rows of an ldmatrix phase (and of a warp's 16-byte stores) fall on
// 8 distinct 16-byte bank groups: 64-byte rows (BK 32) by row bits 1-2, 128-byte rows (BK 64) by bits 0-2. The
// XOR touches only the chunk bits, so `swz(row, c) ^ (16 * i) == swz(row, c + 2 * i)` for c in {0, 1}, and rows
// 16 apart share the pattern.
template <int BK> __device__ __forceinline__ int swz(int row, int chunk);
template <> __device__ __forceinline__ int swz<32>(int row, int chunk) {
  return row * 32 + ((chunk ^ ((row >> 1) & 3)) << 3);
}
template <> __device__ __forceinline__ int swz<64>(int row, int chunk) {
  return row * 64 + ((chunk ^ (row & 7)) << 3);
}
"""

# Template: BM, BN, BK (32 or 64, <= GS), WARPS (BM / 64 warps along M, the rest along N), SLOTS (>= 2), GS,
# OUT_F32 (fp32 partials [gridDim.z, M, N], else bf16 [M, N]), DYN (shared memory dynamic, else static). Inputs: x
# [M, K] bf16, w [S, N, K / S / 8] uint32 (8 nibbles a word, lowest first), scales and biases [S, N, K / S / GS]
# bf16. Grid: (ceil(M / BM) * THREADS, N / BN, parts) threads, blocks of THREADS: row tiles fastest, so blocks
# that run together share weight tiles (the weights are read from HBM about once; x stays in L2).
SOURCE = r"""
  constexpr int THREADS = WARPS * 32;
  constexpr int WARPS_M = BM / 64, WARPS_N = WARPS / WARPS_M;
  constexpr int WN = BN / WARPS_N, MT = 4, NT = WN / 8;         // a warp: 64 rows x WN columns, m16 x n8 tiles
  constexpr int CH = BK / 8;                                    // 16-byte chunks a bf16 row; packed words a row
  constexpr int A_TILE = BM * BK, B_TILE = BN * BK, P_TILE = BN * CH;  // bf16, bf16, uint32 elements
  constexpr int UW = (BN * CH / THREADS) < 4 ? (BN * CH / THREADS) : 4;  // words a dequantization unit: 2 or 4
  constexpr int UNITS = BN * CH / THREADS / UW;                 // units a thread
  constexpr int STEPS_PER_GROUP = GS / BK;
  constexpr int SMEM = SLOTS * (A_TILE * 2 + P_TILE * 4) + 2 * B_TILE * 2;
  static_assert(BM % 64 == 0 && WARPS % WARPS_M == 0 && NT % 2 == 0 && NT >= 2, "warp tiles of 64 x 16k");
  static_assert(BK == 32 || BK == 64, "K steps of 32 or 64");
  static_assert(GS % BK == 0, "a K step never crosses a group");
  static_assert(UW == 2 || UW == 4, "dequantization units of 2 or 4 words");
  static_assert(THREADS % CH == 0 && (BM * CH) % THREADS == 0, "whole input rows of copies");
  static_assert(SLOTS >= 2, "at least one K step of copies in flight");
  static_assert(DYN || SMEM <= 48 * 1024, "static shared memory: at most 48 KB");
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  __shared__ __align__(16) unsigned char static_smem[DYN ? 16 : SMEM];
  __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(DYN ? dynamic_smem : static_smem);  // SLOTS x BM x BK
  __nv_bfloat16* Bs = As + SLOTS * A_TILE;                      // 2 x BN x BK, dequantized
  uint32_t* Ps = reinterpret_cast<uint32_t*>(Bs + 2 * B_TILE);  // SLOTS x BN x CH, packed

  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[1];
  const int Ks = w_shape[2] * 8;                                // K of one weight slice (K when whole)
  const int Kp = K / gridDim.z;                                 // K of this block's part
  const int steps = Kp / BK;
  const int k_begin = blockIdx.z * Kp;
  const int slice0 = k_begin / Ks, off0 = k_begin - slice0 * Ks;  // where the part starts: slice, K within it
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // Copies walk K one step at a time, so their sources are streams advanced per copy (no division in the loop).
  // Input: A_PER 16-byte pieces a step, rows a_row + i * A_ROWS (zeros past M), chunk tid % CH; `a_src` the
  // first's source at the next step to copy.
  constexpr int A_PER = BM * CH / THREADS, A_ROWS = THREADS / CH;
  const int a_row = tid / CH, a_dst = swz<BK>(a_row, tid % CH);
  const __nv_bfloat16* a_src = x + (size_t)(m0 + a_row) * K + k_begin + (tid % CH) * 8;
  const int a_left = M - m0 - a_row;                            // piece i is a row of x while i * A_ROWS < a_left
  auto copy_input = [&](int slot) {
    #pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      const bool ok = i * A_ROWS < a_left;
      cp_async16(As + slot * A_TILE + a_dst + i * A_ROWS * BK, ok ? a_src + (size_t)i * A_ROWS * K : x, ok);
    }
    a_src += BK;
  };
  // Packed weights: pieces p = tid + THREADS * i of BN rows x CH / 4 pieces; `w_src` the first's source at the
  // next step to copy, `w_left` the steps before its slice ends (then on to the next slice's rows).
  constexpr int ROW_PIECES = CH / 4, PIECES = BN * ROW_PIECES, P_PER = (PIECES + THREADS - 1) / THREADS;
  constexpr int P_ROWS = THREADS / ROW_PIECES;
  const int p_row = tid / ROW_PIECES, p_dst = p_row * CH + (tid % ROW_PIECES) * 4;
  const uint32_t* w_src = w + ((size_t)slice0 * N + n0 + p_row) * (Ks / 8) + off0 / 8 + (tid % ROW_PIECES) * 4;
  int w_left = (Ks - off0) / BK;
  auto copy_packed = [&](int slot) {
    #pragma unroll
    for (int i = 0; i < P_PER; ++i)
      if (PIECES % THREADS == 0 || tid + THREADS * i < PIECES)
        cp_async16(Ps + slot * P_TILE + p_dst + i * P_ROWS * CH, w_src + (size_t)i * P_ROWS * (Ks / 8), true);
    w_src += CH;
    if (--w_left == 0) {
      w_src += (size_t)(N - 1) * (Ks / 8);
      w_left = Ks / BK;
    }
  };

  // Dequantization: unit u is UW words of packed row d_row + u * D_ROWS from word d_word. Its group's (scale,
  // bias) is cur[u], the next group's nxt[u], loaded one group ahead from a stream: `g_at` the index (unit 0's
  // row) of the group after nxt, `g_slice` the groups before its slice ends, `g_part` the part's groups not yet
  // loaded, `g_step` the steps left in cur's group.
  constexpr int D_ROWS = THREADS / (CH / UW);
  const int d_row = tid / (CH / UW), d_word = (tid % (CH / UW)) * UW;
  int g_at = ((slice0 * N) + n0 + d_row) * (Ks / GS) + off0 / GS;
  int g_slice = (Ks - off0) / GS, g_part = Kp / GS, g_step = STEPS_PER_GROUP;
  __nv_bfloat162 cur[UNITS], nxt[UNITS];
  auto load_group = [&](__nv_bfloat162 (&pair)[UNITS]) {
    #pragma unroll
    for (int u = 0; u < UNITS; ++u) {
      const int g = g_at + u * D_ROWS * (Ks / GS);
      pair[u] = __halves2bfloat162(scales[g], biases[g]);
    }
    ++g_at;
    --g_part;
    if (--g_slice == 0) {
      g_at += (N - 1) * (Ks / GS);
      g_slice = Ks / GS;
    }
  };
  load_group(cur);
  if (g_part > 0) {
    load_group(nxt);
  } else {
    #pragma unroll
    for (int u = 0; u < UNITS; ++u) nxt[u] = cur[u];  // one group a part: only the stale last step reads it
  }
  // the packed slice in `slot` into bf16 buffer `buf`, in two halves: `fetch` (after the first step, a step that
  // starts a group moves to the prefetched pair and loads the next; then the packed words), `store` (the
  // arithmetic and 16-byte stores), the step's first MMAs between them so that a warp's dequantization overlaps
  // its own MMAs. It runs for step `steps` too (a stale slot into a buffer no warp reads: no branch around it).
  auto fetch = [&](int slot, bool first, uint32_t (&q)[UNITS][UW]) {
    if (!first && --g_step == 0) {
      g_step = STEPS_PER_GROUP;
      #pragma unroll
      for (int u = 0; u < UNITS; ++u) cur[u] = nxt[u];
      if (g_part > 0) load_group(nxt);
    }
    const uint32_t* src = Ps + slot * P_TILE;
    #pragma unroll
    for (int u = 0; u < UNITS; ++u) {
      const uint32_t* at = src + (d_row + u * D_ROWS) * CH + d_word;
      if constexpr (UW == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(at);
        q[u][0] = v.x; q[u][1] = v.y; q[u][2] = v.z; q[u][3] = v.w;
      } else {
        const uint2 v = *reinterpret_cast<const uint2*>(at);
        q[u][0] = v.x; q[u][1] = v.y;
      }
    }
  };
  auto store = [&](int buf, const uint32_t (&q)[UNITS][UW]) {
    __nv_bfloat16* dst = Bs + buf * B_TILE;
    #pragma unroll
    for (int u = 0; u < UNITS; ++u) {
      const __nv_bfloat162 scale = __low2bfloat162(cur[u]), bias = __high2bfloat162(cur[u]);
      #pragma unroll
      for (int i = 0; i < UW; ++i)
        *reinterpret_cast<uint4*>(dst + swz<BK>(d_row + u * D_ROWS, d_word + i)) = dequantize_word(q[u][i], scale, bias);
    }
  };

  // ldmatrix addresses: A lanes 0-15 rows 0-15 at k, 16-31 the same rows at k + 8; B lanes 0-7 rows n 0-7 at k,
  // 8-15 the same at k + 8, 16-23 rows n 8-15 at k, 24-31 those at k + 8 (two n8 tiles a load)
  const int wm = (warp / WARPS_N) * 64, wn = (warp % WARPS_N) * WN;
  const int a_off = swz<BK>(wm + (lane & 15), lane >> 4);
  const int b_off = swz<BK>(wn + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  // m16 tiles wholly past M skip their loads and MMAs (the last row tile of a step of chunk + 8 decode rows)
  const int mt_on = (M - m0 - wm + 15) / 16;
  // one k16 slice of the step's MMAs: a warp's MT x NT tiles from the input slot and dequantized buffer
  auto mma_k16 = [&](const __nv_bfloat16* a_tile, const __nv_bfloat16* b_tile, int kk, float (&acc)[MT][NT][4]) {
    // every fragment first (their ldmatrix latencies overlap), then the MMAs
    unsigned a[MT][4], b[NT / 2][4];
    #pragma unroll
    for (int i = 0; i < MT; ++i)
      if (i < mt_on) ldmatrix_x4(a[i], a_tile + (a_off ^ kk) + i * 16 * BK);
    #pragma unroll
    for (int j = 0; j < NT; j += 2) ldmatrix_x4(b[j / 2], b_tile + (b_off ^ kk) + j * 8 * BK);
    #pragma unroll
    for (int j = 0; j < NT; j += 2) {
      const unsigned b0[2] = {b[j / 2][0], b[j / 2][1]}, b1[2] = {b[j / 2][2], b[j / 2][3]};
      #pragma unroll
      for (int i = 0; i < MT; ++i) {
        if (i < mt_on) {
          mma_bf16(acc[i][j], a[i], b0);
          mma_bf16(acc[i][j + 1], a[i], b1);
        }
      }
    }
  };

  float acc[MT][NT][4];
  zero(acc);
  // Copy group j holds step j's packed slice (slot j % SLOTS) and step j - 1's input (slot (j - 1) % SLOTS). The
  // wait and barrier at the top of step s cover group s + 1 (step s's input, step s + 1's packed slice), the
  // tile dequantized in the previous step, and every warp being done with what this step's copies (group s +
  // SLOTS: packed slot s % SLOTS, read by step s's dequantization in the previous step; input slot (s - 1) %
  // SLOTS, read by step s - 1's MMAs) and dequantization (buffer (s + 1) & 1, read by step s - 1's MMAs) refill.
  #pragma unroll
  for (int j = 0; j < SLOTS; ++j) {
    if (j < steps) copy_packed(j);
    if (j >= 1 && j - 1 < steps) copy_input(j - 1);
    cp_async_commit();
  }
  uint32_t q[UNITS][UW];
  cp_async_wait<SLOTS - 1>();  // group 0: step 0's packed slice
  __syncthreads();
  fetch(0, true, q);
  store(0, q);
  int ring = 0;  // step % SLOTS
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<SLOTS - 2>();  // group step + 1
    __syncthreads();
    const int ring_prev = ring == 0 ? SLOTS - 1 : ring - 1, ring_next = ring == SLOTS - 1 ? 0 : ring + 1;
    if (step + SLOTS < steps) copy_packed(ring);
    if (step + SLOTS - 1 < steps) copy_input(ring_prev);
    cp_async_commit();
    const __nv_bfloat16* a_tile = As + ring * A_TILE;
    const __nv_bfloat16* b_tile = Bs + (step & 1) * B_TILE;
    fetch(ring_next, false, q);  // step + 1's packed words
    mma_k16(a_tile, b_tile, 0, acc);
    store((step + 1) & 1, q);  // step + 1's bf16 tile
    #pragma unroll
    for (int kk = 16; kk < BK; kk += 16) mma_k16(a_tile, b_tile, kk, acc);
    ring = ring_next;
  }

  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int c = n0 + wn + j * 8 + (lane & 3) * 2;
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + wm + i * 16 + (lane >> 2) + 8 * half;
        if (r >= M) continue;
        const float v0 = acc[i][j][2 * half], v1 = acc[i][j][2 * half + 1];
        if constexpr (OUT_F32) {
          *reinterpret_cast<float2*>(y + ((size_t)blockIdx.z * M + r) * N + c) = make_float2(v0, v1);
        } else {
          *reinterpret_cast<__nv_bfloat162*>(y + (size_t)r * N + c) = __floats2bfloat162_rn(v0, v1);
        }
      }
    }
"""

# The split-K partials summed in order (z = 0, 1, ...) and rounded to bf16 once. Input: partial [Z, M, N] fp32 (N a
# multiple of 4). Output: y [M, N] bf16. Grid: M * N / 4 threads, 4 consecutive outputs each.
REDUCE_SOURCE = r"""
  const int Z = partial_shape[0];
  const size_t count = (size_t)partial_shape[1] * partial_shape[2];
  const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= count) return;
  float4 sum = *reinterpret_cast<const float4*>(partial + i);
  for (int z = 1; z < Z; ++z) {
    const float4 v = *reinterpret_cast<const float4*>(partial + (size_t)z * count + i);
    sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
  }
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(y + i);
  out[0] = __floats2bfloat162_rn(sum.x, sum.y);
  out[1] = __floats2bfloat162_rn(sum.z, sum.w);
"""


@dataclass(frozen=True)
class Tile:
    """One kernel configuration: a block's `bm x bn` output tile, K `bk` a step, `warps` warps (each 64 rows x
    `bn / (warps / (bm / 64))` columns) and `slots` shared-memory stages."""

    bm: int
    bn: int
    bk: int
    warps: int
    slots: int

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem(self) -> int:
        """Shared memory a block (bytes): input and packed slots, two dequantized bf16 buffers."""
        return self.slots * (self.bm * self.bk * 2 + self.bn * self.bk // 2) + 2 * self.bn * self.bk * 2

    @property
    def dynamic(self) -> bool:
        return self.smem > STATIC_SMEM

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}w{self.warps}s{self.slots}"

    @classmethod
    def from_name(cls, name: str) -> Tile:
        """The tile `name` spells (`128x128x32w4s3`: bm x bn x bk, warps, slots)."""
        found = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)", name.strip())
        if found is None:
            raise ValueError(f"a tile is spelt like 128x128x32w4s3, not {name!r}")
        return cls(*(int(v) for v in found.groups()))

    def valid(self) -> bool:
        """The kernel's static asserts, checked before a launch (a bad `--variants` fails here, not in NVRTC)."""
        if self.bm % 64 or self.warps % (self.bm // 64) or self.bk not in (32, 64) or self.slots < 2:
            return False
        warps_n = self.warps // (self.bm // 64)
        if self.bn % warps_n or (self.bn // warps_n) % 16:
            return False
        per_thread = self.bn * self.bk // 8 // self.threads  # packed words a thread dequantizes a step
        unit = min(per_thread, 4)
        return unit in (2, 4) and per_thread % unit == 0 and self.smem <= MOST_SMEM


def big_tile() -> Tile:
    return Tile(BIG_BM, BIG_BN, BIG_BK, BIG_WARPS, BIG_SLOTS)


def small_tile() -> Tile:
    return Tile(SMALL_BM, SMALL_BN, SMALL_BK, SMALL_WARPS, SMALL_SLOTS)


def tile_for(rows: int, n: int, group_size: int) -> Tile:
    """The tile for a product of `rows` rows and `n` columns: the small one up to `SMALL_TO_ROWS` rows, else the
    big one; a K step narrowed to 32 for groups of 32, and 128 output columns where `n` is not a multiple of the
    tile's."""
    return fitted(small_tile() if rows <= SMALL_TO_ROWS else big_tile(), n, group_size)


def fitted(tile: Tile, n: int, group_size: int) -> Tile:
    """`tile` made to take `n` columns and groups of `group_size` (a K step never crosses a group)."""
    if group_size % tile.bk:
        tile = Tile(tile.bm, tile.bn, 32, tile.warps, tile.slots)
    if n % tile.bn:
        tile = Tile(tile.bm, 128, tile.bk, tile.warps, tile.slots)
    return tile


def resident(tile: Tile) -> int:
    """Blocks of `tile` an SM holds at once: by registers (64K a SM; ptxas' counts run ~2.4 a column of a warp's
    tile + 48, ~50 more with two dequantization units a thread), shared memory (228 KB, 1 KB of it reserved a
    block) and threads (2,048)."""
    warps_n = tile.warps // (tile.bm // 64)
    units = tile.bn * tile.bk // 8 // tile.threads // min(tile.bn * tile.bk // 8 // tile.threads, 4)
    registers = min(255, int(2.4 * (tile.bn // warps_n)) + 48 + (50 if units > 1 else 0))
    by_registers = 65536 // (tile.threads * (-(-registers // 8) * 8))
    return max(1, min(by_registers, 228 * 1024 // (tile.smem + 1024), 2048 // tile.threads))


def split_cost(tile: Tile, blocks: int, parts: int, k: int) -> float:
    """The product's estimated time over the time it would take at every SM's full throughput: `blocks` output
    tiles in `parts` K parts put `ceil(blocks * parts / SMS)` blocks on the busiest SM, each `1 / parts` of a
    tile's work, run at the share of the SM's throughput that their resident warps reach; plus the partials."""
    per_sm = -(-blocks * parts // SMS)
    busy = min(1.0, min(per_sm, resident(tile)) * tile.warps / SATURATION_WARPS)
    return per_sm * SMS / (blocks * parts) / busy + (SPLIT_COST * parts / k if parts > 1 else 0.0)


def k_parts(tile: Tile, n: int, rows: int, k: int, group_size: int) -> int:
    """Blocks along K: the part count (1, 2, 4, ... `MOST_PARTS`) of least `split_cost`, the fewest on a tie,
    each part at least `MIN_SPLIT_WIDTH` wide and a whole number of K steps and groups."""
    blocks = (n // tile.bn) * -(-rows // tile.bm)
    step, best = max(tile.bk, group_size), (split_cost(tile, blocks, 1, k), 1)
    parts = 2
    while parts <= MOST_PARTS and k % parts == 0 and k // parts >= MIN_SPLIT_WIDTH and (k // parts) % step == 0:
        best = min(best, (split_cost(tile, blocks, parts, k), parts))
        parts *= 2
    return best[1]


def plan(rows: int, n: int, k: int, group_size: int, tile: Tile | None = None) -> tuple[Tile, int]:
    """(tile, K parts) the launcher takes for a `[rows, k] x [n, k]^T` product (`tile` forced where given)."""
    tile = tile_for(rows, n, group_size) if tile is None else fitted(tile, n, group_size)
    return tile, k_parts(tile, n, rows, k, group_size)


def supports(weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
             mode: str = "affine") -> bool:  # fmt: skip
    """Affine 4-bit weights (`[N, K/8]` or split `[S, N, Ks/8]` uint32) with bf16 scales and biases, groups of
    32, 64 or 128 (a slice's K is then whole 32-wide K steps), N a multiple of 128."""
    if bits != 4 or mode != "affine" or biases is None or group_size not in GROUP_SIZES:
        return False
    if weight.dtype != mx.uint32 or scales.dtype != mx.bfloat16 or biases.dtype != mx.bfloat16:
        return False
    if weight.ndim not in (2, 3):
        return False
    n, k_slice = weight.shape[-2], weight.shape[-1] * 8
    groups = k_slice // group_size
    shapes_agree = scales.shape == biases.shape and scales.shape[-2:] == (n, groups)
    indexable = scales.size < 2**31  # the kernel's (scale, bias) stream indexes them in 32 bits
    return n % 128 == 0 and k_slice % group_size == 0 and shapes_agree and indexable


def fits(module: object) -> bool:
    """Whether a quantized linear's arrays are ones `supports` takes (and the input will be bf16 as its scales)."""
    get = module.get  # an mlx.nn.Module is a dict of its arrays
    return get("global_scale") is None and supports(get("weight"), get("scales"), get("biases"), module.group_size,
                                                    module.bits, getattr(module, "mode", "affine"))  # fmt: skip


@functools.cache
def _kernel(shared_memory: int) -> object:
    """The GEMM kernel asking for `shared_memory` bytes of dynamic shared memory (0: static)."""
    return mx.fast.cuda_kernel("mlx_serve_quantized_gemm", ["x", "w", "scales", "biases"], ["y"], SOURCE,
                               header=HEADER, shared_memory=shared_memory)  # fmt: skip


@functools.cache
def _reduce_kernel() -> object:
    return mx.fast.cuda_kernel("mlx_serve_quantized_gemm_reduce", ["partial"], ["y"], REDUCE_SOURCE)


def quantized_gemm(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                   bits: int = 4, *, tile: Tile | None = None) -> mx.array:  # fmt: skip
    """`x @ dequantize(weight).T` for bf16 `x` `[M, K]` and 4-bit `weight` `[N, K/8]` or `[S, N, K/S/8]` (K in
    slices), as `[M, N]` bf16; `tile` forces a configuration (benchmarks), else `plan` picks one."""
    if bits != 4 or x.dtype != mx.bfloat16:
        raise ValueError(f"the quantized GEMM takes bf16 rows and 4-bit weights, not {x.dtype}, {bits}-bit")
    if weight.ndim == 2:
        weight, scales, biases = weight[None], scales[None], biases[None]
    n, (rows, k) = weight.shape[1], x.shape
    if k != weight.shape[0] * weight.shape[2] * 8:
        raise ValueError(f"rows of {k} columns against weights of K {weight.shape[0] * weight.shape[2] * 8}")
    if rows == 0:
        return mx.zeros((0, n), dtype=mx.bfloat16)
    tile, parts = plan(rows, n, k, group_size, tile)
    if not tile.valid():
        raise ValueError(f"no kernel for the tile {tile}")
    partial = parts > 1
    (y,) = _kernel(tile.smem if tile.dynamic else 0)(
        inputs=[x, weight, scales, biases],
        template=[("BM", tile.bm), ("BN", tile.bn), ("BK", tile.bk), ("WARPS", tile.warps), ("SLOTS", tile.slots),
                  ("GS", group_size), ("OUT_F32", partial), ("DYN", tile.dynamic)],  # fmt: skip
        grid=(-(-rows // tile.bm) * tile.threads, n // tile.bn, parts),
        threadgroup=(tile.threads, 1, 1),
        output_shapes=[(parts, rows, n) if partial else (rows, n)],
        output_dtypes=[mx.float32 if partial else mx.bfloat16],
    )
    if not partial:
        return y
    (summed,) = _reduce_kernel()(
        inputs=[y],
        grid=(-(-rows * n // 4 // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[mx.bfloat16],
    )
    return summed
