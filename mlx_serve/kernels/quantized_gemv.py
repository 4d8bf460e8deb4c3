"""A 4-bit matrix-vector product for decode steps of 1-8 rows: `y = x @ dequantize(W).T`, the weights read once.

Why: MLX's CUDA quantized matmul reads the packed weights of a decode step at ~17% of the H200's bandwidth at one
row (a 4096 x 12288 projection: 0.038 ms, ~0.75 TB/s of 4.3) and once more for every row (0.038 / 0.064 / 0.119
ms at 1 / 2 / 4 rows), so 8 decode lanes pay for 8 weight reads. Here the weights stream once for all rows, and
the rows ride on tensor cores: `mma.sync m16n8k16` with 16 output columns' weights as A and the step's rows as B
(K x 8 rows, rows past M zero), so a product costs the same whatever M is, up to 8.

Arithmetic: one LOP3 lifts two nibbles of a packed word over bf16 128's bits, `128 + q` exactly, straight into an
A fragment; per quantization group the MMA sums `(128 + q) x` and an MMA of ones sums `x`, and the group adds
`scale * sum (128 + q) x + (bias - 128 scale) * sum x` to fp32 sums. That is `sum (q * scale + bias) x` with the
weights unrounded (MLX rounds each to bf16 first: results differ from its by that rounding, well inside a bf16
output's), and no per-weight multiply at all, leaving the ALU pipe to the nibbles (the shifts go to the FMA pipe as
`mul.hi`, `SHIFT_BY_MULTIPLY`).

Layout of the work: a block owns `TILES` tiles of 16 output columns and its warps split K in 128-wide steps
(warp w takes steps w, w + WARPS, ...); lane `(g, t)` (`g = lane / 4`, `t = lane % 4`) holds, for columns `g` and
`g + 8` of each tile, its quarter of each group in the step (16 bytes a step), and B's column g is row g of x: the
16-byte loads of x that the lane's words meet, permuted by `__byte_perm` into the K order of A's nibble pairs (one
mask lifts nibbles 2p and 2p + 4 of a word). Weights, scales and biases reach shared memory by `cp.async` into
slots only the issuing lane reads, `STAGES - 1` steps ahead of the step computed (the compiler sinks plain loads
next to their use, leaving one step in flight), and the warps' partial tiles are summed through shared memory at
the end. Weights whole `[N, K/8]` or split over K `[S, N, Ks/8]` (`quantized_rows.split_k`'s layout) give one
product: a step never crosses a slice.

Not yet measured on the device (`python -m benchmarks.gpu.bench_quantized --gemv`).
"""

from __future__ import annotations

import functools

import mlx.core as mx

MOST_ROWS = 8  # B's n8: the rows one MMA carries
GROUP_SIZES = (32, 64, 128)
STEP = 128  # K a warp takes a step: a group's share (GS / 4 K) for each of a column's 4 lanes, 128 / GS groups
STAGES = 3  # steps of a warp's copies: STAGES - 1 in flight while one is computed
TILE_WARPS = 8  # warps x tiles of a block: its staging, 1.5 KB a warp-tile a stage (2 KB for groups of 32), <= 48 KB
TARGET_BLOCKS = 400  # ~3 blocks an SM on the H200's 132: a warp takes more tiles only while this many remain
TILE_CHOICES = (4, 2, 1)  # 16-column tiles a warp may own, widest first: each x load serves 16 x TILES columns
SHIFT_BY_MULTIPLY = True  # nibble shifts as `mul.hi` (FMA pipe) rather than shifts (the ALU pipe, also masking)
SHARED_BYTES = 48 * 1024  # static shared memory a block may declare

