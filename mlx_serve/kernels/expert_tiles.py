"""A grouped GEMM for mixture-of-experts steps: row tiles, each of one expert, times that expert's weights.

A step's (row, expert) pairs are sorted by expert into tiles of `BM` rows (`tile_layout`); tile `t` multiplies
its rows by expert `tile_expert[t]`'s `[N, K]` weight (mlx-lm's SwitchLinear layout, `y = x W^T`). Each thread
block computes one tile's `BM x 128` output slab with bf16 tensor-core MMAs (`mma.sync m16n8k16`, fp32
accumulation, inline PTX: no header), `cp.async` copying each k step's `BM x 64` and `128 x 64` slices into
shared memory `PIPE - 1` steps ahead, behind one barrier a step; tiles past
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

BN, BK = 128, 64  # K a multiple of 64: either k step divides it
# K a step: 64 (128-byte rows, swizzled; 2 stages fill 48 KB) or 32 (rows padded, 3 stages): 64 measured 20% faster
# at 512-2,048 rows of 30B-A3B (each weight row read 128 bytes at a time, not 64)
KB = 64
PIPE = 2  # shared-memory stages: k steps of copies in flight
THREADS = 256  # 8 warps (128: 4 warps each owning all the tile's rows, measured no better)

# Template: BM (tile rows: 16, 32 or 64), KB (K a step: 32 or 64), PIPE (shared-memory stages), THREADS (128: 4
# warps side by side along N, each all BM rows x 32 columns; 256: 8 warps, 2 x 4 for tiles of 32 or 64 rows, else
# side by side); the header's EXPERT_TILES_GATHER macro (0/1) picks the A rows. Inputs: x [tiles * BM, K] bf16
# (GATHER: any [T, K], tile row r being x[source[r]], or zeros where source[r] < 0), w [E, N, K] bf16, tile_expert
# [tiles] uint32, used [1] int32 (GATHER: then source [tiles * BM] int32). Output: y [tiles * BM, N] bf16. Grid:
# (N / 128, tiles) blocks of THREADS.
SOURCE = r"""
  constexpr int WARPS = THREADS / 32;
  constexpr int WARPS_M = (BM >= 32 && WARPS == 8) ? 2 : 1;
  constexpr int WARPS_N = WARPS / WARPS_M;
  constexpr int WM = BM / WARPS_M, WN = 128 / WARPS_N;
  constexpr int MT = WM / 16, NT = WN / 8;    // m16 x n8 tiles per warp
  // a k step of KB: 32 (rows padded to 80 bytes) or 64 (rows of 128 bytes, swizzled: 2 stages fill 48 KB)
  using Layout = typename StepLayout<KB>::type;
  constexpr int CHUNKS = KB / 8;  // 16-byte chunks a row
  constexpr int A_STAGE = BM * Layout::ROW, B_STAGE = 128 * Layout::ROW;
  constexpr int A_PIECES = BM * CHUNKS, A_PER = (A_PIECES + THREADS - 1) / THREADS, B_PER = 128 * CHUNKS / THREADS;
  static_assert(PIPE * (A_STAGE + B_STAGE) * 2 <= 48 * 1024, "static shared memory: at most 48 KB");
  __shared__ __align__(16) __nv_bfloat16 As[PIPE * A_STAGE];
  __shared__ __align__(16) __nv_bfloat16 Bs[PIPE * B_STAGE];

  const int tile = blockIdx.y;
  if (tile >= used[0]) return;
  const int K = x_shape[1];
  const int N = w_shape[1];
  const int steps = K / KB;
  const int n0 = blockIdx.x * 128;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
  const int g = lane >> 2, q = lane & 3;
  const __nv_bfloat16* wb = w + ((size_t)tile_expert[tile] * N + n0) * K;

  // this thread's A pieces (16 bytes: row piece / CHUNKS, chunk piece % CHUNKS) and where their rows start
  const __nv_bfloat16* a_src[A_PER];
  bool a_ok[A_PER];
  #pragma unroll
  for (int i = 0; i < A_PER; ++i) {
    const int r = (tid + THREADS * i) / CHUNKS;
#if EXPERT_TILES_GATHER
    const int src = tid + THREADS * i < A_PIECES ? source[tile * BM + r] : -1;
    a_ok[i] = src >= 0;
    a_src[i] = x + (size_t)(a_ok[i] ? src : 0) * K;
#else
    a_ok[i] = tid + THREADS * i < A_PIECES;
    a_src[i] = x + (size_t)(tile * BM + (a_ok[i] ? r : 0)) * K;
#endif
  }
  auto copy_step = [&](int step) {
    const int stage = step % PIPE, k = step * KB;
    #pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      const int piece = tid + THREADS * i, r = piece / CHUNKS, c = piece % CHUNKS;
      if (piece < A_PIECES)
        cp_async16(As + stage * A_STAGE + Layout::at(r, c), a_src[i] + k + c * 8, a_ok[i]);
    }
    #pragma unroll
    for (int i = 0; i < B_PER; ++i) {
      const int piece = tid + THREADS * i, r = piece / CHUNKS, c = piece % CHUNKS;
      cp_async16(Bs + stage * B_STAGE + Layout::at(r, c), wb + (size_t)r * K + k + c * 8, true);
    }
  };

  float acc[MT][NT][4];
  zero(acc);
  pipe_start<PIPE>(steps, copy_step);
  for (int step = 0; step < steps; ++step) {
    pipe_next<PIPE>(step, steps, copy_step);
    mma_slice<MT, NT, KB, Layout>(As + (step % PIPE) * A_STAGE, Bs + (step % PIPE) * B_STAGE, wm, wn, acc);
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
    """bf16 weights `[E, N, K]` with N a multiple of 128 and K of 64, and a tile of 16, 32 or 64 rows."""
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
        template=[("BM", tile_rows), ("KB", KB), ("PIPE", PIPE), ("THREADS", THREADS)],
        grid=(n // BN * THREADS, tiles, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(tiles * tile_rows, n)],
        output_dtypes=[mx.bfloat16],
    )
    return y
