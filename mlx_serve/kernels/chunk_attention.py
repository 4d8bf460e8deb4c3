"""A prefill chunk's attention over its paged KV history: one flash-attention kernel that reads the pool
through the block table.

Today a chunk's history is first copied out of the pool (`paged_gather`, ~2 ms a step at 16k) into contiguous
`[1, kv_heads, L_pad, D]` keys and values, then cuDNN SDPA or two matmuls run over the whole padded history
with an additive mask (1.6-1.8x the exact causal cost). Here one kernel streams each `BN`-token tile of K and
V from the pool (`[slots, kv_heads, D]`, slot = block id * block size + offset) into shared memory once per 64
score rows, and never touches a key past the rows' causal limit: no copy, no padding work.

Layout (FA2 forward on tensor cores, `mma.sync m16n8k16`, bf16 in, fp32 sums):
- score rows: the G = heads / kv_heads query heads of a kv head are stacked as rows `s = i * G + g` (query
  row i, head kvh * G + g), so one K/V tile serves all of them. A thread block is (16 x `MT` x warps score
  rows, kv head, history split). With one m16 row tile a warp (`MT` = 1) a warp holds its Q fragments in
  registers; with two (the default), each K and V fragment a warp loads from shared memory feeds twice the
  MMAs (shared-memory loads, not the tensor cores, bounded the one-tile build), and Q, which no longer fits in
  registers beside two tiles of O, is staged in shared memory and loaded by `ldmatrix` at each k step.
- K/V tiles: `BN` (32 or 64) tokens, `cp.async` into `STAGES` (2-4) shared-memory stages, `STAGES - 1` tiles
  in flight ahead of the one in use behind one barrier a tile; token rows padded to an odd number of 16-byte
  chunks so that `ldmatrix` (K, the B operand of S = Q K^T) and `ldmatrix.trans` (V, the B operand of
  O += P V) meet no bank conflicts. Stages past 48 KB live in dynamic shared memory (MLX opts the kernel in).
- block table: a block stages its split's table entries in shared memory once (a window of `TABLE_ENTRIES`,
  refilled in the rare split that spans more), so a tile's copies need no dependent global load of their
  addresses (the old way, a table load per copy just before it, stays buildable: `Variant(table=False)`).
- softmax: online, fp32, in the log2 domain (`exp2f` of log2(e)-prescaled scores); P goes from the S
  accumulators straight into bf16 A fragments (the C layout of two n8 tiles is the A layout of one k16 step).
- causal: key j is visible to row i iff j <= positions[i] and j < length[0]. A block stops at the last key
  any of its rows sees, a warp skips tiles none of its rows sees, and only a tile that straddles a row's
  limit is masked per element.
- splits: when the (query tiles x kv heads) blocks would not fill the GPU, each block's history [0, limit)
  is cut into `splits` equal whole-tile ranges (flash decoding): blocks write fp32 partial (output, max, sum)
  rows and a merge kernel combines them.

Every length is read on the device, so the grid depends only on static shapes (rows, heads, head dim, table
length): one compiled graph serves every history within a bucket. Rows that see no key (only with a zero
length) come out as zeros.

The build (`Variant`: tile tokens, stages, table staging, static or dynamic shared memory) comes from the
module constants `BN`, `STAGES`, `TABLE`, `TABLE_ENTRIES`, `DYNAMIC_SMEM`, read at each call, or a call's
`variant=`; `OLD` is the first version's build (32-token tiles, two static stages, the table read per copy),
kept to compare against (`benchmarks/gpu/bench_chunk_attention.py --variants`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from dataclasses import dataclass

import mlx.core as mx

from mlx_serve.kernels.mma import MMA_HEADER
from mlx_serve.kernels.paged_gather import table_gather
from mlx_serve.ragged import LaneRows

# a block's warps, 16 score rows each a row tile. 8 warps halve the L2 reads of K/V (every query tile reads the
# whole history) and leave one block a SM
WARPS = 8
# The default build (see `Variant`), read at each call so that a benchmark may set them: tokens a staged K/V
# tile (32 or 64), shared-memory stages (2-4: STAGES - 1 tiles in flight behind the one in use), whether a
# block stages its table entries in shared memory (TABLE_ENTRIES of them at a time), and dynamic shared memory
# (needed past 48 KB; MLX opts the kernel in). At D = 128 a stage of K and V takes 17 KB a 32-token tile, 34
# KB a 64-token one. H200 (bench_chunk_attention --variants, ms a layer over 36 layers): every build within 10% of
# the first (32-token tiles, 2 static stages, 4 warps) but 64-token tiles in 4 stages with 8 warps, 8-30% faster at
# 16k (8B 64 rows 0.167 against 0.212, 192 rows 0.416 / 0.501; 0.6B 192 rows 0.211 / 0.296): load latency was not
# what bounds the kernel
BN = 64
STAGES = 4
TABLE = True
TABLE_ENTRIES = 1024  # 4 KB: 16k tokens of blocks of 16 before a split refills its window
DYNAMIC_SMEM = True
# m16 row tiles a warp: 2 doubles the MMAs per K / V fragment loaded from shared memory (O takes 128 registers a
# thread, Q moves to shared memory). H200, ms a layer (bench_chunk_attention, twenty-sixth run), 1 -> 2 tiles:
# 8B 256 rows at 16k 0.405 -> 0.304, 768 rows 0.997 -> 0.762; 0.6B 1,024 rows at 4k 0.226 -> 0.192: 1.11-1.36x
# at every size measured (192-2,048 rows over 4-16k)
ROW_TILES = 2
MERGE_THREADS = 128
HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634
STATIC_SMEM_LIMIT = 48 * 1024
DYNAMIC_SMEM_LIMIT = 227 * 1024  # the H100 / H200's most a block may opt in to
# splits of the history, each at least MIN_SPLIT_TOKENS of the padded history and at most MAX_SPLITS of them.
# WAVE_SPLITS (the default): whole waves of the build's resident blocks (SMS x `Variant.blocks_per_sm`), even
# past SMS blocks: the fewest that minimise waves x (split tokens + SPLIT_OVERHEAD_TOKENS, a block's fixed cost:
# its first loads). Else (the first policy): none once the query tiles fill the SMs, else enough blocks for
# TARGET_BLOCKS. H200, default build (one block a SM), `bench_chunk_attention --wave-splits on|off`, ms a layer
# at 16k: 8B 128 rows 0.243 / 0.319, 256 rows 0.394 / 0.479, 768 rows 1.015 / 1.280; 0.6B 256 rows 0.237 /
# 0.289: the first policy's 5 splits of 64 blocks made 2.4 waves of one a SM, so 3 (of which one a third full)
SMS = 132
TARGET_BLOCKS = 2 * SMS
MIN_SPLIT_TOKENS = 512
MAX_SPLITS = 16
WAVE_SPLITS = True
SPLIT_OVERHEAD_TOKENS = 256


@dataclass(frozen=True)
class Variant:
    """One build of the attention kernel: `bn` tokens a K/V tile (32 or 64), `stages` shared-memory stages
    (2-4), `warps` a block (4 or 8, 16 score rows each), `table`: the block's table entries staged in shared
    memory (`table_entries` at a time) rather than read from global memory by each copy, `dynamic`: dynamic
    shared memory (else static, at most 48 KB), `min_blocks` > 0: `__launch_bounds__(threads, min_blocks)`,
    which caps the registers (ptxas spills what does not fit: an experiment, outside `VARIANTS`), `row_tiles`:
    m16 tiles of score rows a warp (2: each K / V fragment feeds twice the MMAs, Q from shared memory)."""

    bn: int = 64
    stages: int = 3
    warps: int = 4
    table: bool = True
    table_entries: int = 1024
    dynamic: bool = True
    min_blocks: int = 0
    row_tiles: int = 1

    def __post_init__(self) -> None:
        if self.bn not in (32, 64) or self.stages not in (2, 3, 4):
            raise ValueError(f"tiles of 32 or 64 tokens in 2-4 stages, not {self.bn} in {self.stages}")
        if self.warps not in (4, 8):
            raise ValueError(f"blocks of 4 or 8 warps, not {self.warps}")
        if self.row_tiles not in (1, 2):
            raise ValueError(f"one or two m16 row tiles a warp, not {self.row_tiles}")
        if not 0 <= self.min_blocks <= 64 // self.warps:
            raise ValueError(
                f"at most {64 // self.warps} blocks of {self.warps} warps a SM, not {self.min_blocks}"
            )
        if self.table and self.table_entries < self.bn + 1:
            raise ValueError(
                f"a table window of {self.table_entries} entries holds less than a tile's {self.bn + 1}"
            )

    def smem_bytes(self, head_dim: int) -> int:
        """Shared memory a block takes: the stages of K and V (rows padded to D + 8 bf16), Q's rows where
        staged (two row tiles a warp), the table window."""
        kv = 2 * self.stages * self.bn * (head_dim + 8) * 2
        q = self.score_rows * (head_dim + 8) * 2 if self.row_tiles > 1 else 0
        return kv + q + (4 * self.table_entries if self.table else 0)

    @property
    def score_rows(self) -> int:
        """Score rows a block: 16 a row tile, `row_tiles` a warp."""
        return 16 * self.row_tiles * self.warps

    def blocks_per_sm(self, head_dim: int = 128) -> int:
        """Blocks a H100 / H200 SM holds (64K registers, 228 KB of shared memory and 1 KB more a block),
        taking ptxas's registers at heads of 128 (`REGISTERS`, checked by
        `test_every_variant_compiles_without_spills`) or those `min_blocks` leaves."""
        if self.min_blocks:
            registers = 65536 // (32 * self.warps * self.min_blocks) // 8 * 8
        else:
            registers = REGISTERS[self.bn, self.table, self.row_tiles]
        by_registers = 65536 // (-(-registers // 8) * 8 * 32 * self.warps)
        return max(1, min(by_registers, 228 * 1024 // (self.smem_bytes(head_dim) + 1024), 64 // self.warps))

    @property
    def name(self) -> str:
        """`bn64s3`, then `_w8` (blocks of 8 warps), `_tc<entries>` (a window other than 1024 entries),
        `_gtable` (the table read from global memory), `_static` (static shared memory), `_mb<blocks>` (launch
        bounds) where they apply."""
        name = f"bn{self.bn}s{self.stages}" + ("_w8" if self.warps == 8 else "")
        if self.table and self.table_entries != Variant.table_entries:
            name += f"_tc{self.table_entries}"
        name += "" if self.table else "_gtable"
        name += f"_rt{self.row_tiles}" if self.row_tiles > 1 else ""
        return (
            name + ("" if self.dynamic else "_static") + (f"_mb{self.min_blocks}" if self.min_blocks else "")
        )

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """`old` (`OLD`), or comma-separated settings over the module's default build: `BN=64,STAGES=4`,
        `WARPS=8`, `TABLE=0` (global reads), `TC=<table entries>`, `SMEM=static|dynamic`, `MINB=<blocks a
        SM>`."""
        if spec.strip().lower() == "old":
            return OLD
        numbers = {
            "BN": "bn",
            "STAGES": "stages",
            "WARPS": "warps",
            "TC": "table_entries",
            "MINB": "min_blocks",
            "RT": "row_tiles",
        }
        fields = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = (part.strip() for part in item.partition("="))
            key, value = key.upper(), value.lower()
            if key in numbers and value.isdigit():
                fields[numbers[key]] = int(value)
            elif key == "TABLE" and value in ("0", "1"):
                fields["table"] = value == "1"
            elif key == "SMEM" and value in ("static", "dynamic"):
                fields["dynamic"] = value == "dynamic"
            else:
                expected = "BN=, STAGES=, WARPS=, TC=, MINB=, RT=, TABLE=0|1, SMEM=static|dynamic"
                raise ValueError(f"variant setting {item!r}: {expected}")
        return dataclasses.replace(default_variant(), **fields)


# ptxas's registers a thread at heads of 128 (CUDA 13, sm_90), by (tile tokens, table staged, row tiles): the most
# of the split and one-pass builds at any stage count or warps. 168 is the most for three 4-warp blocks a SM. Two
# row tiles take all 255
REGISTERS = {(32, True, 1): 168, (32, False, 1): 168, (64, True, 1): 175, (64, False, 1): 213,
             (32, True, 2): 255, (64, True, 2): 255}
# bytes of spill stores ptxas reports, by the same key (none elsewhere): two row tiles of 64-token tiles spill a few
# scalars, ~6 local loads and stores a tile beside its 256 MMAs, and still ran 2-5% faster than 32-token tiles at 16k
SPILL_BYTES = {(64, True, 2): 32}

# the first version's build: two static stages of 32-token tiles, a global table load per copy
OLD = Variant(bn=32, stages=2, warps=4, table=False, dynamic=False)
# the builds worth a sweep (`bench_chunk_attention.py --variants all`; the nvcc and device tests take them
# all): the first version, tiles of 32 or 64 tokens in 2-4 stages (4 warps: three blocks a SM at 32 tokens,
# two at 64 but one at 64 x 4 stages), 64 x 4 stages for one block of 8 warps, and two row tiles a warp: 8 warps
# of 32 or 64-token tiles in 4 stages, 4 warps of 32-token tiles in 3
VARIANTS = (
    OLD,
    *(Variant(bn, stages) for bn in (32, 64) for stages in (2, 3, 4)),
    Variant(64, 4, warps=8),
    *(Variant(bn, 4, warps=8, row_tiles=2) for bn in (32, 64)),
    Variant(32, 3, row_tiles=2),
)


def default_variant() -> Variant:
    """The build the module constants name (read now: a benchmark may have changed them)."""
    return Variant(BN, STAGES, WARPS, TABLE, TABLE_ENTRIES, DYNAMIC_SMEM, row_tiles=ROW_TILES)


HEADER = r"""
#define CA_NEG_INF __uint_as_float(0xff800000u)

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const __nv_bfloat16* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// bf16 offset of 16-byte chunk `chunk` of token row `row` in a staged tile: rows padded to D + 8 bf16 (an odd
// number of 16-byte chunks, so the 8 rows an ldmatrix matrix reads at one chunk hit 8 distinct bank groups);
// unlike an XOR swizzle, every fragment's address is the lane's base plus a constant (fewer registers)
template <int D>
__device__ __forceinline__ int ca_at(int row, int chunk) { return row * (D + 8) + chunk * 8; }

