"""A mixture-of-experts MLP over expert tiles: the step's (row, expert) pairs sorted by expert into tiles of a
fixed number of rows, each tile multiplied by its own expert's weights, then each row's weighted sum.

The tile count is fixed by the rows (`pairs / tile + experts`, the worst case), never by the routing, so shapes
repeat and nothing waits for the host. The products per pair are mlx-lm's (same router, top-k, activation and
weighted sum in the same order); only the GEMM's accumulation order differs. Two ways to multiply the tiles:
`gather_tiles` (MLX's `gather_mm`, any backend: the reference) and, on CUDA, the `expert_tiles` kernel, which
skips the tiles the routing left empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

# (inputs, weight [E, N, K], tile_expert [tiles], used [1], tile rows, source) -> [tiles * rows, N]: inputs are
# [tiles * rows, K] tile rows, or with `source` [tiles * rows] any [T, K] whose row source[r] is tile row r (zeros
# where negative)
TileMatmul = Callable[[mx.array, mx.array, mx.array, mx.array, int, "mx.array | None"], mx.array]


def route(mlp: Any, x: mx.array) -> tuple[mx.array, mx.array]:
    """mlx-lm's Qwen3-MoE router for `x` `[T, hidden]`: each row's top-k experts `[T, k]` and their weights."""
    gates = mx.softmax(mlp.gate(x), axis=-1, precise=True)
    k = mlp.top_k
    chosen = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, chosen, axis=-1)
    if getattr(mlp, "norm_topk_prob", False):
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return chosen, scores


TILE_SIZES = (32, 64)  # rows per tile: the small one while experts get few pairs each, the large one beyond
LARGE_TILES_FROM_ROWS = 512


def tile_rows(rows: int) -> int:
    """Rows per tile for a step of `rows` rows: 32 below 512 rows (fewer padded rows while experts get few pairs),
    64 from there (fewer, fuller tiles; H200, 30B-A3B: 384 rows 41 against 43 ms, 2,048 rows 115 against 96)."""
    return TILE_SIZES[0] if rows < LARGE_TILES_FROM_ROWS else TILE_SIZES[1]


def tile_count(pairs: int, experts: int, tile: int) -> int:
    """Tiles that always hold `pairs` pairs over `experts` experts: sum over e of ceil(n_e / tile) is at most
    ceil((pairs + experts * (tile - 1)) / tile)."""
    return -(-(pairs + experts * (tile - 1)) // tile)


@dataclass(frozen=True, slots=True)
class TileLayout:
    source: mx.array  # [tiles * rows] int32: the input row of each tile row, -1 for padding
    pair_slot: mx.array  # [T * k] int32: the tile row of each (row, choice) pair, in the router's order
    tile_expert: mx.array  # [tiles] uint32, non-decreasing; tiles past the used ones repeat the last expert
    used: mx.array  # [1] int32: tiles that hold pairs


def tile_layout(chosen: mx.array, experts: int, tile: int) -> TileLayout:
    """The tiles of `chosen` `[T, k]`: each expert's pairs in consecutive tile rows (in pair order), each expert's
    first pair at the start of a tile. Index arithmetic only: no activation row is moved here."""
    flat = chosen.reshape(-1)
    pairs, k = flat.size, chosen.shape[-1]
    order = mx.argsort(flat)
    by_expert = flat[order]
    counts = (flat[:, None] == mx.arange(experts, dtype=flat.dtype)[None, :]).astype(mx.int32).sum(axis=0)
    first_pair = mx.cumsum(counts) - counts  # sorted position of each expert's first pair
    tiles = (counts + tile - 1) // tile
    tile_end = mx.cumsum(tiles)
    first_slot = (tile_end - tiles) * tile
    slot = first_slot[by_expert] + mx.arange(pairs, dtype=mx.int32) - first_pair[by_expert]
    total = tile_count(pairs, experts, tile)
    source = mx.full((total * tile,), -1, dtype=mx.int32)
    source[slot] = (order // k).astype(mx.int32)
    pair_slot = mx.zeros((pairs,), dtype=mx.int32)
    pair_slot[order] = slot.astype(mx.int32)
    steps = mx.arange(total, dtype=mx.int32)[:, None]
    tile_expert = mx.minimum((tile_end[None, :] <= steps).astype(mx.int32).sum(axis=1), experts - 1)
    return TileLayout(source, pair_slot, tile_expert.astype(mx.uint32), tile_end[-1:].astype(mx.int32))


def layout_of(chosen: mx.array, experts: int, tile: int) -> TileLayout:
    """`tile_layout`, as one CUDA launch where MLX runs on CUDA (`kernels/tile_layout.py`: the same arrays; the
    dozen small ops cost ~10 ms over the 48 blocks of a 30B-A3B forward on the H200)."""
    from mlx_serve.kernels import tile_layout as kernel
    from mlx_serve.kernels.paged_attention import cuda_available

    if cuda_available() and kernel.supports(experts, tile):
        return kernel.cuda_tile_layout(chosen, experts, tile)
    return tile_layout(chosen, experts, tile)


def tiles_fit(matmul: TileMatmul, mlp: Any) -> bool:
    """Whether `matmul` can multiply this block's experts at every `tile_rows` size (the CUDA kernel takes bf16
    weights of whole 128-column, 32-deep slices; gather_mm takes anything)."""
    from mlx_serve.kernels import expert_tiles

    if matmul is not expert_tiles.expert_tiles_matmul:
        return True
    glu = mlp.switch_mlp
    weights = (glu.gate_proj.weight, glu.up_proj.weight, glu.down_proj.weight)
    return all(expert_tiles.supports(w, tile) for w in weights for tile in TILE_SIZES)


def gather_tiles(
    x: mx.array, weight: mx.array, tile_expert: mx.array, used: mx.array, tile: int, source: mx.array | None = None
) -> mx.array:
    """Every tile times its expert through `mx.gather_mm` (empty tiles too: they hold zeros)."""
    if source is not None:  # row T of the extended input is the zero row padding reads
        extended = mx.concatenate([x, mx.zeros((1, x.shape[-1]), dtype=x.dtype)])
        x = extended[mx.where(source < 0, x.shape[0], source)]
    total = tile_expert.size
    tiles = x.reshape(total, tile, x.shape[-1])
    every_tile = mx.arange(total, dtype=mx.uint32)
    out = mx.gather_mm(tiles, weight.swapaxes(-1, -2), every_tile, tile_expert, sorted_indices=True)
    return out.reshape(total * tile, -1)


def grouped_moe(mlp: Any, x: mx.array, tile: int = 32, matmul: TileMatmul = gather_tiles) -> mx.array:
    """`mlp(x)` for `x` `[T, hidden]` over the tiles of `tile_layout`."""
    chosen, scores = route(mlp, x)
    glu = mlp.switch_mlp
    layout = layout_of(chosen, glu.gate_proj.num_experts, tile)
    experts = (layout.tile_expert, layout.used, tile)
    up = matmul(x, glu.up_proj.weight, *experts, layout.source)
    gate = matmul(x, glu.gate_proj.weight, *experts, layout.source)
    out = matmul(glu.activation(up, gate), glu.down_proj.weight, *experts, None)
    per_pair = out[layout.pair_slot].reshape(*chosen.shape, -1)  # [T, k, hidden] in each row's top-k order
    return (per_pair * scores[..., None]).sum(axis=-2).astype(per_pair.dtype)