HEADER = r"""
namespace mlx_serve_gemv {
template <int BYTES>
__device__ __forceinline__ void copy_async(unsigned address, const void* global) {  // address: shared space
  if constexpr (BYTES == 16) {  // packed weights are read once: L2 only
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(address), "l"(global) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" :: "r"(address), "l"(global), "n"(BYTES)
                 : "memory");
  }
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory"); }

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <bool MULTIPLY>
__device__ __forceinline__ uint32_t shift_right(uint32_t word, int bits) {
  if (bits == 0) return word;
  if constexpr (MULTIPLY) {  // the high word of word * 2^(32 - bits): an IMAD.HI, off the ALU pipe
    uint32_t out;
    asm("mul.hi.u32 %0, %1, %2;\n" : "=r"(out) : "r"(word), "r"(1u << (32 - bits)));
    return out;
  } else {
    return word >> bits;
  }
}
// nibbles p and p + 4 of a word (p = bits / 4 of the shift before) over bf16 128's bits: (128 + q) exactly, one LOP3
__device__ __forceinline__ uint32_t lift(uint32_t shifted) {
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(out) : "r"(shifted), "n"(0x000F000F), "r"(0x43004300));
  return out;
}
// the aligned word holding a step's scale: a group of 128's may be a word's high half (those of 32 and 64 start
// their 8 and 4 aligned bytes: a slice's groups are a multiple of 4 and 2)
template <bool HALF>
__device__ __forceinline__ const void* scale_word(const __nv_bfloat16* p) {
  return HALF ? reinterpret_cast<const void*>(reinterpret_cast<size_t>(p) & ~size_t(3)) : p;
}
// the bf16 in the low (high) half of a word as a float
__device__ __forceinline__ float low_half(uint32_t word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float high_half(uint32_t word) { return __uint_as_float(word & 0xFFFF0000u); }
}  // namespace mlx_serve_gemv
"""