// 2^x in one MUFU.EX2 (exp2f adds three instructions an element to keep denormal results): results below
// 2^-126 flush to zero, a probability too small to change any sum it joins
__device__ __forceinline__ float ca_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ unsigned ca_pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (the lower column) in the low half, as mma wants
  return *reinterpret_cast<unsigned*>(&v);
}
"""

# Template: D (64 or 128), G (query heads a kv head), BS (block size), BN (tokens a tile), STAGES
# (shared-memory stages), WARPS (4 or 8), MT (m16 row tiles a warp: 1 or 2), TABLE (1: table entries staged in
# shared memory, TC at a time), SMEM (the bytes of shared memory the launcher gives a block), QR (1: q and the
# outputs rows first, [R, H, D], as the step's queries lie: no copy of them in or out); the macros CA_PARTIAL
# (partial outputs), CA_DYNAMIC (dynamic shared memory) and CA_HEAD (a `head` input) come in the header. Inputs:
# q [1, H, R, D] bf16 (QR: [R, H, D]), k_pool/v_pool [slots, KVH, D] bf16, table [NB] int32, length [2] int32
# (tokens; the padded length is not read), positions [>= R] int32 (the first R read), scale_log2 [1] fp32 (scale
# * log2 e), with CA_HEAD (QR, one pass) head [P, H, D] bf16: the step's rows before the chunk's, and optionally
# `after` (never read). Grid: (ceil(R * G / (16 * MT * WARPS)), KVH, splits) blocks of WARPS * 32 threads.
# Outputs: out like q, bf16 ([P + R, H, D] with CA_HEAD: head's rows, then the chunk's); or o_part [splits, H,
# R, D] fp32 (unnormalised) and ml_part [splits, H, R, 2] fp32 (row max in the log2 domain, row sum), [splits,
# R, H, ...] with QR.
SOURCE = r"""
  static_assert(D == 64 || D == 128, "chunk attention takes heads of 64 or 128 dims");
  static_assert(BN % 16 == 0 && BN >= 16, "tiles of whole k16 steps of P V");
  static_assert(STAGES >= 2, "a stage in use and at least one in flight");
  static_assert(WARPS == 4 || WARPS == 8, "blocks of 4 or 8 warps");
  static_assert(MT == 1 || MT == 2, "one or two m16 row tiles a warp");
  static_assert(!TABLE || TC >= BN + 1, "a table window holds a tile's entries (BN + 1 of them with BS = 1)");
  constexpr int THREADS = 32 * WARPS;
  constexpr int WM = 16 * MT;        // score rows a warp
  constexpr int BM = WM * WARPS;     // score rows a block
  constexpr bool QS = MT > 1;        // Q staged in shared memory (ldmatrix'd each k step), else in registers
  constexpr int CH = D / 8;          // 16-byte chunks of a token's head
  constexpr int KT = D / 16;         // k16 steps of S = Q K^T
  constexpr int ST = BN / 8;         // n8 tiles of S (tokens)
  constexpr int OT = D / 8;          // n8 tiles of O (head dims)
  constexpr int TILE = BN * (D + 8); // bf16 of one staged K or V tile (rows padded, see ca_at)
  constexpr int COPIES = BN * CH / THREADS;  // 16-byte copies a thread issues per tile, each of K and V
  static_assert(COPIES * THREADS == BN * CH, "a tile's chunks spread evenly over the threads");
  constexpr int QTILE = QS ? BM * (D + 8) : 0;  // bf16 of the block's staged Q rows (padded as K's)
  // shared memory: STAGES tiles of K, then of V, then Q's rows, then the table window (TC int32 entries)
  static_assert(2 * STAGES * TILE * 2 + QTILE * 2 + (TABLE ? 4 * TC : 0) <= SMEM, "the launcher's shared memory fits");
