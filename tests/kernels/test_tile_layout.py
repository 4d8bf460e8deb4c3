"""The one-launch tile layout (CUDA) against `grouped_experts.tile_layout`, and an invariant checker that pins
down what a layout must be (run on the reference on the CPU, and on the kernel's layouts on the device)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.grouped_experts import TileLayout, tile_count, tile_layout
from mlx_serve.kernels.tile_layout import MAX_EXPERTS, cuda_tile_layout, supports

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the layout kernel needs MLX's CUDA backend")


def check_layout(
    chosen: np.ndarray, experts: int, tile: int, layout: TileLayout, stable: bool = False
) -> None:
    """Assert that `layout` is a tile layout of `chosen` `[T, k]`: dtypes and shapes; each expert's pairs in its
    own tiles, from the start of its first tile, in consecutive rows; `tile_expert` each tile's expert (then
    `experts - 1`); `used` the tiles with pairs; every other row -1. With `stable`, each expert's pairs in pair
    order: then the layout is the only one (`tile_layout`'s)."""
    flat = np.asarray(chosen).reshape(-1).astype(np.int64)
    pairs, k = flat.size, np.asarray(chosen).shape[-1]
    total = tile_count(pairs, experts, tile)
    expected = {"source": (mx.int32, total * tile), "pair_slot": (mx.int32, pairs)}
    expected |= {"tile_expert": (mx.uint32, total), "used": (mx.int32, 1)}
    for name, (dtype, size) in expected.items():
        array = getattr(layout, name)
        assert array.dtype == dtype and array.shape == (size,), (name, array.dtype, array.shape)
    source, slot = np.array(layout.source), np.array(layout.pair_slot).astype(np.int64)
    tile_expert, used = np.array(layout.tile_expert), int(np.array(layout.used)[0])

    counts = np.bincount(flat, minlength=experts)
    tiles = -(-counts // tile)
    first_row = (np.cumsum(tiles) - tiles) * tile
    assert used == tiles.sum()
    want_expert = np.full(total, experts - 1)
    want_expert[:used] = np.repeat(np.arange(experts), tiles)
    assert np.array_equal(tile_expert, want_expert)

    assert np.unique(slot).size == pairs  # one row per pair
    rank = slot - first_row[flat]  # each expert's pairs fill rows first_row .. first_row + count
    assert np.all((rank >= 0) & (rank < counts[flat]))
    assert np.array_equal(tile_expert[slot // tile], flat)
    assert np.array_equal(source[slot], np.arange(pairs) // k)
    assert np.all(source >= -1) and np.count_nonzero(source >= 0) == pairs  # the rest is padding
    if stable:
        order = np.argsort(flat, kind="stable")
        want_rank = np.empty(pairs, dtype=np.int64)
        want_rank[order] = np.arange(pairs) - (np.cumsum(counts) - counts)[flat[order]]
        assert np.array_equal(rank, want_rank)


def routing(kind: str, rows: int, k: int, experts: int, seed: int) -> np.ndarray:
    """`[rows, k]` experts: `topk` k distinct random experts per row (as top-k gives), `one` every pair to one
    expert (k = 1), `few` every row the same k experts in its own order, `low` top-k among the first experts
    only (the last ones unused: the used tiles end before experts - 1's)."""
    rng = np.random.default_rng(seed)
    if kind == "topk":
        return np.argsort(rng.random((rows, experts)), axis=1)[:, :k]
    if kind == "one":
        return np.full((rows, k), experts // 3)
    if kind == "few":
        return rng.permuted(np.tile(rng.choice(experts, k, replace=False), (rows, 1)), axis=1)
    if kind == "low":
        return np.argsort(rng.random((rows, max(k, experts // 4))), axis=1)[:, :k]
    raise ValueError(kind)


# (kind, T, k, experts, tile)
CASES = [
    ("topk", 1, 8, 128, 32),
    ("topk", 7, 4, 16, 16),
    ("topk", 300, 8, 128, 32),
    ("topk", 1025, 1, 8, 64),  # a round of 1,024 pairs and one more
    ("topk", 2048, 8, 256, 16),
    ("topk", 4096, 8, 128, 64),
    ("one", 4096, 1, 128, 64),
    ("one", 1500, 1, 256, 16),
    ("few", 512, 8, 128, 32),
    ("few", 33, 8, 64, 16),
    ("low", 600, 8, 128, 32),
    ("low", 1, 2, 8, 64),
]


@pytest.mark.parametrize("kind,rows,k,experts,tile", CASES)
def test_the_reference_layout_holds_the_invariants_stably(kind, rows, k, experts, tile) -> None:
    chosen = routing(kind, rows, k, experts, seed=rows + k + experts + tile)
    with mx.stream(mx.cpu):  # the CPU's argsort is stable: the reference keeps pair order within each expert
        layout = tile_layout(mx.array(chosen.astype(np.uint32)), experts, tile)
        mx.eval(layout.source, layout.pair_slot, layout.tile_expert, layout.used)
    check_layout(chosen, experts, tile, layout, stable=True)


def test_the_checker_rejects_broken_layouts() -> None:
    experts, tile = 8, 16
    chosen = routing("topk", 40, 2, experts, seed=0)
    with mx.stream(mx.cpu):
        good = tile_layout(mx.array(chosen.astype(np.uint32)), experts, tile)
        mx.eval(good.source, good.pair_slot, good.tile_expert, good.used)
    check_layout(chosen, experts, tile, good, stable=True)
    source, slot = np.array(good.source), np.array(good.pair_slot)
    tile_expert, used = np.array(good.tile_expert), np.array(good.used)
    flat = chosen.reshape(-1)

    def swapped(p: int, q: int) -> TileLayout:  # pairs p and q trade rows
        s, ps = source.copy(), slot.copy()
        ps[p], ps[q] = slot[q], slot[p]
        s[ps[p]], s[ps[q]] = p // 2, q // 2
        return TileLayout(mx.array(s), mx.array(ps), good.tile_expert, good.used)

    same = np.flatnonzero(flat == flat[0])
    other = int(np.flatnonzero(flat != flat[0])[0])
    check_layout(chosen, experts, tile, swapped(int(same[0]), int(same[1])))  # within an expert: a layout ...
    with pytest.raises(AssertionError):  # ... but not a stable one
        check_layout(chosen, experts, tile, swapped(int(same[0]), int(same[1])), stable=True)
    with pytest.raises(AssertionError):  # across experts
        check_layout(chosen, experts, tile, swapped(0, other))
    padding = source.copy()
    padding[np.flatnonzero(source < 0)[0]] = 0
    wrong_tail = tile_expert.copy()
    wrong_tail[-1] = 0
    broken = [
        TileLayout(mx.array(padding), good.pair_slot, good.tile_expert, good.used),
        TileLayout(good.source, good.pair_slot, mx.array(wrong_tail), good.used),
        TileLayout(good.source, good.pair_slot, good.tile_expert, mx.array(used + 1)),
        TileLayout(good.source, good.pair_slot, good.tile_expert.astype(mx.int32), good.used),
    ]
    for layout in broken:
        with pytest.raises(AssertionError):
            check_layout(chosen, experts, tile, layout)


def test_supports_up_to_the_shared_counters() -> None:
    assert supports(128, 64) and supports(MAX_EXPERTS, 16) and supports(1, 1)
    assert not supports(MAX_EXPERTS + 1, 32) and not supports(0, 32) and not supports(128, 0)
    with pytest.raises(ValueError):
        cuda_tile_layout(mx.zeros((4, 2), dtype=mx.uint32), MAX_EXPERTS + 1, 32)


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("dtype", [mx.uint32, mx.int32])
@pytest.mark.parametrize("kind,rows,k,experts,tile", CASES)
def test_the_kernel_layout_equals_tile_layout(kind, rows, k, experts, tile, dtype) -> None:
    chosen = routing(kind, rows, k, experts, seed=rows + k + experts + tile)
    got = cuda_tile_layout(mx.array(chosen.astype(np.int32)).astype(dtype), experts, tile)
    mx.eval(got.source, got.pair_slot, got.tile_expert, got.used)
    check_layout(chosen, experts, tile, got, stable=True)
    with mx.stream(mx.cpu):
        want = tile_layout(mx.array(chosen.astype(np.uint32)), experts, tile)
        mx.eval(want.source, want.pair_slot, want.tile_expert, want.used)
    for name in ("source", "pair_slot", "tile_expert", "used"):
        assert np.array_equal(np.array(getattr(got, name)), np.array(getattr(want, name))), name


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("rows", [1, 64, 4096])
def test_the_kernel_takes_the_routers_strided_argpartition(rows) -> None:
    """The router's `argpartition(...)[..., -k:]`: uint32, not row-contiguous (the kernel's input is copied)."""
    experts, k, tile = 128, 8, 64 if rows >= 512 else 32
    gates = mx.random.uniform(shape=(rows, experts), key=mx.random.key(rows))
    chosen = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    got = cuda_tile_layout(chosen, experts, tile)
    mx.eval(got.source, got.pair_slot, got.tile_expert, got.used)
    check_layout(np.array(chosen), experts, tile, got, stable=True)
    ref = tile_layout(chosen, experts, tile)  # the device's sort need not be stable: still a layout
    check_layout(np.array(chosen), experts, tile, ref)
    assert np.array_equal(np.array(got.tile_expert), np.array(ref.tile_expert))
    assert np.array_equal(np.array(got.used), np.array(ref.used))