# Template: GS (group size), M (rows of x, 1-8), TILES (16-column tiles of a block: 1, 2 or 4), WARPS (warps of
# the block, splitting K), STAGES, SHIFT_MUL (`SHIFT_BY_MULTIPLY`). Inputs: x [M, K] bf16, w [S, N, Ks/8] uint32
# (8 nibbles a word, lowest first), scales and biases [S, N, Ks/GS] bf16 (K = S * Ks, Ks a multiple of 128; w and x
# 16-byte aligned, scales and biases 4-byte, as MLX allocates arrays and row slices keep them). Output: y [M, N]
# bf16. Grid: ceil(N / (16 * TILES)) blocks of 32 x WARPS threads.
SOURCE = r"""
  using namespace mlx_serve_gemv;
  constexpr int ROWS = 2 * TILES;             // weight rows a lane reads: columns g and g + 8 of each tile
  constexpr int PIECES = 128 / GS;            // groups in a step
  constexpr int PIECE_WORDS = GS / 32;        // packed words of a group a lane holds (its column's 4 lanes: all)
  constexpr int SB_WORDS = GS == 32 ? 2 : 1;  // 32-bit words of scales (and as many of biases) a row's step takes
  // each lane's copies land in slots only it reads: no barrier, only its own cp.async waits
  struct Stage {                              // (no padding: `issue` addresses it by hand)
    uint4 w[ROWS][32];
    uint32_t sb[ROWS][32][2 * SB_WORDS];
  };
  __shared__ __align__(16) Stage stages[WARPS][STAGES];

  const int S = w_shape[0], N = w_shape[1], words = w_shape[2];
  const int Ks = words * 8, K = S * Ks, groups = Ks / GS;
  const int slice_steps = Ks / 128, steps = S * slice_steps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16 * TILES;
  const int count = warp < steps ? (steps - 1 - warp) / WARPS + 1 : 0;  // steps warp, warp + WARPS, ...

  // offsets (32-bit: a weight has < 2^31 words) of the lane's rows in slice 0 (past N: row N - 1, never stored),
  // and a cursor over the warp's steps: the step's offset from them (its slice's rows, its K within the slice)
  uint32_t row_words[ROWS], row_groups[ROWS];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const uint32_t row = min(n0 + 16 * (r >> 1) + 8 * (r & 1) + g, N - 1);
    row_words[r] = row * words + t * PIECE_WORDS;
    row_groups[r] = row * groups;
  }
  struct Cursor {
    int kstep;
    uint32_t words, groups;                   // the step's offsets: slice * N * (words, groups) + its K's
  };
  auto cursor_at = [&](int step) {
    const int slice = step / slice_steps, kstep = step % slice_steps;
    const uint32_t rows_before = slice * N;
    return Cursor{kstep, rows_before * words + kstep * 16, rows_before * groups + kstep * PIECES};
  };
  auto advance = [&](Cursor& c) {             // WARPS steps on
    c.kstep += WARPS, c.words += WARPS * 16, c.groups += WARPS * PIECES;
    while (c.kstep >= slice_steps)            // into the next slice: its rows, K from its start
      c.kstep -= slice_steps, c.words += (N - 1) * words, c.groups += (N - 1) * groups;
  };

  // a step's copies: for each row, the lane's words of each group, its scales and biases (a group of 128's in the
  // aligned 4 bytes that hold it)
  const unsigned stage0 = static_cast<unsigned>(__cvta_generic_to_shared(&stages[warp][0]));
  Cursor issued = cursor_at(warp);
  int issue_stage = 0;
  auto issue = [&]() {
    const unsigned stage = stage0 + issue_stage * sizeof(Stage);
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const uint32_t* from = w + (row_words[r] + issued.words);
      #pragma unroll
      for (int q = 0; q < PIECES; ++q)
        copy_async<4 * PIECE_WORDS>(stage + (r * 32 + lane) * 16 + q * 4 * PIECE_WORDS,
                                    from + q * (GS / 8));
      const uint32_t group = row_groups[r] + issued.groups;
      const unsigned sb = stage + ROWS * 32 * 16 + (r * 32 + lane) * 8 * SB_WORDS;  // Stage::sb
      copy_async<4 * SB_WORDS>(sb, scale_word<GS == 128>(scales + group));
      copy_async<4 * SB_WORDS>(sb + 4 * SB_WORDS, scale_word<GS == 128>(biases + group));
    }
    advance(issued);
    issue_stage = issue_stage == STAGES - 1 ? 0 : issue_stage + 1;
  };

  const bool x_lane = g < M;                  // B's column g is row g of x; columns past M stay zero
  const __nv_bfloat16* x_step = x + (size_t)(x_lane ? g : 0) * K + t * (GS / 4) + warp * 128;
  const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};  // bf16 1.0 pairs
  Cursor computed = cursor_at(warp);          // (groups of 128: the step's offset)
  const uint32_t row_bit = g & groups;        // parity of row * groups (rows past N aside: never stored)
  const uint32_t scale_parity = (reinterpret_cast<size_t>(scales) >> 1) + row_bit;
  const uint32_t bias_parity = (reinterpret_cast<size_t>(biases) >> 1) + row_bit;
  int stage = 0;

  float acc[TILES][4];
  #pragma unroll
  for (int i = 0; i < TILES; ++i)
    #pragma unroll
    for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;

  #pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < count) issue();
    copy_commit();
  }
  for (int i = 0; i < count; ++i) {
    if (i + STAGES - 1 < count) issue();      // into the stage step i - 1 used
    copy_commit();
    copy_wait<STAGES - 1>();                  // step i's copies are in
    uint4 packed[ROWS];
    uint32_t sb[ROWS][2 * SB_WORDS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      packed[r] = stages[warp][stage].w[r][lane];
      #pragma unroll
      for (int c = 0; c < 2 * SB_WORDS; ++c) sb[r][c] = stages[warp][stage].sb[r][lane][c];
    }
    stage = stage == STAGES - 1 ? 0 : stage + 1;
    uint4 xs[4] = {};                         // the lane's x, word v = q * PIECE_WORDS + j as the weights
    if (x_lane) {
      #pragma unroll
      for (int q = 0; q < PIECES; ++q)
        #pragma unroll
        for (int j = 0; j < PIECE_WORDS; ++j)
          xs[q * PIECE_WORDS + j] = __ldg(reinterpret_cast<const uint4*>(x_step + q * GS + 8 * j));
    }
    x_step += WARPS * 128;
    // groups of 128: which half of its aligned word holds the step's scale (bias): bit 1 of its address, the same
    // for all the lane's rows (they are g + multiples of 8); the high half up (bytes 2, 3), else the low (0, 1)
    const uint32_t select_scale = ((scale_parity ^ computed.groups) & 1) ? 0x3244u : 0x1044u;
    const uint32_t select_bias = ((bias_parity ^ computed.groups) & 1) ? 0x3244u : 0x1044u;
    #pragma unroll
    for (int q = 0; q < PIECES; ++q) {
      // the group's sums of (128 + q) x over each column's K (tensor cores) and of x alone (an MMA of ones)
      float sums[TILES][4] = {}, x_sums[4] = {};
      #pragma unroll
      for (int j = 0; j < PIECE_WORDS; ++j) {
        const int v = q * PIECE_WORDS + j;
        const uint32_t* xw = reinterpret_cast<const uint32_t*>(&xs[v]);
        #pragma unroll
        for (int p = 0; p < 2; ++p) {
          // B, K slots (2t, 2t+1) and (2t+8, 2t+9): x's values 2p, 2p+4 and 2p+1, 2p+5 of the word, the order
          // of A's nibbles (one mask lifts nibbles 2p and 2p+4 of a word, the next 2p+1 and 2p+5)
          const uint32_t b[2] = {__byte_perm(xw[p], xw[p + 2], 0x5410), __byte_perm(xw[p], xw[p + 2], 0x7632)};
          mma(x_sums, ones, b);
          #pragma unroll
          for (int tile = 0; tile < TILES; ++tile) {
            const uint32_t lo = reinterpret_cast<const uint32_t*>(&packed[2 * tile])[v];  // column g
            const uint32_t hi = reinterpret_cast<const uint32_t*>(&packed[2 * tile + 1])[v];  // column g + 8
            const uint32_t a[4] = {lift(shift_right<SHIFT_MUL>(lo, 8 * p)), lift(shift_right<SHIFT_MUL>(hi, 8 * p)),
                                   lift(shift_right<SHIFT_MUL>(lo, 8 * p + 4)),
                                   lift(shift_right<SHIFT_MUL>(hi, 8 * p + 4))};
            mma(sums[tile], a, b);
          }
        }
      }
      // sum (q * scale + bias) x = scale * sum (128 + q) x + (bias - 128 scale) * sum x, in fp32
      #pragma unroll
      for (int tile = 0; tile < TILES; ++tile)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 2 * tile + h;
          float scale, bias;
          if constexpr (GS == 128) {
            scale = __uint_as_float(__byte_perm(sb[r][0], 0, select_scale));
            bias = __uint_as_float(__byte_perm(sb[r][1], 0, select_bias));
          } else {
            const uint32_t scale_word = sb[r][q >> 1], bias_word = sb[r][SB_WORDS + (q >> 1)];
            scale = (q & 1) ? high_half(scale_word) : low_half(scale_word);
            bias = (q & 1) ? high_half(bias_word) : low_half(bias_word);
          }
          const float offset = fmaf(-128.f, scale, bias);
          acc[tile][2 * h] = fmaf(scale, sums[tile][2 * h], fmaf(offset, x_sums[0], acc[tile][2 * h]));
          acc[tile][2 * h + 1] = fmaf(scale, sums[tile][2 * h + 1], fmaf(offset, x_sums[1], acc[tile][2 * h + 1]));
        }
    }
    if constexpr (GS == 128) advance(computed);
  }

  // the warps' partial tiles summed, through the staging memory; C's element c of lane (g, t): column g + 8 (c / 2)
  // of the tile, row 2t + c % 2
  copy_wait<0>();
  __syncthreads();
  float (*partial)[TILES * 4][32] = reinterpret_cast<float (*)[TILES * 4][32]>(&stages[0][0]);
  #pragma unroll
  for (int i = 0; i < TILES; ++i)
    #pragma unroll
    for (int c = 0; c < 4; ++c) partial[warp][i * 4 + c][lane] = acc[i][c];
  __syncthreads();
  for (int e = threadIdx.x; e < TILES * 4 * 32; e += WARPS * 32) {
    const int ic = e >> 5, l = e & 31;
    float sum = 0.f;
    #pragma unroll
    for (int v = 0; v < WARPS; ++v) sum += partial[v][ic][l];
    const int n = n0 + 16 * (ic >> 2) + (l >> 2) + 8 * ((ic & 3) >> 1), m = 2 * (l & 3) + (ic & 1);
    if (m < M && n < N) y[(size_t)m * N + n] = __float2bfloat16(sum);
  }
"""


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel("mlx_serve_quantized_gemv", ["x", "w", "scales", "biases"], ["y"], SOURCE,
                               header=HEADER)  # fmt: skip