#if CA_DYNAMIC
  extern __shared__ __align__(16) unsigned char ca_smem[];
#else
  static_assert(SMEM <= 48 * 1024, "MLX's kernels have 48 KB of static shared memory");
  __shared__ __align__(16) unsigned char ca_smem[SMEM];
#endif
  __nv_bfloat16* const Ks = reinterpret_cast<__nv_bfloat16*>(ca_smem);
  __nv_bfloat16* const Vs = Ks + STAGES * TILE;
  __nv_bfloat16* const Qs = Vs + STAGES * TILE;
  int* const tab = reinterpret_cast<int*>(Qs + QTILE);

  const int H = q_shape[1];
  const int R = QR ? q_shape[0] : q_shape[2];
  // (head, query row) -> its row of q and of the outputs: [H, R] or, with QR, [R, H]
  auto q_index = [&](int head, int i) { return QR ? (size_t)i * H + head : (size_t)head * R + i; };
  const int KVH = k_pool_shape[1];
  const int NB = table_shape[0];
  const int tile = gridDim.x - 1 - blockIdx.x;  // the last query tiles see the most keys: start them first
  const int kvh = blockIdx.y;
  const int split = blockIdx.z;
  const int splits = gridDim.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;  // the fragment's row (and row + 8) and column pair
  const int len = min(length[0], NB * BS);    // never past the table
  const float sl2 = scale_log2[0];
  const int rows = R * G;                     // score rows of this kv head
  const int s_block = tile * BM;
