"""A grouped GEMM for mixture-of-experts steps: row tiles, each of one expert, times that expert's weights.

A step's (row, expert) pairs are sorted by expert into tiles of `BM` rows (`tile_layout`); tile `t` multiplies
its rows by expert `tile_expert[t]`'s `[N, K]` weight (mlx-lm's SwitchLinear layout, `y = x W^T`). Each thread
block computes one tile's `BM x 128` output slab with bf16 tensor-core MMAs (`mma.sync m16n8k16`, fp32
accumulation, inline PTX: no header), staging `BM x 32` and `128 x 32` slices in shared memory; tiles past
`used[0]` (the layout's real tile count, on the device) return at once, so the static tile count's worst-case
padding costs a launch, not FLOPs.

Why: MLX's CUDA `gather_mm` multiplies sorted pairs one row at a time (M = 1: 30B-A3B's 2,048-row prefill chunks
at ~150 ms of experts) or, for tiles, through a Volta-style kernel at ~80 TFLOP/s; the dense form computes all
128 experts per row (16x the FLOPs). `bench_moe` measures the three against this one.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from mlx_serve.kernels.mma import MMA_HEADER

BN, BK = 128, 32
STAGES = 2  # k steps of loads in flight (1 and 3 measured the same on the H200)

# Template: BM (tile rows: 16, 32 or 64), STAGES; the header's EXPERT_TILES_GATHER macro (0/1) picks the A rows. Inputs:
# x [tiles * BM, K] bf16 (GATHER: any [T, K], tile row r being x[source[r]], or zeros where source[r] < 0),
# w [E, N, K] bf16, tile_expert [tiles] uint32, used [1] int32 (GATHER: then source [tiles * BM] int32).
# Output: y [tiles * BM, N] bf16. Grid: (N / 128, tiles) blocks of 256 threads.
SOURCE = r"""
  constexpr int WARPS_M = BM >= 32 ? 2 : 1;
  constexpr int WARPS_N = 8 / WARPS_M;
  constexpr int WM = BM / WARPS_M;            // rows per warp: 16 or 32
  constexpr int WN = 128 / WARPS_N;           // cols per warp: 16 or 32
  constexpr int MT = WM / 16, NT = WN / 8;    // m16 x n8 tiles per warp
  constexpr int LDS = 32 + 8;                 // smem row stride (bf16): 80 bytes, conflict-free fragment reads
  __shared__ __align__(16) __nv_bfloat16 As[BM * LDS];
  __shared__ __align__(16) __nv_bfloat16 Bs[128 * LDS];

  const int tile = blockIdx.y;
  if (tile >= used[0]) return;
  const int K = x_shape[1];
  const int N = w_shape[1];
  const int n0 = blockIdx.x * 128;
  const int a_row = threadIdx.x >> 2;  // the A row this thread loads (threads past BM rows load none)
#if EXPERT_TILES_GATHER
  const int a_src = a_row < BM ? source[tile * BM + a_row] : -1;
  const __nv_bfloat16* xa = x + (size_t)(a_src < 0 ? 0 : a_src) * K;
  const bool a_zero = a_src < 0;
#else
  const __nv_bfloat16* xa = x + (size_t)(tile * BM + (a_row < BM ? a_row : 0)) * K;
  const bool a_zero = false;
