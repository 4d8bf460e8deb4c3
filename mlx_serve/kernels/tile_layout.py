"""`grouped_experts.tile_layout` as one CUDA launch: a step's (row, expert) pairs counted per expert, each
expert's tiles placed, and every pair written to its tile row, by one thread block.

Why: `tile_layout` is a dozen small MLX ops (argsort, a `[pairs, experts]` compare, cumsums, scatters), each its
own launch: ~10 ms over the 48 MoE blocks of one 30B-A3B forward on the H200. This kernel gives the same four
arrays, bit for bit: the rank of a pair within its expert is stable (pair order, as `tile_layout`'s sort gives).

One block of 1,024 threads (32 warps) walks the pairs in rounds of 1,024, pair `base + threadIdx.x` per thread:
1. counts per expert: the lanes of a warp holding one expert find each other (`__match_any_sync`) and their
   lowest lane adds their number to the expert's shared counter (one atomic per warp and expert, not per pair);
2. warp 0 scans the experts' tile counts (`ceil(count / TILE)`): each expert's first tile row and `used`;
3. `tile_expert` for every tile (a binary search of the tile ends: experts - 1 past the used tiles) and -1 in
   every padding row (the tail of each expert's last tile, and every row past the used tiles);
4. per round, each warp's count per expert goes to shared memory, one thread per expert turns the 32 warps'
   counts into offsets (exclusive, in warp order, from the expert's running next row), and each pair's row is
   its warp's offset plus the lanes below it holding the same expert: the pair order, so the layout is stable.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from mlx_serve.grouped_experts import TileLayout, tile_count

THREADS = 1024  # one block: 32 warps
MAX_EXPERTS = 256  # the per-warp counters, 32 x EXPERTS ints (32 KiB at 256), stay in 48 KiB of static smem

# Template: TILE (rows per tile), EXPERTS. Input: chosen [T, k] uint32 or int32, each in [0, EXPERTS) (others
# get pair_slot -1 and no row). Outputs: source [total * TILE] int32, pair_slot [T * k] int32, tile_expert
# [total] uint32, used [1] int32, total = tile_count(T * k, EXPERTS, TILE). Grid: one block of 1,024 threads.
SOURCE = r"""
  constexpr int NTHREADS = 1024, WARPS = NTHREADS / 32;
  constexpr unsigned NONE = 0xffffffffu;  // the key of a lane without a (valid) pair
  static_assert(EXPERTS >= 1 && EXPERTS <= 256, "shared counters sized for at most 256 experts");
  static_assert(TILE >= 1, "tile rows");
  __shared__ int count[EXPERTS];            // pairs per expert
  __shared__ int tile_end[EXPERTS];         // inclusive prefix of the experts' tiles
  __shared__ int first_row[EXPERTS];        // each expert's first tile row
  __shared__ int warp_run[WARPS][EXPERTS];  // per round: each warp's pairs per expert, then its first row

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned below = (1u << lane) - 1u;  // the lanes before this one
  const int k = chosen_shape[1];
  const int pairs = chosen_shape[0] * k;
  const int total = (pairs + EXPERTS * (TILE - 1) + TILE - 1) / TILE;  // tile_count

  for (int e = tid; e < EXPERTS; e += NTHREADS) count[e] = 0;
  for (int i = tid; i < WARPS * EXPERTS; i += NTHREADS) warp_run[i / EXPERTS][i % EXPERTS] = 0;
  __syncthreads();

  // 1. pairs per expert: one shared atomic per (warp, expert) of a round
  for (int base = 0; base < pairs; base += NTHREADS) {  // uniform trip count: every lane reaches the match
    const int p = base + tid;
    unsigned e = p < pairs ? (unsigned)chosen[p] : NONE;
    if (e >= (unsigned)EXPERTS) e = NONE;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e != NONE && (peers & below) == 0u) atomicAdd(&count[e], __popc(peers));
  }
  __syncthreads();

  // 2. tiles per expert, scanned by warp 0: lane l takes experts [l * PER, (l + 1) * PER)
  if (warp == 0) {
    constexpr int PER = (EXPERTS + 31) / 32;
    const int e0 = lane * PER;
    int mine = 0;
    #pragma unroll
    for (int i = 0; i < PER; ++i)
      if (e0 + i < EXPERTS) mine += (count[e0 + i] + TILE - 1) / TILE;
    int incl = mine;
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    int run = incl - mine;  // tiles of the experts before e0
    #pragma unroll
    for (int i = 0; i < PER; ++i)
      if (e0 + i < EXPERTS) {
        first_row[e0 + i] = run * TILE;
        run += (count[e0 + i] + TILE - 1) / TILE;
        tile_end[e0 + i] = run;
      }
  }
  __syncthreads();
  const int used_tiles = tile_end[EXPERTS - 1];
  if (tid == 0) used[0] = used_tiles;

  // 3. each tile's expert: the experts whose tiles end at or before it (EXPERTS - 1 past the used tiles)
  for (int t = tid; t < total; t += NTHREADS) {
    int lo = 0, hi = EXPERTS;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (tile_end[mid] <= t) lo = mid + 1; else hi = mid;
    }
    tile_expert[t] = (uint32_t)(lo < EXPERTS ? lo : EXPERTS - 1);
  }
  // padding rows: the tail of each expert's last tile, then every row past the used tiles (pairs write the rest)
  for (int i = tid; i < EXPERTS * TILE; i += NTHREADS) {
    const int e = i / TILE;
    const int r = first_row[e] + count[e] + i % TILE;
    if (r < tile_end[e] * TILE) source[r] = -1;
  }
  for (int r = used_tiles * TILE + tid; r < total * TILE; r += NTHREADS) source[r] = -1;

  // 4. each pair's row, in pair order within its expert; thread e < EXPERTS keeps expert e's next row
  int next_row = tid < EXPERTS ? first_row[tid] : 0;
  for (int base = 0; base < pairs; base += NTHREADS) {
    const int p = base + tid;
    unsigned e = p < pairs ? (unsigned)chosen[p] : NONE;
    if (e >= (unsigned)EXPERTS) e = NONE;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const bool leader = e != NONE && (peers & below) == 0u;
    if (leader) warp_run[warp][e] = __popc(peers);  // entries no pair wrote this round stay 0
    __syncthreads();
    if (tid < EXPERTS) {
      #pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const int c = warp_run[w][tid];
        if (c != 0) {
          warp_run[w][tid] = next_row;
          next_row += c;
        }
      }
    }
    __syncthreads();
    if (e != NONE) {
      const int slot = warp_run[warp][e] + __popc(peers & below);
      source[slot] = p / k;
      pair_slot[p] = slot;
    } else if (p < pairs) {
      pair_slot[p] = -1;
    }
    __syncwarp();  // the warp's reads of its offsets before the leaders clear them
    if (leader) warp_run[warp][e] = 0;
    __syncwarp();  // the clears before the next round's counts (a different lane may lead an expert there)
  }