#if !CA_PARTIAL
#if CA_HEAD
  // the step's rows before the chunk's (its decode rows' attention) lead `out`, so the step concatenates nothing:
  // each kv head's block of the last-started query tile copies those rows' G heads of it
  __nv_bfloat16* const out_rows = out + (size_t)head_shape[0] * H * D;
  if (blockIdx.x == gridDim.x - 1) {
    constexpr int SPAN = G * D / 8;  // 16-byte pieces of one row's G heads
    for (int e = tid; e < head_shape[0] * SPAN; e += THREADS) {
      const size_t at = ((size_t)(e / SPAN) * H + kvh * G) * D + (size_t)(e % SPAN) * 8;
      *reinterpret_cast<uint4*>(out + at) = *reinterpret_cast<const uint4*>(head + at);
    }
  }
#else
  __nv_bfloat16* const out_rows = out;
#endif
#endif

  // a score row sees keys [0, min(position + 1, len)); the last tile's rows past R * G take row R - 1's limit
  // (their Q is zero and they are never stored)
  auto row_limit = [&](int s) { return max(0, min(positions[min(s / G, R - 1)] + 1, len)); };

  // the block's limit: the largest of its query rows' (each warp computes it, so it is block-uniform)
  int block_lim = 0;
  {
    const int i_lo = s_block / G, i_hi = min((s_block + BM - 1) / G, R - 1);
    for (int i = i_lo + lane; i <= i_hi; i += 32) block_lim = max(block_lim, min(positions[i] + 1, len));
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) block_lim = max(block_lim, __shfl_xor_sync(0xffffffffu, block_lim, o));
    block_lim = max(block_lim, 0);
  }
  // this split's keys: [start, end), whole tiles (a split boundary never cuts a tile), sized from the block's
  // own limit so the splits share the real history evenly however far the table is padded
  const int per = (block_lim + splits * BN - 1) / (splits * BN) * BN;
  const int start = split * per;
  const int end = min(start + per, block_lim);
  const int n_tiles = end > start ? (end - start + BN - 1) / BN : 0;

  // this thread's score rows: two of each of the warp's m16 tiles (gid and gid + 8), their limits within the
  // split, and the warp's least and greatest limit
  auto score_row = [&](int mt, int h) { return s_block + warp * WM + mt * 16 + gid + 8 * h; };
  int lim[MT][2];
  int wmin = end, wmax = 0;
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      lim[mt][h] = min(row_limit(score_row(mt, h)), end);
      wmin = min(wmin, lim[mt][h]);
      wmax = max(wmax, lim[mt][h]);
    }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, o));
    wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
  }

  auto q_row = [&](int s) {  // score row s: query head kvh * G + s % G, row s / G (none past the rows)
    const __nv_bfloat16* row = q + q_index(kvh * G + s % G, s / G) * D;
    return s < rows ? row : nullptr;
  };
  // Q's A fragments: with one m16 tile a warp, held in registers for the whole history: a0 (row gid, dims
  // 2 tig..+1), a1 (row gid + 8), a2 / a3 the same at dims + 8, for each k16 step of the head. With two, the
  // block's Q rows are copied to shared memory with the first tile (its cp.async group) and ldmatrix'd at
  // each k step: 64 more registers a thread would not fit beside O
  // (MLX emits the template values as constexpr locals, not template parameters: `if constexpr` discards no
  // branch here, so the register path's indices stay in bounds when Q is staged)
  unsigned qa[QS ? 1 : KT][4];
  if constexpr (QS) {
    for (int piece = tid; piece < BM * CH; piece += THREADS) {
      const int r = piece / CH, chunk = piece % CH;
      const __nv_bfloat16* row = q_row(s_block + r);
      cp_async16(Qs + ca_at<D>(r, chunk), row ? row + chunk * 8 : q, row != nullptr);
    }
  } else {
    const unsigned* q0 = reinterpret_cast<const unsigned*>(q_row(score_row(0, 0)));
    const unsigned* q1 = reinterpret_cast<const unsigned*>(q_row(score_row(0, 1)));
    #pragma unroll
    for (int kk = 0; kk < (QS ? 1 : KT); ++kk) {
      qa[kk][0] = q0 ? q0[8 * kk + tig] : 0u;
      qa[kk][1] = q1 ? q1[8 * kk + tig] : 0u;
      qa[kk][2] = q0 ? q0[8 * kk + 4 + tig] : 0u;
      qa[kk][3] = q1 ? q1[8 * kk + 4 + tig] : 0u;
    }
  }
  // ldmatrix lanes of Q (A, non-trans): lanes 0-15 rows 0-15 of an m16 tile at chunk k, 16-31 at k + 1
  const int q_lrow = warp * WM + (lane & 15), q_lchunk = lane >> 4;

  // the table window: tab[e - wb] = table[e] for the split's entries e in [wb, wb + TC). Loaded once before
  // the first tile and reloaded (from the first entry of the tile about to be copied) only when a split spans
  // more than TC entries; wb is block-uniform, as are the tiles, so every thread meets the barriers.
  const int e_end = end > start ? (end - 1) / BS + 1 : 0;  // one past the split's last entry
  int wb = 0;
  auto load_window = [&](int e0) {  // a refill, in the loop (rare): a load a thread at a time, few registers
    __syncthreads();  // every thread is past its reads of the old window
    const int count = min(TC, e_end - e0);
    for (int e = tid; e < count; e += THREADS) tab[e] = table[e0 + e];
    __syncthreads();
    wb = e0;
  };
  if (TABLE && n_tiles > 0) {  // the first window: every thread's loads in flight at once (one latency)
    constexpr int PER = TABLE ? (TC + THREADS - 1) / THREADS : 1;
    const int e0 = start / BS, count = min(TC, e_end - e0);
    int entry[PER];
    #pragma unroll
    for (int k = 0; k < PER; ++k) entry[k] = tid + k * THREADS < count ? table[e0 + tid + k * THREADS] : 0;
    #pragma unroll
    for (int k = 0; k < PER; ++k)
      if (tid + k * THREADS < count) tab[tid + k * THREADS] = entry[k];
    __syncthreads();
    wb = e0;
  }

  // one tile's copies: token rows of D bf16 from the pool through the table (16 threads a row: 256 contiguous
  // bytes); tokens past the split's end are zero-filled and their table entries never read
  auto copy_tile = [&](int it) {
    const int stage = it % STAGES, t0 = start + it * BN;
    if (TABLE && (min(t0 + BN, end) - 1) / BS >= wb + TC) load_window(t0 / BS);
    #pragma unroll
    for (int c = 0; c < COPIES; ++c) {
      const int piece = tid + THREADS * c, tok = piece / CH, chunk = piece % CH;
      const int t = t0 + tok;
      const bool ok = t < end;
      const int block = ok ? (TABLE ? tab[t / BS - wb] : table[t / BS]) : 0;
      const size_t slot = (size_t)block * BS + t % BS;
      const size_t off = (slot * KVH + kvh) * D + chunk * 8;
      const int at = stage * TILE + ca_at<D>(tok, chunk);
      cp_async16(Ks + at, k_pool + off, ok);
      cp_async16(Vs + at, v_pool + off, ok);
    }
  };

  float o[MT][OT][4];
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nd = 0; nd < OT; ++nd) o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.f;
  // rows gid, gid + 8 of each m16 tile: running max of the raw scores (quad-uniform), this thread's share of
  // the running sum
  float m[MT][2], l[MT][2];
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = CA_NEG_INF, l[mt][0] = l[mt][1] = 0.f;

  // ldmatrix lanes. K (non-trans): lanes 0-7 tokens 0-7 at chunk k, 8-15 the same at k + 1, 16-23 tokens
  // 8-15 at k, 24-31 those at k + 1: b0 / b1 of two n8 token tiles. V (trans): lanes 0-7 tokens 0-7 at dim
  // chunk n, 8-15 tokens 8-15 at n, 16-23 tokens 0-7 at n + 1, 24-31 tokens 8-15 at n + 1: b0 / b1 of two
  // n8 dim tiles.
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_chunk = (lane >> 3) & 1;
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_chunk = lane >> 4;

  pipe_start<STAGES>(n_tiles, copy_tile);
  for (int it = 0; it < n_tiles; ++it) {
    pipe_next<STAGES>(it, n_tiles, copy_tile);
    const int t0 = start + it * BN;
    if (t0 >= wmax) continue;  // no row of this warp sees this tile (warp-uniform; barriers are in pipe_next)
    const __nv_bfloat16* ks = Ks + (it % STAGES) * TILE;
    const __nv_bfloat16* vs = Vs + (it % STAGES) * TILE;

    // S = Q K^T: s[mt][j] is the n8 tile of tokens 8 j..8 j + 7 of m16 tile mt; [0], [1] row gid, [2], [3]
    // row gid + 8. Each K fragment serves the warp's MT tiles
    float s[MT][ST][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int j = 0; j < ST; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      unsigned qf[MT][4];
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (QS) {
          ldmatrix_x4(qf[mt], Qs + ca_at<D>(q_lrow + 16 * mt, 2 * kk + q_lchunk));
        } else {
          #pragma unroll
          for (int c = 0; c < 4; ++c) qf[mt][c] = qa[QS ? 0 : kk][c];
        }
      }
      #pragma unroll
      for (int j = 0; j < ST; j += 2) {
        unsigned r[4];
        ldmatrix_x4(r, ks + ca_at<D>(8 * j + k_row, 2 * kk + k_chunk));
        const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(s[mt][j], qf[mt], b0);
          mma_bf16(s[mt][j + 1], qf[mt], b1);
        }
      }
    }
    if (t0 + BN > wmin) {  // some row of the warp stops inside this tile: mask per element
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int j = 0; j < ST; ++j)
          #pragma unroll
          for (int e = 0; e < 4; ++e)
            if (t0 + 8 * j + 2 * tig + (e & 1) >= lim[mt][e >> 1]) s[mt][j][e] = CA_NEG_INF;
    }

    // online softmax of the tile, in the log2 domain: p = 2^(s sl2 - m sl2)
    float corr[MT][2];
    bool rescale = false;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float tmax[2] = {CA_NEG_INF, CA_NEG_INF};
      #pragma unroll
      for (int j = 0; j < ST; ++j) {
        tmax[0] = fmaxf(tmax[0], fmaxf(s[mt][j][0], s[mt][j][1]));
        tmax[1] = fmaxf(tmax[1], fmaxf(s[mt][j][2], s[mt][j][3]));
      }
      float ms[2];
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 1));
        tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 2));
        const float m_new = fmaxf(m[mt][h], tmax[h]);
        const float m_use = m_new == CA_NEG_INF ? 0.f : m_new;  // a row with nothing visible yet: p = 0, no NaN
        corr[mt][h] = m_new == m[mt][h] ? 1.f : ca_exp2((m[mt][h] - m_use) * sl2);  // m = -inf gives 0
        rescale |= corr[mt][h] != 1.f;
        ms[h] = m_use * sl2;
        m[mt][h] = m_new;
      }
      float psum[2] = {0.f, 0.f};
      #pragma unroll
      for (int j = 0; j < ST; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[mt][j][e] = ca_exp2(fmaf(s[mt][j][e], sl2, -ms[e >> 1]));  // masked: 2^-inf = 0
          psum[e >> 1] += s[mt][j][e];
        }
      l[mt][0] = l[mt][0] * corr[mt][0] + psum[0];
      l[mt][1] = l[mt][1] * corr[mt][1] + psum[1];
    }
    // O is rescaled only when a row of the warp met a larger max: past the first tiles most tiles raise none
    if (__any_sync(0xffffffffu, rescale)) {
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nd = 0; nd < OT; ++nd) {
          o[mt][nd][0] *= corr[mt][0]; o[mt][nd][1] *= corr[mt][0];
          o[mt][nd][2] *= corr[mt][1]; o[mt][nd][3] *= corr[mt][1];
        }
    }

    // O += P V, k16 step t over tokens 16 t..16 t + 15: P's A fragment is S's n8 tiles 2 t and 2 t + 1; each
    // V fragment serves the warp's MT tiles
    #pragma unroll
    for (int t = 0; t < BN / 16; ++t) {
      unsigned pa[MT][4];
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float* lo = s[mt][2 * t];
        const float* hi = s[mt][2 * t + 1];
        pa[mt][0] = ca_pack(lo[0], lo[1]);
        pa[mt][1] = ca_pack(lo[2], lo[3]);
        pa[mt][2] = ca_pack(hi[0], hi[1]);
        pa[mt][3] = ca_pack(hi[2], hi[3]);
      }
      #pragma unroll
      for (int nd = 0; nd < OT; nd += 2) {
        unsigned r[4];
        ldmatrix_x4_trans(r, vs + ca_at<D>(16 * t + v_row, nd + v_chunk));
        const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(o[mt][nd], pa[mt], b0);
          mma_bf16(o[mt][nd + 1], pa[mt], b1);
        }
      }
    }
  }

  // the rows' sums over their quads; then rows gid and gid + 8 of each m16 tile out (rows past R * G are dropped)
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[mt][h] += __shfl_xor_sync(0xffffffffu, l[mt][h], 1);
      l[mt][h] += __shfl_xor_sync(0xffffffffu, l[mt][h], 2);
    }
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int srow = score_row(mt, h);
      if (srow >= rows) continue;
      const size_t row = q_index(kvh * G + srow % G, srow / G);