#endif
  const __nv_bfloat16* wb = w + ((size_t)tile_expert[tile] * N + n0) * K;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
  const int g = lane >> 2, q = lane & 3;

  float acc[MT][NT][4];
  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NT; ++j)
      #pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

  // each k step: A is BM x 32 (BM * 4 uint4), B is 128 x 32 (512 uint4, two per thread); loads run STAGES
  // k steps ahead of the products, in a ring of registers
  constexpr int A_VECS = BM * 4;
  const int br0 = tid >> 2, bc = (tid & 3) * 8, br1 = br0 + 64;
  const int ar = tid >> 2, ac = (tid & 3) * 8;  // A: row ar (xa points at it), 8 columns from ac
  const bool a_loads = tid < A_VECS && !a_zero;
  uint4 a_ring[STAGES], b_ring0[STAGES], b_ring1[STAGES];
  #pragma unroll
  for (int st = 0; st < STAGES; ++st) {
    const int k = st * 32;
    a_ring[st] = make_uint4(0, 0, 0, 0);
    if (k < K) {
      if (a_loads) a_ring[st] = *reinterpret_cast<const uint4*>(xa + k + ac);
      b_ring0[st] = *reinterpret_cast<const uint4*>(wb + (size_t)br0 * K + k + bc);
      b_ring1[st] = *reinterpret_cast<const uint4*>(wb + (size_t)br1 * K + k + bc);
    }
  }

  for (int k0 = 0; k0 < K; k0 += 32 * STAGES) {
    #pragma unroll
    for (int st = 0; st < STAGES; ++st) {
      const int k = k0 + st * 32;
      if (k >= K) break;  // the same for every thread
      __syncthreads();
      if (tid < A_VECS) *reinterpret_cast<uint4*>(As + ar * LDS + ac) = a_ring[st];
      *reinterpret_cast<uint4*>(Bs + br0 * LDS + bc) = b_ring0[st];
      *reinterpret_cast<uint4*>(Bs + br1 * LDS + bc) = b_ring1[st];
      __syncthreads();
      const int kn = k + 32 * STAGES;
      if (kn < K) {
        if (a_loads) a_ring[st] = *reinterpret_cast<const uint4*>(xa + kn + ac);
        b_ring0[st] = *reinterpret_cast<const uint4*>(wb + (size_t)br0 * K + kn + bc);
        b_ring1[st] = *reinterpret_cast<const uint4*>(wb + (size_t)br1 * K + kn + bc);
      }
      mma_slice<MT, NT, LDS, 32>(As, Bs, wm, wn, acc);
    }
  }

  __nv_bfloat16* ya = y + (size_t)tile * BM * N + n0;
  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int r = wm + i * 16 + g, c = wn + j * 8 + q * 2;
      *reinterpret_cast<__nv_bfloat162*>(ya + (size_t)r * N + c) = __floats2bfloat162_rn(acc[i][j][0], acc[i][j][1]);
      *reinterpret_cast<__nv_bfloat162*>(ya + (size_t)(r + 8) * N + c) =
          __floats2bfloat162_rn(acc[i][j][2], acc[i][j][3]);
    }
"""


@functools.cache
def _kernel(gather: bool) -> object:
    inputs = ["x", "w", "tile_expert", "used"] + (["source"] if gather else [])
    name = "mlx_serve_expert_tiles_gather" if gather else "mlx_serve_expert_tiles"
    # a macro, not a template argument: the gather branch names an input the other kernel does not have
    header = f"#define EXPERT_TILES_GATHER {int(gather)}\n{MMA_HEADER}"
    return mx.fast.cuda_kernel(name, inputs, ["y"], SOURCE, header=header)


def supports(weight: mx.array, tile_rows: int) -> bool:
    """bf16 weights `[E, N, K]` with N a multiple of 128 and K of 32, and a tile of 16, 32 or 64 rows."""
    _, n, k = weight.shape
    return weight.dtype == mx.bfloat16 and n % BN == 0 and k % BK == 0 and tile_rows in (16, 32, 64)


def expert_tiles_matmul(
    x: mx.array,
    weight: mx.array,
    tile_expert: mx.array,
    used: mx.array,
    tile_rows: int,
    source: mx.array | None = None,
) -> mx.array:
    """`y[t*BM:(t+1)*BM] = A_t @ weight[tile_expert[t]].T` for the first `used[0]` tiles, where `A_t` is
    `x[t*BM:(t+1)*BM]` or, with `source`, the rows `x[source[t*BM + r]]` (zeros where negative); the rows of
    later tiles are left unwritten (never read). bf16 `x` `[rows, K]` and `weight` `[E, N, K]`."""
    tiles = tile_expert.shape[0]
    n = weight.shape[1]
    gather = source is not None
    (y,) = _kernel(gather)(
        inputs=[x, weight, tile_expert, used] + ([source] if gather else []),
        template=[("BM", tile_rows), ("STAGES", STAGES)],
        grid=(n // BN * 256, tiles, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(tiles * tile_rows, n)],
        output_dtypes=[mx.bfloat16],
    )
    return y