"""


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(
        "mlx_serve_tile_layout", ["chosen"], ["source", "pair_slot", "tile_expert", "used"], SOURCE
    )


def supports(experts: int, tile: int) -> bool:
    """Up to 256 experts (the shared counters' size) and any positive tile."""
    return 1 <= experts <= MAX_EXPERTS and tile >= 1


def cuda_tile_layout(chosen: mx.array, experts: int, tile: int) -> TileLayout:
    """`tile_layout(chosen, experts, tile)` in one CUDA launch: the same arrays (dtypes, shapes and values,
    bit for bit: each expert's pairs sit in pair order, a stable rank, as `tile_layout`'s sort gives).

    `chosen` `[T, k]` (uint32 or int32; other integer dtypes are cast to uint32) holds each row's experts, all in
    `[0, experts)`; out-of-range entries get `pair_slot` -1 and no tile row (`tile_layout` has no answer for them).
    """
    if not supports(experts, tile):
        raise ValueError(f"1 to {MAX_EXPERTS} experts and a positive tile, not {experts} and {tile}")
    if chosen.ndim != 2:
        chosen = chosen.reshape(-1, chosen.shape[-1])
    if chosen.dtype not in (mx.uint32, mx.int32):
        chosen = chosen.astype(mx.uint32)
    pairs = chosen.size
    total = tile_count(pairs, experts, tile)
    source, pair_slot, tile_expert, used = _kernel()(
        inputs=[chosen],
        template=[("TILE", tile), ("EXPERTS", experts)],
        grid=(THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(total * tile,), (pairs,), (total,), (1,)],
        output_dtypes=[mx.int32, mx.int32, mx.uint32, mx.int32],
    )
    return TileLayout(source, pair_slot, tile_expert, used)