#if CA_PARTIAL
      float* op = o_part + ((size_t)split * H * R + row) * D + 2 * tig;
      #pragma unroll
      for (int nd = 0; nd < OT; ++nd)
        *reinterpret_cast<float2*>(op + 8 * nd) = make_float2(o[mt][nd][2 * h], o[mt][nd][2 * h + 1]);
      if (tig == 0) {
        float* mlp = ml_part + ((size_t)split * H * R + row) * 2;
        mlp[0] = m[mt][h] * sl2;  // -inf stays -inf: a split this row sees nothing of, which the merge skips
        mlp[1] = l[mt][h];
      }
#else
      const float inv = l[mt][h] > 0.f ? 1.f / l[mt][h] : 0.f;
      __nv_bfloat16* op = out_rows + row * D + 2 * tig;
      #pragma unroll
      for (int nd = 0; nd < OT; ++nd)
        *reinterpret_cast<__nv_bfloat162*>(op + 8 * nd) =
            __floats2bfloat162_rn(o[mt][nd][2 * h] * inv, o[mt][nd][2 * h + 1] * inv);
#endif
    }
"""

# Template: D. Inputs: o_part [splits, H, R, D] fp32, ml_part [splits, H, R, 2] fp32 (or [splits, R, H, ...]),
# with CA_HEAD head [P, H, D] bf16. Output: out [1, H, R, D] (or [R, H, D], [P + R, H, D] with CA_HEAD) bf16, the
# partials' rows in their order after head's. One thread per 4 dims of a (head, row); grid: (P + R) * H * D / 4
# threads, in blocks of 128.
MERGE_SOURCE = r"""
  const int splits = o_part_shape[0];
  const size_t rows = (size_t)o_part_shape[1] * o_part_shape[2];
  size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  __nv_bfloat16* rows_out = out;
