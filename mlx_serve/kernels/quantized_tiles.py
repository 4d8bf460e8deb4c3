"""A 4-bit GEMM for steps of many rows: `y = x @ dequantize(W).T`, the weights dequantized in registers.

MLX's CUDA quantized GEMM (`qmm_sm80`, MLX 0.32) runs a prefill chunk's projections at about a fifth of the bf16
GEMM's speed (H200, 8B 4-bit: 0.13 ms a row against 0.03 for bf16), so a 4-bit step of 8 decode lanes and a
120-row chunk costs 32 ms against 7.4 for decode alone. Here each thread block computes a `64 x 128` output tile
with bf16 tensor-core MMAs (`mma.sync m16n8k16`, fp32 sums, inline PTX). `cp.async` copies each K step's `64 x 64`
input slice and `128 x 64` packed weight slice (4 KB instead of 16) into shared memory `PIPE - 1` steps ahead,
behind one barrier a step; each of the 4 warps owns 64 rows x 32 columns and turns its packed weights straight into
MMA fragments, as MLX dequantizes (`w = bf16(q * scale + bias)`, one rounding), so the products see the weights
mlx-lm's own matmul sees; only the accumulation order differs. A fragment dequantized once serves 4 MMAs.

Weights whole `[N, K]` or in `S` slices of K `[S, N, K/S]` (`quantized_rows.split_k`'s layout): the kernel walks
K across the slices, so either layout gives one bf16 product. When the output tiles would not fill the GPU, K is
split across thread blocks instead, into fp32 partial sums `[Z, M, N]`, summed after.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from mlx_serve.kernels.dequantize import dense_matmul
from mlx_serve.kernels.mma import MMA_HEADER

BM, BN, BK = 64, 128, 64
PIPE = 2  # shared-memory stages: K steps of copies in flight (2 x 15 KB; 3 measured 0-7% slower)
GROUP_SIZES = (64, 128)  # a BK-wide K step never crosses a quantization group
TARGET_BLOCKS = 264  # two blocks on each of the H200's 132 SMs
MIN_SPLIT_WIDTH = 512  # narrowest K range a block's split takes
# products of this many rows or more dequantize the weights once and run the bf16 GEMM (`dequantize.dense_matmul`):
# past two 64-row tiles (H200, 8B layer, split layout: 128 rows 0.446 ms tiles / 0.480 dense, 184 rows 0.595 / 0.510)
DENSE_FROM_ROWS = 129

# Template: PIPE (shared-memory stages), GS (group size), SPLIT (blocks along K), OUT_F32 (fp32 partials [SPLIT, M,
# N], else bf16 [M, N]). Inputs: x [M, K] bf16, w [S, N, K / S / 8] uint32 (8 nibbles a word, lowest first), scales
# and biases [S, N, K / S / GS] bf16. Grid: (N / 128, ceil(M / 64), SPLIT) blocks of 128 threads.
SOURCE = r"""
  constexpr int MT = 4, NT = 4;             // each warp: 64 rows x 32 columns, in m16 x n8 tiles
  constexpr int LDA = 64 + 8;               // A row stride (bf16): 144 bytes, conflict-free ldmatrix
  constexpr int LDB = 12;                   // packed row stride (words): 48 bytes, conflict-free 8-byte reads
  constexpr int A_STAGE = 64 * LDA, B_STAGE = 128 * LDB;
  __shared__ __align__(16) __nv_bfloat16 As[PIPE * A_STAGE];
  __shared__ __align__(16) uint32_t Bs[PIPE * B_STAGE];

  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[1];
  const int Ks = w_shape[2] * 8;              // K of one weight slice (K when whole)
  const int Kp = K / SPLIT;                   // K of this block's part
  const int steps = Kp / 64;
  const int k_begin = blockIdx.z * Kp;
  const int n0 = blockIdx.x * 128;
  const int m0 = blockIdx.y * 64;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;      // the fragment's row group and column pair
  const int wn = warp * 32;

  // one K step's copies: A 64 x 64 bf16 (512 16-byte pieces, 4 a thread; rows past M read as zeros) and the
  // packed weights, 128 rows x 32 bytes (2 a thread); a step never crosses a slice (slices are whole steps)
  auto copy_step = [&](int step) {
    const int stage = step % PIPE, k = k_begin + step * 64;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int piece = tid + 128 * i, r = piece >> 3, c = (piece & 7) * 8;
      const bool ok = m0 + r < M;
      cp_async16(As + stage * A_STAGE + r * LDA + c, x + (size_t)(ok ? m0 + r : 0) * K + k + c, ok);
    }
    const size_t w_row = (size_t)(k / Ks) * N + n0;
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int piece = tid + 128 * i, r = piece >> 1, half = piece & 1;
      cp_async16(Bs + stage * B_STAGE + r * LDB + half * 4, w + (w_row + r) * (Ks / 8) + (k % Ks) / 8 + half * 4,
                 true);
    }
  };
  // the group (scale, bias) of this thread's column of n8 tile j at a K step (a step never crosses a group)
  auto group_at = [&](int step, int j) {
    const int k = k_begin + step * 64;
    return ((size_t)(k / Ks) * N + n0 + wn + 8 * j + g) * (Ks / GS) + (k % Ks) / GS;
  };

  float acc[MT][NT][4];
  zero(acc);
  pipe_start<PIPE>(steps, copy_step);
  __nv_bfloat162 group_next[NT];  // (scale, bias) of each n8 tile's column at the next step
  #pragma unroll
  for (int j = 0; j < NT; ++j) group_next[j] = __halves2bfloat162(scales[group_at(0, j)], biases[group_at(0, j)]);
  // a packed word's byte t holds this thread's two K values (nibbles 2t, 2t+1): byte t of `word` to the low
  // half, byte t of `word >> 4` to the high half, masked to the nibbles over bf16 128's bits: 128 + q, exact
  const uint32_t select = t | (t << 4) | ((4 + t) << 8) | ((4 + t) << 12);
  const __nv_bfloat162 magic = __floats2bfloat162_rn(128.f, 128.f);

  const __nv_bfloat16* a_lane = As + (lane & 15) * LDA + (lane >> 4) * 8;
  const uint32_t* b_lane = Bs + (wn + g) * LDB;
  for (int step = 0; step < steps; ++step) {
    pipe_next<PIPE>(step, steps, copy_step);
    __nv_bfloat162 s2[NT], z2[NT];
    #pragma unroll
    for (int j = 0; j < NT; ++j) s2[j] = __low2bfloat162(group_next[j]), z2[j] = __high2bfloat162(group_next[j]);
    if (step + 1 < steps) {
      #pragma unroll
      for (int j = 0; j < NT; ++j)
        group_next[j] = __halves2bfloat162(scales[group_at(step + 1, j)], biases[group_at(step + 1, j)]);
    }
    const __nv_bfloat16* a_stage = a_lane + (step % PIPE) * A_STAGE;
    const uint32_t* b_stage = b_lane + (step % PIPE) * B_STAGE;
    #pragma unroll
    for (int kk = 0; kk < 64; kk += 16) {
      unsigned a[MT][4];
      #pragma unroll
      for (int i = 0; i < MT; ++i) ldmatrix_x4(a[i], a_stage + i * 16 * LDA + kk);
      #pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint2 packed = *reinterpret_cast<const uint2*>(b_stage + j * 8 * LDB + kk / 8);
        unsigned b[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t word = h ? packed.y : packed.x;
          const uint32_t bits = (__byte_perm(word, word >> 4, select) & 0x000F000Fu) | 0x43004300u;
          // q * scale + bias rounded once, as MLX's dequantization computes it
          const __nv_bfloat162 q = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&bits), magic);
          const __nv_bfloat162 v = __hfma2(q, s2[j], z2[j]);
          b[h] = *reinterpret_cast<const uint32_t*>(&v);
        }
        #pragma unroll
        for (int i = 0; i < MT; ++i) mma_bf16(acc[i][j], a[i], b);
      }
    }
  }

  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int c = n0 + wn + j * 8 + t * 2;
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + i * 16 + g + 8 * half;
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


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel("mlx_serve_quantized_tiles", ["x", "w", "scales", "biases"], ["y"], SOURCE,
                               header=MMA_HEADER)  # fmt: skip


