"""A 4-bit GEMM for steps of many rows: `y = x @ dequantize(W).T`, dequantizing each weight slice in shared memory.

MLX's CUDA quantized GEMM (`qmm_sm80`, MLX 0.32) runs a prefill chunk's projections at about a fifth of the bf16
GEMM's speed (H200, 8B 4-bit: 0.13 ms a row against 0.03 for bf16), so a 4-bit step of 8 decode lanes and a
120-row chunk costs 32 ms against 7.4 for decode alone. Here each thread block computes a `64 x 128` output tile
with bf16 tensor-core MMAs (`mma.sync m16n8k16`, fp32 sums, inline PTX), staging `64 x 64` input slices and `128
x 64` weight slices in shared memory; the weight slice arrives packed (4 KB instead of 16), and is dequantized on
its way into shared memory as MLX does it (`w = bf16(bf16(q * scale) + bias)`), so the products see the weights
mlx-lm's own matmul sees; only the accumulation order differs.

Weights whole `[N, K]` or in `S` slices of K `[S, N, K/S]` (`quantized_rows.split_k`'s layout): the kernel walks
K across the slices, so either layout gives one bf16 product. When the output tiles would not fill the GPU, K is
split across thread blocks instead, into fp32 partial sums `[Z, M, N]`, summed after.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from mlx_serve.kernels.mma import MMA_HEADER

BM, BN, BK = 64, 128, 64
STAGES = 2  # K steps of loads in flight (1 and 3 measured the same on the H200)
GROUP_SIZES = (64, 128)  # a BK-wide K step never crosses a quantization group
TARGET_BLOCKS = 264  # two blocks on each of the H200's 132 SMs
MIN_SPLIT_WIDTH = 512  # narrowest K range a block's split takes

# Template: STAGES, GS (group size), SPLIT (blocks along K), OUT_F32 (fp32 partials [SPLIT, M, N], else bf16 [M, N]).
# Inputs: x [M, K] bf16, w [S, N, K / S / 8] uint32 (8 nibbles a word, lowest first), scales and biases
# [S, N, K / S / GS] bf16. Grid: (N / 128, ceil(M / 64), SPLIT) blocks of 256 threads.
SOURCE = r"""
  constexpr int WARPS_M = 2, WARPS_N = 4;
  constexpr int WM = 32, WN = 32;           // each warp: 32 rows x 32 columns
  constexpr int MT = WM / 16, NT = WN / 8;  // m16 x n8 tiles per warp
  constexpr int LDS = 64 + 8;               // smem row stride (bf16): 144 bytes, conflict-free ldmatrix
  __shared__ __align__(16) __nv_bfloat16 As[64 * LDS];
  __shared__ __align__(16) __nv_bfloat16 Bs[128 * LDS];

  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[1];
  const int Ks = w_shape[2] * 8;              // K of one weight slice (K when whole)
  const int Kp = K / SPLIT;                   // K of this block's part
  const int k_begin = blockIdx.z * Kp;
  const int n0 = blockIdx.x * 128;
  const int m0 = blockIdx.y * 64;
  const int tid = threadIdx.x, warp = tid >> 5;

  // A: 64 rows x 64 columns a step, two uint4 (8 bf16) a thread: rows ar and ar + 32, columns ac..ac+7
  const int ar = tid >> 3, ac = (tid & 7) * 8;
  const bool a_ok0 = m0 + ar < M, a_ok1 = m0 + ar + 32 < M;
  const __nv_bfloat16* xa0 = x + (size_t)(a_ok0 ? m0 + ar : 0) * K + k_begin + ac;
  const __nv_bfloat16* xa1 = x + (size_t)(a_ok1 ? m0 + ar + 32 : 0) * K + k_begin + ac;
  // B: 128 weight rows x 64 columns a step, packed: one uint4 (32 nibbles) a thread, row br, columns bh..bh+31;
  // a step of 64 never crosses a slice (slices are whole steps wide)
  const int br = tid >> 1, bh = (tid & 1) * 32;
  auto w_row = [&](int k) { return (size_t)(k / Ks) * N + n0 + br; };  // k: within the whole K
  auto w_at = [&](int k) { return w + w_row(k) * (Ks / 8) + (k % Ks + bh) / 8; };
  auto group_at = [&](int k) { return w_row(k) * (Ks / GS) + (k % Ks) / GS; };

  const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;

  float acc[MT][NT][4];
  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NT; ++j)
      #pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

  // loads run STAGES K steps ahead of the products, in a ring of registers (the global latency is hidden
  // behind STAGES steps of MMAs, not one)
  struct Stage { uint4 a0, a1, b; __nv_bfloat16 s, z; };  // one K step's loads: A rows, packed B, group
  auto fetch = [&](int k) {  // k: within this block's part
    const uint4 zero4 = make_uint4(0, 0, 0, 0);
    Stage stage;
    stage.a0 = a_ok0 ? *reinterpret_cast<const uint4*>(xa0 + k) : zero4;
    stage.a1 = a_ok1 ? *reinterpret_cast<const uint4*>(xa1 + k) : zero4;
    stage.b = *reinterpret_cast<const uint4*>(w_at(k_begin + k));
    stage.s = scales[group_at(k_begin + k)];
    stage.z = biases[group_at(k_begin + k)];
    return stage;
  };
  Stage ring[STAGES];
  #pragma unroll
  for (int st = 0; st < STAGES; ++st)
    if (st * 64 < Kp) ring[st] = fetch(st * 64);
  const __nv_bfloat162 magic = __floats2bfloat162_rn(128.f, 128.f);

  for (int k0 = 0; k0 < Kp; k0 += 64 * STAGES) {
    #pragma unroll
    for (int st = 0; st < STAGES; ++st) {
      const int k = k0 + st * 64;
      if (k >= Kp) break;  // the same for every thread
      __syncthreads();
      *reinterpret_cast<uint4*>(As + ar * LDS + ac) = ring[st].a0;
      *reinterpret_cast<uint4*>(As + (ar + 32) * LDS + ac) = ring[st].a1;
      {
        // 32 nibbles -> 32 bf16: (128 + q) from the bits, minus 128 (exact), times the scale, plus the bias,
        // each operation rounded to bf16 as MLX's dequantization rounds it
        const __nv_bfloat162 s2 = __bfloat162bfloat162(ring[st].s), z2 = __bfloat162bfloat162(ring[st].z);
        const uint32_t words[4] = {ring[st].b.x, ring[st].b.y, ring[st].b.z, ring[st].b.w};
        uint32_t out[16];
        #pragma unroll
        for (int wi = 0; wi < 4; ++wi) {
          #pragma unroll
          for (int pair = 0; pair < 4; ++pair) {
            const uint32_t word = words[wi] >> (8 * pair);
            const uint32_t bits = (word & 0xFu) | ((word & 0xF0u) << 12) | 0x43004300u;
            __nv_bfloat162 v = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&bits), magic);
            v = __hadd2(__hmul2(v, s2), z2);
            out[wi * 4 + pair] = *reinterpret_cast<const uint32_t*>(&v);
          }
        }
        uint4* dst = reinterpret_cast<uint4*>(Bs + br * LDS + bh);
        #pragma unroll
        for (int v = 0; v < 4; ++v) dst[v] = make_uint4(out[4 * v], out[4 * v + 1], out[4 * v + 2], out[4 * v + 3]);
      }
      __syncthreads();
      const int kn = k + 64 * STAGES;
      if (kn < Kp) ring[st] = fetch(kn);
      mma_slice<MT, NT, LDS, 64>(As, Bs, wm, wn, acc);
    }
  }

  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int lane = tid & 31;
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
        template=[("STAGES", STAGES), ("GS", group_size), ("SPLIT", parts), ("OUT_F32", partial)],
        grid=(n // BN * 256, -(-rows // BM), parts),
        threadgroup=(256, 1, 1),
        output_shapes=[(parts, rows, n) if partial else (rows, n)],
        output_dtypes=[mx.float32 if partial else mx.bfloat16],
    )
    return y.sum(axis=0).astype(mx.bfloat16) if partial else y