#if CA_HEAD
  const size_t head_quads = (size_t)head_shape[0] * head_shape[1] * (D / 4);  // head's rows lead: copied first
  if (idx < head_quads) {
    reinterpret_cast<uint2*>(out)[idx] = reinterpret_cast<const uint2*>(head)[idx];
    return;
  }
  idx -= head_quads;
  rows_out += head_quads * 4;
#endif
  if (idx >= rows * (D / 4)) return;
  const size_t row = idx / (D / 4);
  const int d = (idx % (D / 4)) * 4;
  float mmax = CA_NEG_INF;
  for (int p = 0; p < splits; ++p) mmax = fmaxf(mmax, ml_part[((size_t)p * rows + row) * 2]);
  float lsum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mmax != CA_NEG_INF) {
    for (int p = 0; p < splits; ++p) {
      const float mp = ml_part[((size_t)p * rows + row) * 2];
      if (mp == CA_NEG_INF) continue;  // a split past this row's limit: nothing in it
      const float c = exp2f(mp - mmax);
      lsum += c * ml_part[((size_t)p * rows + row) * 2 + 1];
      const float4 v = *reinterpret_cast<const float4*>(o_part + ((size_t)p * rows + row) * D + d);
      acc.x += c * v.x; acc.y += c * v.y; acc.z += c * v.z; acc.w += c * v.w;
    }
  }
  const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
  __nv_bfloat162* op = reinterpret_cast<__nv_bfloat162*>(rows_out + row * D + d);
  op[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  op[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
"""


# MLX's JIT caches compiled kernels on disk by name (and template values) alone, and `on_device.sh` carries
# that cache between machines: the sources' digest in the names keeps an edited kernel from running as its old
# self
SOURCE_DIGEST = f"{zlib.crc32((MMA_HEADER + HEADER + SOURCE + MERGE_SOURCE).encode()):08x}"


@functools.cache
def _kernel(
    partial: bool, ordered: bool, dynamic_smem: int = 0, bounds: tuple[int, int] | None = None, head: bool = False
) -> object:
    """The attention kernel; `dynamic_smem` > 0: a build for dynamic shared memory of that many bytes (MLX
    sets a kernel's dynamic shared memory when it is made, and opts it in past 48 KB when first loaded: the
    bytes are a function of the template, so each template's kernel keeps one value). `bounds`: (threads,
    blocks a SM) for `__launch_bounds__`, which MLX's generated signature has no place for: the header, the
    last text before that signature, redefines CUDA's `__global__` (`__location__(global)` in
    crt/host_defines.h) to carry them (the template's MINB keeps the name apart). `head`: the one-pass build that
    puts the step's earlier rows first in its output."""
    # `after` is never read: it is an input only so MLX's CUDA graph orders this kernel after the one that
    # made it
    inputs = ["q", "k_pool", "v_pool", "table", "length", "positions", "scale_log2"]
    inputs += (["head"] if head else []) + (["after"] if ordered else [])
    outputs = ["o_part", "ml_part"] if partial else ["out"]
    name = "mlx_serve_chunk_attention" + ("_partial" if partial else "") + ("_head" if head else "")
    name += ("_after" if ordered else "") + ("_dyn" if dynamic_smem else "")
    header = (
        MMA_HEADER
        + HEADER
        + f"#define CA_PARTIAL {int(partial)}\n#define CA_DYNAMIC {int(bool(dynamic_smem))}\n"
        + f"#define CA_HEAD {int(head)}\n"
    )
    if bounds:
        bounded = f"__location__(global) __launch_bounds__({bounds[0]}, {bounds[1]})"
        header += f"#undef __global__\n#define __global__ {bounded}\n"
    return mx.fast.cuda_kernel(
        f"{name}_{SOURCE_DIGEST}", inputs, outputs, SOURCE, header=header, shared_memory=dynamic_smem
    )


@functools.cache
def _merge_kernel(head: bool = False) -> object:
    name = "mlx_serve_chunk_attention_merge" + ("_head" if head else "") + f"_{SOURCE_DIGEST}"
    inputs = ["o_part", "ml_part"] + (["head"] if head else [])
    return mx.fast.cuda_kernel(name, inputs, ["out"], MERGE_SOURCE, header=HEADER + f"#define CA_HEAD {int(head)}\n")


@functools.lru_cache(maxsize=64)
def _scalar(value: float) -> mx.array:
    # kernel scalars arrive as pointers: one cached device array per value, not a new upload per layer and
    # step
    scalar = mx.array([value], dtype=mx.float32)
    mx.eval(scalar)
    return scalar


def _int32(values: mx.array) -> mx.array:
    return values if values.dtype == mx.int32 else values.astype(mx.int32)


def rows_first(q: mx.array) -> bool:
    """Whether `q` is `[rows, heads, D]` (the step's own layout) rather than `[1, heads, rows, D]`."""
    return q.ndim == 3


def supports(q: mx.array, pool_keys: mx.array, block_size: int) -> bool:
    """Whether the kernel takes this chunk: bf16 queries (`[1, heads, rows, D]` or `[rows, heads, D]`) and pool,
    heads of 64 or 128 dims, any whole group of query heads a kv head, any block size."""
    return (
        (q.ndim == 3 or (q.ndim == 4 and q.shape[0] == 1))
        and pool_keys.ndim == 3
        and q.dtype == mx.bfloat16
        and pool_keys.dtype == mx.bfloat16
        and q.shape[-1] == pool_keys.shape[-1]
        and pool_keys.shape[-1] in HEAD_DIMS
        and q.shape[1] % pool_keys.shape[1] == 0
        and block_size >= 1
    )


def _check(q, pool_keys, pool_values, table, length, positions, block_size, head) -> None:
    if not supports(q, pool_keys, block_size):
        raise ValueError(
            "paged chunk attention takes bf16 queries [1, heads, rows, D] or [rows, heads, D] and a bf16 pool "
            f"[slots, kv_heads, D] with D in {HEAD_DIMS}, heads a multiple of kv_heads and a positive block size; got q "
            f"{q.shape} {q.dtype}, pool {pool_keys.shape} {pool_keys.dtype}, block size {block_size}"
        )
    if pool_values.shape != pool_keys.shape or pool_values.dtype != pool_keys.dtype:
        values, keys = f"{pool_values.shape} {pool_values.dtype}", f"{pool_keys.shape} {pool_keys.dtype}"
        raise ValueError(f"pool values {values} differ from the keys {keys}")
    if table.ndim != 1 or length.ndim != 1 or length.shape[0] < 1:
        raise ValueError(f"table must be [blocks] and length [2], not {table.shape} and {length.shape}")
    rows = q.shape[0] if rows_first(q) else q.shape[2]
    if positions.ndim != 1 or positions.shape[0] < rows:
        raise ValueError(f"positions must be [at least rows] = [{rows}], not {positions.shape}")
    if head is not None and not (rows_first(q) and head.ndim == 3 and head.shape[1:] == q.shape[1:]
                                 and head.dtype == q.dtype):  # fmt: skip
        raise ValueError(f"head must be [rows, heads, D] like q {q.shape} {q.dtype} (rows first), not "
                         f"{head.shape} {head.dtype}")  # fmt: skip


def split_count(blocks: int, padded: int, per_sm: int = 2) -> int:
    """History splits for `blocks` (query tiles x kv heads) thread blocks over a table of `padded` tokens:
    none once the blocks cover the SMs, else enough for `TARGET_BLOCKS`, each at least `MIN_SPLIT_TOKENS`.
    With `WAVE_SPLITS`: the count (at most MAX_SPLITS, each split at least MIN_SPLIT_TOKENS) that fits whole
    waves of `per_sm` blocks a SM best."""
    most = max(1, min(MAX_SPLITS, padded // MIN_SPLIT_TOKENS))
    if WAVE_SPLITS:
        slots = per_sm * SMS

        def cost(count: int) -> float:
            return -(-blocks * count // slots) * (padded / count + SPLIT_OVERHEAD_TOKENS)

        return min(range(1, most + 1), key=cost)
    if blocks >= SMS:
        return 1
    return max(1, min(most, math.ceil(TARGET_BLOCKS / blocks)))


def paged_chunk_attention(
    q: mx.array,
    pool_keys: mx.array,
    pool_values: mx.array,
    table: mx.array,
    length: mx.array,
    positions: mx.array,
    scale: float,
    block_size: int = 16,
    after: mx.array | None = None,
    head: mx.array | None = None,
    *,
    splits: int | None = None,
    warps: int | None = None,
    variant: Variant | None = None,
) -> mx.array:
    """softmax((q * scale) K^T + mask) V over the history the block table lists, bf16 in q's layout; with `head`
    (q rows first only) `[head rows + rows, heads, D]`: head's rows, then the chunk's, with no concatenation.

    q `[1, heads, rows, D]`, or `[rows, heads, D]` (a slice of the step's queries, read in place: no copy in or
    out); pool keys/values `[slots, kv_heads, D]`; table `[blocks]` int32; length `[2]` int32 (visible tokens,
    padded length); positions `[rows]` int32 (or longer: the first `rows` are read): key j is visible to row i iff
    j <= positions[i] and j < length[0]. `variant` (the build: `default_variant()`), `splits` (history
    splits: `split_count`) and `warps` (4 or 8 a block, over the variant's) override the module's choices, for
    tests and benchmarks.

    MLX orders kernels by the arrays they output, so a kernel that wrote the pool in place is not seen as the
    pool's writer: pass its output as `after` to read the pool only once it has run. `head` `[P, heads, D]`: the
    step's rows before this chunk's (its decode rows' attention), copied ahead of them in the output."""
    _check(q, pool_keys, pool_values, table, length, positions, block_size, head)
    first = rows_first(q)
    heads, head_dim = q.shape[1], q.shape[-1]
    rows = q.shape[0] if first else q.shape[2]
    row_shape = (rows, heads) if first else (heads, rows)  # the outputs' rows, as q's
    kv_heads = pool_keys.shape[1]
    group = heads // kv_heads
    variant = variant or default_variant()
    if warps:
        variant = dataclasses.replace(variant, warps=warps)
    warps = variant.warps
    smem = variant.smem_bytes(head_dim)
    if smem > (DYNAMIC_SMEM_LIMIT if variant.dynamic else STATIC_SMEM_LIMIT):
        kind = "dynamic" if variant.dynamic else "static"
        raise ValueError(f"{variant.name} takes {smem} bytes of shared memory, past the {kind} limit")
    threads = 32 * warps
    tiles = -(-rows * group // variant.score_rows)
    padded = table.shape[0] * block_size
    per_sm = variant.blocks_per_sm(head_dim)
    count = max(1, int(splits)) if splits else split_count(tiles * kv_heads, padded, per_sm)
    ordered = after is not None
    inputs = [q, pool_keys, pool_values, _int32(table), _int32(length), _int32(positions)]
    inputs += [_scalar(float(scale) * LOG2E)]
    led, ordering = ([] if head is None else [head]), ([after] if ordered else [])  # inputs in the kernels' order
    ahead = 0 if head is None else head.shape[0]  # rows before the chunk's in the output
    out_shape = (ahead + rows, heads, head_dim) if head is not None else q.shape
    launch = {
        "template": [("D", head_dim), ("G", group), ("BS", block_size), ("BN", variant.bn)]
        + [("STAGES", variant.stages), ("WARPS", warps), ("MT", variant.row_tiles), ("TABLE", int(variant.table))]
        + [
            ("TC", variant.table_entries if variant.table else 0),
            ("SMEM", smem),
            ("MINB", variant.min_blocks),
            ("QR", int(first)),
        ],
        "grid": (tiles * threads, kv_heads, count),
        "threadgroup": (threads, 1, 1),
    }
    bounds = (threads, variant.min_blocks) if variant.min_blocks else None
    dynamic_smem = smem if variant.dynamic else 0
    if count == 1:
        kernel = _kernel(False, ordered, dynamic_smem, bounds, head is not None)
        (out,) = kernel(inputs=inputs + led + ordering, output_shapes=[out_shape], output_dtypes=[q.dtype], **launch)
        return out
    o_part, ml_part = _kernel(True, ordered, dynamic_smem, bounds)(
        inputs=inputs + ordering,
        output_shapes=[(count, *row_shape, head_dim), (count, *row_shape, 2)],
        output_dtypes=[mx.float32, mx.float32],
        **launch,
    )
    quads = heads * (ahead + rows) * head_dim // 4  # a thread each
    (out,) = _merge_kernel(head is not None)(
        inputs=[o_part, ml_part] + led,
        template=[("D", head_dim)],
        grid=(-(-quads // MERGE_THREADS) * MERGE_THREADS, 1, 1),
        threadgroup=(MERGE_THREADS, 1, 1),
        output_shapes=[out_shape],
        output_dtypes=[q.dtype],
    )
    return out


# takes `after`: it may read a pool written in place (see FusedDecode.mixed)
paged_chunk_attention.orders_after = True


def reference_chunk_attention(
    q: mx.array,
    pool_keys: mx.array,
    pool_values: mx.array,
    table: mx.array,
    length: mx.array,
    positions: mx.array,
    scale: float,
    block_size: int = 16,
    after: mx.array | None = None,
    head: mx.array | None = None,
) -> mx.array:
    """The same attention in plain MLX ops (`table_gather`, an explicit mask, fused SDPA), any dtype, q in either
    layout, `head` concatenated before: the yardstick the kernel is tested against, and the path elsewhere. Rows
    that see no key give zeros, as the kernel's do."""
    if rows_first(q):
        out = reference_chunk_attention(q.transpose(1, 0, 2)[None], pool_keys, pool_values, table, length,
                                        positions, scale, block_size)  # fmt: skip
        out = out[0].transpose(1, 0, 2)
        return out if head is None else mx.concatenate([head, out])
    rows, padded = q.shape[2], table.shape[0] * block_size
    lane = LaneRows(0, rows, mx.zeros((0,), mx.int32), None, _int32(table), _int32(length), padded)
    keys, values = table_gather(pool_keys, pool_values, lane, block_size)
    key_pos = mx.arange(padded, dtype=mx.int32)[None, :]
    visible = (key_pos <= _int32(positions)[:rows, None]) & (key_pos < lane.length[0])  # [rows, padded]
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=visible[None, None])
    return mx.where(visible.any(axis=-1)[None, None, :, None], out, mx.zeros((), q.dtype))