def padded_rows(rows: int) -> int:
    """The rows a product of `rows` runs with: a power of two. The rows are a template argument, and a serving step
    that met 4 or 5 rows first (an eager step's logits) stalled its streams ~2 s while NVRTC built the kernel (H200,
    twenty-first run); the engine's warm-up builds 1, 2, 4 and 8 (`ModelRunner.warm_quantized_products`)."""
    return 1 << (rows - 1).bit_length()


def rows_fit(rows: int) -> bool:
    """Whether a product of `rows` rows runs here (one MMA's 8 columns carry them all)."""
    return 1 <= rows <= MOST_ROWS


def supports(weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
             mode: str = "affine") -> bool:  # fmt: skip
    """Affine 4-bit weights (`[N, K/8]` or split `[S, N, Ks/8]` uint32, each slice's K a multiple of `STEP`, as
    `quantized_rows.k_splits_for` keeps them) with bf16 scales and biases `[..., Ks / group_size]`, groups of 32, 64
    or 128; the rows are `rows_fit`'s question."""
    if bits != 4 or mode != "affine" or biases is None or group_size not in GROUP_SIZES:
        return False
    if weight.dtype != mx.uint32 or scales.dtype != mx.bfloat16 or biases.dtype != mx.bfloat16:
        return False
    if weight.ndim not in (2, 3) or weight.size == 0 or (weight.shape[-1] * 8) % STEP:
        return False
    groups = weight.shape[:-1] + (weight.shape[-1] * 8 // group_size,)
    return scales.shape == groups and biases.shape == groups


def fits(module: object) -> bool:
    """Whether a quantized linear's arrays are ones `supports` takes (and the input will be bf16 as its scales)."""
    get = module.get  # an mlx.nn.Module is a dict of its arrays
    return get("global_scale") is None and supports(get("weight"), get("scales"), get("biases"), module.group_size,
                                                    module.bits, getattr(module, "mode", "affine"))  # fmt: skip


def tiles_for(n: int) -> int:
    """16-column tiles of a block: the widest of `TILE_CHOICES` that still gives `TARGET_BLOCKS` blocks (wider tiles
    read x fewer times and share its permutes), else the narrowest."""
    for tiles in TILE_CHOICES:
        if -(-n // (16 * tiles)) >= TARGET_BLOCKS:
            return tiles
    return TILE_CHOICES[-1]


def stage_bytes(tiles: int, group_size: int) -> int:
    """Shared memory of one warp's stage: 16 bytes of weights and 8 (16 for groups of 32) of scales and biases for
    each of its lanes' 2 x `tiles` rows."""
    return 2 * tiles * 32 * (16 + (16 if group_size == 32 else 8))


def quantized_gemv(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> mx.array:
    """`x @ dequantize(weight).T` for bf16 `x` `[M, K]` (1 <= M <= `MOST_ROWS`) and 4-bit `weight` `[N, K/8]` or
    `[S, N, K/S/8]` (K in slices), as `[M, N]` bf16 (fp32 sums of the unrounded weights `q * scale + bias`)."""
    if x.dtype != mx.bfloat16 or x.ndim != 2 or not rows_fit(x.shape[0]):
        raise ValueError(f"the GEMV kernel takes bf16 [1-{MOST_ROWS}, K] rows, not {x.dtype} {x.shape}")
    if not supports(weight, scales, biases, group_size, 4):
        raise ValueError(f"the GEMV kernel does not take weights {weight.shape} in groups of {group_size}")
    if weight.ndim == 2:
        weight, scales, biases = weight[None], scales[None], biases[None]
    slices, n, words = weight.shape
    if x.shape[1] != slices * words * 8:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {slices * words * 8}")
    rows = x.shape[0]
    if rows & (rows - 1):  # 3, 5-7 rows run as 4 or 8: one instantiation per row count, ~2 s of NVRTC each
        x = mx.concatenate([x, mx.zeros((padded_rows(rows) - rows, x.shape[1]), x.dtype)])
    tiles = tiles_for(n)
    warps = max(1, min(TILE_WARPS // tiles, slices * words * 8 // STEP))  # no warp without a step
    if warps * STAGES * stage_bytes(tiles, group_size) > SHARED_BYTES:
        raise ValueError(f"{warps} warps x {STAGES} stages of {tiles} tiles exceed {SHARED_BYTES} bytes of staging")
    (y,) = _kernel()(
        inputs=[x, weight, scales, biases],
        template=[("GS", group_size), ("M", x.shape[0]), ("TILES", tiles), ("WARPS", warps), ("STAGES", STAGES),
                  ("SHIFT_MUL", bool(SHIFT_BY_MULTIPLY))],  # fmt: skip
        grid=(-(-n // (16 * tiles)) * 32 * warps, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(x.shape[0], n)],
        output_dtypes=[mx.bfloat16],
    )
    return y if y.shape[0] == rows else y[:rows]