def supports(weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
             mode: str = "affine") -> bool:  # fmt: skip
    """Affine 4-bit weights (`[N, K/8]` or split `[S, N, Ks/8]` uint32) with bf16 scales and biases, groups of 64
    or 128, N a multiple of 128 and each slice's K of 64."""
    if bits != 4 or mode != "affine" or biases is None or group_size not in GROUP_SIZES:
        return False
    if weight.dtype != mx.uint32 or scales.dtype != mx.bfloat16 or biases.dtype != mx.bfloat16:
        return False
    n, k = weight.shape[-2], weight.shape[-1] * 8
    return weight.ndim in (2, 3) and n % BN == 0 and k % BK == 0 and k % group_size == 0


def k_parts(n: int, rows: int, k: int, group_size: int) -> int:
    """Blocks along K: doubled while the output tiles fill fewer than `TARGET_BLOCKS` blocks, keeping each part
    at least `MIN_SPLIT_WIDTH` wide and a whole number of K steps and groups."""
    blocks = (n // BN) * -(-rows // BM)
    parts, step = 1, max(BK, group_size)
    while blocks * parts < TARGET_BLOCKS:
        width = k // (2 * parts)
        if k % (2 * parts) or width < MIN_SPLIT_WIDTH or width % step:
            break
        parts *= 2
    return parts


def fits(module: object) -> bool:
    """Whether a quantized linear's arrays are ones `supports` takes (and the input will be bf16 as its scales)."""
    get = module.get  # an mlx.nn.Module is a dict of its arrays
    return get("global_scale") is None and supports(get("weight"), get("scales"), get("biases"), module.group_size,
                                                    module.bits, getattr(module, "mode", "affine"))  # fmt: skip


def quantized_tiles_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                           bits: int = 4) -> mx.array:  # fmt: skip
    """`x @ dequantize(weight).T` for bf16 `x` `[M, K]` and 4-bit `weight` `[N, K/8]` or `[S, N, K/S/8]` (K in
    slices), as `[M, N]` bf16."""
    if bits != 4 or x.dtype != mx.bfloat16:
        raise ValueError(f"the quantized-tiles kernel takes bf16 rows and 4-bit weights, not {x.dtype}, {bits}-bit")
    if weight.ndim == 2:
        weight, scales, biases = weight[None], scales[None], biases[None]
    n, (rows, k) = weight.shape[1], x.shape
    parts = k_parts(n, rows, k, group_size)
    partial = parts > 1
    (y,) = _kernel()(
        inputs=[x, weight, scales, biases],
        template=[("PIPE", PIPE), ("GS", group_size), ("SPLIT", parts), ("OUT_F32", partial)],
        grid=(n // BN * 128, -(-rows // BM), parts),
        threadgroup=(128, 1, 1),
        output_shapes=[(parts, rows, n) if partial else (rows, n)],
        output_dtypes=[mx.float32 if partial else mx.bfloat16],
    )
    return y.sum(axis=0).astype(mx.bfloat16) if partial else y


def many_rows_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                     bits: int = 4) -> mx.array:  # fmt: skip
    """`x @ dequantize(weight).T` by the faster way for its rows: the tiles kernel, or from `DENSE_FROM_ROWS` rows
    the weights dequantized once and the bf16 GEMM (the same products: each weight rounded once to bf16)."""
    if x.shape[0] >= DENSE_FROM_ROWS:
        return dense_matmul(x, weight, scales, biases, group_size, bits)
    return quantized_tiles_matmul(x, weight, scales, biases, group_size, bits)
