"""Ragged steps through mlx-lm's own model classes (ARCHITECTURE.md, "The ragged step").

The model gets input `[T, 1]`: every row is its own batch element of length 1. Each layer gets a
`RaggedLayerCache` whose `offset` is the rows' positions `[T]` (mlx-lm's RoPE takes per-batch offsets), whose
`update_and_fetch` writes the rows' K/V into the pool, and whose `make_mask` returns None. The models'
`scaled_dot_product_attention` name is replaced by a dispatcher that hands our caches' calls to the step's
ragged attention and leaves every other call to mlx-lm.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from mlx_serve.kv_pool import KVLayout, KVPool, take_rows
from mlx_serve.recurrent import StateRows


@dataclass(frozen=True, slots=True)
class LaneRows:
    """Where one lane's rows sit in the step and where its KV lives in the pool."""

    row_start: int
    rows: int
    kv_slots: mx.array  # pool slots of positions [0, end): history plus this lane's rows
    # None: causal attention over exactly `kv_slots`. Otherwise `kv_slots` is padded to a bucket and this additive
    # mask [1, 1, rows, padded] hides the padding and the future (see ModelRunner's kv_bucket)
    mask: mx.array | None = None
    # for a `PrefillGather` instead of `kv_slots`: the lane's block ids, (KV length, padded length) as int32 [2],
    # and the padded length
    table: mx.array | None = None
    length: mx.array | None = None
    kv_len: int = 0
    # with a mask: the query rows attention runs with, `rows` padded so a shape repeats (0: exactly `rows`)
    query_rows: int = 0
    # with a mask: each query row's position (pad rows repeat the last), for attention that reads the pool itself
    # (with a `table`) and for a sliding window's mask
    positions: mx.array | None = None
    # the position of `kv_slots`' first entry (a window-space lane's slots start at the earliest its window reaches)
    kv_start: int = 0


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """The step's single-row lanes, which come first in the step (rows [0, count)).

    Attention for them is one call of a `DecodeAttention` function over paged KV: `block_tables[i]` lists lane
    i's blocks (padded with 0), `lengths[i]` its KV length including the new row.
    """

    count: int
    block_tables: mx.array  # [count, max_blocks] int32
    lengths: mx.array  # [count] int32
    block_size: int
    lanes: tuple[LaneRows, ...]  # the same lanes, for the reference path


# (queries [n, heads, 1, head_dim], pool keys [slots, kv_heads, head_dim], pool values, rows, scale) -> like queries
DecodeAttention = Callable[[mx.array, mx.array, mx.array, DecodeRows, float], mx.array]
# (pool keys, pool values, a lane with `table`, block size) -> its keys and values [1, kv_heads, kv_len, head_dim]
PrefillGather = Callable[[mx.array, mx.array, LaneRows, int], tuple[mx.array, mx.array]]
# (queries [1, heads, n, head_dim], keys and values [1, kv_heads, kv_len, head_dim], scale, mask) -> like queries;
# mask: an additive array [1, 1, n, kv_len], "causal" or None, as `mx.fast.scaled_dot_product_attention` takes
ChunkAttention = Callable[[mx.array, mx.array, mx.array, float, Any], mx.array]


def sdpa_chunk_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """MLX's fused attention (cuDNN on CUDA)."""
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


@dataclass(frozen=True, slots=True)
class MatmulChunkAttention:
    """A chunk of at most `max_rows` query rows attends through two matmuls and a softmax over its whole history.

    cuDNN's fused attention runs one thread block per 64 query rows and head, each reading the whole history: a
    64-row chunk over 8k tokens got 32 blocks on the H200's 132 SMs and took 275 us a layer (8B 4-bit, ncu). As
    matmuls every output tile is its own block; a kv head's query heads are stacked as rows so its keys are read
    once. The scores are materialized (heads x rows x history), so larger chunks keep the fused kernel. This is
    the computation MLX's own unfused attention does (scale the queries, add the mask, softmax in float32).

    `history_per_score_row` > 0 keeps the fused kernel unless the history holds that many tokens per score row
    (query head x chunk row): there cuDNN's blocks are few and long (`bench_chunk_attention`, H200)."""

    max_rows: int = 128
    history_per_score_row: int = 0
    max_scores: int = 1 << 27  # score elements (heads x rows x history) a chunk may materialize: 256 MiB in bf16

    def takes(self, heads: int, rows: int, length: int) -> bool:
        """Whether a chunk of this shape goes through the matmuls (else MLX's fused attention)."""
        scores = heads * rows * length
        return rows <= self.max_rows and scores <= self.max_scores and length >= self.history_per_score_row * heads * rows

    def __call__(self, q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        batch, heads, rows, head_dim = q.shape
        kv_heads, length = keys.shape[1], keys.shape[2]
        if not self.takes(heads, rows, length) or not isinstance(mask, mx.array) or batch != 1:
            return sdpa_chunk_attention(q, keys, values, scale, mask)
        group = heads // kv_heads
        stacked = (q * mx.array(scale, q.dtype)).reshape(batch, kv_heads, group * rows, head_dim)
        scores = (stacked @ keys.swapaxes(-1, -2)).reshape(batch, kv_heads, group, rows, length)
        weights = mx.softmax(scores + mask.reshape(1, 1, 1, rows, length), axis=-1, precise=True)
        out = weights.reshape(batch, kv_heads, group * rows, length) @ values
        return out.reshape(batch, heads, rows, head_dim)


@dataclass(frozen=True, slots=True)
class PagedChunkAttention:
    """A chunk's attention read straight from the paged pool through its block table by one kernel
    (`kernels.chunk_attention`): no gathered copy of the history, no arithmetic on its padding or on keys past a
    row's position. A lane it does not take (no table, or a shape `supports` refuses) attends through `fallback`
    over its gathered history, as any `ChunkAttention`."""

    # (q [n, H, D], pool keys, pool values, table, length, positions, scale, block size, after=, head=) -> like q,
    # head's rows (the step's before the lane's, [P, H, D]) first where given
    attend: Callable[..., mx.array]
    supports: Callable[[mx.array, mx.array, int], bool]  # (q, pool keys, block size)
    fallback: ChunkAttention = sdpa_chunk_attention
    # most head rows (chunk rows x query heads) the kernel takes; more go to `fallback` (0: no limit). Counted over
    # all query heads, not a kv head's group: both the kernel's and cuDNN's times follow it (30B-A3B's 8-head groups
    # time as 8B's 4-head ones at the same rows, bench_chunk_attention H200, fifty-fifth run)
    max_head_rows: int = 0
    # and up to `long_head_rows` over a table of at least `long_history` tokens (0: none), where the fallback's
    # blocks are few and long
    long_head_rows: int = 0
    long_history: int = 0
    after: mx.array | None = None  # read the pool once this array's producer has run (KV written in place)

    def takes(self, q: mx.array, pool_keys: mx.array, lane: LaneRows, block_size: int) -> bool:
        """Whether `paged` runs this lane: q `[rows, heads, D]`, as the step's queries lie."""
        rows, heads = q.shape[0], q.shape[1]
        if lane.table is None or lane.positions is None or lane.positions.shape[0] < rows:
            return False
        head_rows = rows * heads
        few = not self.max_head_rows or head_rows <= self.max_head_rows
        long = head_rows <= self.long_head_rows and lane.table.shape[0] * block_size >= self.long_history
        return (few or long) and self.supports(q, pool_keys, block_size)

    def paged(self, q: mx.array, pool_keys: mx.array, pool_values: mx.array, lane: LaneRows, scale: float,
              block_size: int, head: mx.array | None = None) -> mx.array:  # fmt: skip
        extra = ({} if self.after is None else {"after": self.after}) | ({} if head is None else {"head": head})
        return self.attend(q, pool_keys, pool_values, lane.table, lane.length, lane.positions, scale, block_size,
                           **extra)  # fmt: skip

    def ordered_after(self, queries: mx.array) -> PagedChunkAttention:
        return replace(self, after=queries)

    def __call__(self, q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        return self.fallback(q, keys, values, scale, mask)


# `PagedChunkAttention` gets a lane's queries `[n, H, D]` as the step lays them and writes its output so (the
# kernel's QR build): no copy in or out a layer (the copies' encode and launch are host time a mixed step pays,
# NOTES session 32). False: `[1, H, n, D]` copies as before, for an A/B (`run_gpu_bench --paged-rows-first`)
PAGED_ROWS_FIRST = True

# H200 (bench_chunk_attention, 8B and 0.6B heads, 2k-16k history): the matmuls won wherever the history held at
# least 4 tokens per score row, e.g. a 64-row 8B chunk over 8k: 0.15 against cuDNN's 0.21 ms a layer; 16k: 0.23/0.40
CUDA_CHUNK_ATTENTION = MatmulChunkAttention(max_rows=256, history_per_score_row=4)


def reference_decode_attention(
    queries: mx.array, pool_keys: mx.array, pool_values: mx.array, rows: DecodeRows, scale: float
) -> mx.array:
    """One SDPA per lane over its gathered KV: exact, and the yardstick every fast path is tested against."""
    outputs = []
    for i, lane in enumerate(rows.lanes):
        keys = pool_keys[lane.kv_slots].transpose(1, 0, 2)[None]
        values = pool_values[lane.kv_slots].transpose(1, 0, 2)[None]
        q = queries[i : i + 1].transpose(2, 1, 0, 3)
        outputs.append(mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale).transpose(2, 1, 0, 3))
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Per-step metadata every layer's cache shares. Single-row lanes first, then multi-row (prefill) lanes."""

    positions: mx.array  # [T] int32
    write_slots: mx.array  # [T] pool slot of every row
    decode: DecodeRows | None
    lanes: tuple[LaneRows, ...]  # the multi-row lanes, after the decode rows
    decode_attention: DecodeAttention = reference_decode_attention
    prefill_gather: PrefillGather | None = None  # how lanes with a `table` read their history
    chunk_attention: ChunkAttention = sdpa_chunk_attention  # how multi-row lanes attend
    # the same rows in the pool's window space, for its sliding-window layers (None: the pool has none): their writes,
    # decode tables and lanes' slots over only the positions the windows reach
    windowed: StepLayout | None = None
    # the rows as the recurrent layers read them, lane group by lane group (None: the model has none)
    states: StateRows | None = None
    # arrays every layer of the step reads alike (a window's slots and masks, latent attention's slot table), built by
    # the first layer that asks: a step's graph holds them once, not once a layer
    shared: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def once(self, key: Any, build: Callable[..., Any], *args: Any) -> Any:
        """`build(*args)` the first time the step is asked for `key`, the same arrays every time after."""
        if key not in self.shared:
            self.shared[key] = build(*args)
        return self.shared[key]


class RaggedLayerCache:
    """mlx-lm's cache protocol for one layer of one ragged step."""

    def __init__(self, pool: KVPool, layer: int, step: StepLayout) -> None:
        self.pool = pool
        self.layer = layer
        self.step = step
        self.offset = step.positions
        self.window = pool.layout.window(layer)  # a sliding-window layer's (None: it attends to every earlier token)
        self.chunked = pool.layout.is_chunked(layer)  # the window is a fixed chunk (Llama 4), not the last positions
        # where this layer's KV is addressed: the window space's layout for a windowed layer of a pool with one
        self.space = step.windowed if step.windowed is not None and pool.in_window_space(layer) else step

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None

    def keys_and_values(self) -> tuple[None, None]:
        """What a layer reading this one's K/V takes (Gemma 3n's shared layers): nothing; its attention call, routed
        here, reads the pool."""
        return None, None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys: [T, kv_heads, 1, head_dim] -> rows [T, kv_heads, head_dim]
        self.pool.write(self.layer, self.space.write_slots, keys[:, :, 0, :], values[:, :, 0, :])
        return keys, values

    def attention(
        self, queries: mx.array, scale: float, sinks: mx.array | None = None, softcap: float | None = None
    ) -> mx.array:
        """Each lane attends causally to its own request's KV. queries: [T, heads, 1, head_dim]. `sinks`: a
        per-head logit every softmax also counts (gpt-oss). `softcap`: scores pass through `softcapped_attention`'s
        tanh cap (Gemma 2, `softcap_attention`)."""
        layout = self.pool.layout
        if self.window is not None or sinks is not None or softcap is not None or layout.quantizes(self.layer) \
                or layout.values_differ(self.layer):  # the paged kernels read keys and values of one size
            return self._masked(queries, scale, sinks, softcap)
        outputs = []
        decode = self.step.decode
        if decode is not None:
            pool_keys, pool_values = self.pool.keys[self.layer], self.pool.values[self.layer]
            outputs.append(self.step.decode_attention(queries[: decode.count], pool_keys, pool_values, decode, scale))
        for lane in self.step.lanes:
            rows = queries[lane.row_start : lane.row_start + lane.rows]  # [n, H, 1, D]
            # the rows before this lane's, as one array, ride in the paged kernel's output: no concatenation
            head = outputs[0] if len(outputs) == 1 and _leads(outputs[0], rows, lane.row_start) else None
            out = self._paged(rows, lane, scale, head)
            if out is not None and head is not None:
                outputs = [out]
                continue
            if out is None:
                q = rows.transpose(2, 1, 0, 3)  # [1, H, n, D]
                if lane.query_rows:  # one layout for every bucketed call: MLX caches a cuDNN graph per shape and strides
                    pad = lane.query_rows - lane.rows
                    q = mx.pad(q, [(0, 0), (0, 0), (0, pad), (0, 0)]) if pad else mx.contiguous(q)
                out = self._gathered(q, lane, scale)
                out = out[:, :, : lane.rows] if lane.query_rows > lane.rows else out
                out = out.transpose(2, 1, 0, 3)  # back to [n, H, 1, D]
            outputs.append(out)
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)

    def _paged(self, rows: mx.array, lane: LaneRows, scale: float, head: mx.array | None) -> mx.array | None:
        """A lane's attention read from the pool by the step's `PagedChunkAttention`, its queries and output rows
        first as the step's (no copy in or out), after `head`'s rows `[P, H, 1, D]` where given; None where it does
        not take the lane."""
        attention, size = self.step.chunk_attention, self.pool.block_size
        if not isinstance(attention, PagedChunkAttention) or lane.table is None:
            return None
        q = rows.reshape(rows.shape[0], rows.shape[1], rows.shape[3])  # [n, H, D]: a view
        pool_keys, pool_values = self.pool.keys[self.layer], self.pool.values[self.layer]
        if not attention.takes(q, pool_keys, lane, size):
            return None
        if not PAGED_ROWS_FIRST:  # the copies as they were (no head: `_leads`)
            out = attention.paged(mx.contiguous(rows.transpose(2, 1, 0, 3)), pool_keys, pool_values, lane, scale, size)
            return out.transpose(2, 1, 0, 3)
        if head is not None:
            head = head.reshape(head.shape[0], head.shape[1], head.shape[-1])
        out = attention.paged(q, pool_keys, pool_values, lane, scale, size, head)
        return out.reshape(out.shape[0], out.shape[1], 1, out.shape[2])

    def _gathered(self, q: mx.array, lane: LaneRows, scale: float) -> mx.array:
        """A multi-row lane's attention `[1, H, n, D]` over its history gathered (through the block table, or the
        lane's slots) and itself."""
        keys, values = self._lane_kv(lane)
        mask = lane.mask if lane.mask is not None else ("causal" if lane.rows > 1 else None)
        return self.step.chunk_attention(q, keys, values, scale, mask)

    def _lane_kv(self, lane: LaneRows) -> tuple[mx.array, mx.array]:
        """A multi-row lane's history and own rows `[1, kv_heads, kv_len, D]`: through its block table, or its slots;
        gathered once a step for a layer and those that read its K/V (`SharedKVCache`)."""
        return self.step.once(("lane kv", self.layer, lane.row_start), self._gather_lane_kv, lane)

    def _gather_lane_kv(self, lane: LaneRows) -> tuple[mx.array, mx.array]:
        if lane.table is None:
            return self.pool.gather(self.layer, lane.kv_slots)
        pool_keys, pool_values = self.pool.keys[self.layer], self.pool.values[self.layer]
        return self.step.prefill_gather(pool_keys, pool_values, lane, self.pool.block_size)

    def _masked(self, queries: mx.array, scale: float, sinks: mx.array | None,
                softcap: float | None = None) -> mx.array:  # fmt: skip
        """A windowed layer, one with attention sinks or soft-capped scores, or over quantized KV or values of another
        size than its keys: decode rows over their window (or whole history) read through the block tables, lanes over
        their gathered history behind a (windowed) causal mask, all through MLX's own attention, or mlx-lm's quantized
        one (the paged kernels have no windows, sinks, caps, quantized KV or values of their own size)."""
        outputs = []
        decode = self.space.decode
        quantized = self.pool.layout if self.pool.layout.quantizes(self.layer) else None
        pool_keys, pool_values = self.pool.keys[self.layer], self.pool.values[self.layer]
        window, chunked, dtype = self.window, self.chunked, queries.dtype
        if decode is not None:
            reads = self.space.once(("decode", window, chunked, dtype), decode_reads, decode, window, dtype, chunked)
            # a layer that reads another's K/V (`SharedKVCache`) takes the owner's gathered window
            keys, values = self.step.once(("decode kv", self.layer), _take_kv, pool_keys, pool_values, reads.slots)
            outputs.append(_masked_attention(queries[: decode.count], keys, values, scale, reads.mask, sinks, softcap,
                                             quantized))  # fmt: skip
        for i, lane in enumerate(self.space.lanes):
            q = queries[lane.row_start : lane.row_start + lane.rows].transpose(2, 1, 0, 3)  # [1, H, n, D]
            if lane.query_rows > lane.rows:
                q = mx.pad(q, [(0, 0), (0, 0), (0, lane.query_rows - lane.rows), (0, 0)])
            keys, values = self._lane_kv(lane)
            if window is not None:
                mask = self.space.once(("lane", i, window, chunked, dtype), windowed_lane_mask, lane, keys.shape[2],
                                       window, dtype, chunked)  # fmt: skip
            else:
                mask = lane.mask if lane.mask is not None else ("causal" if lane.rows > 1 else None)
            out = _masked_attention(q, keys, values, scale, mask, sinks, softcap, quantized)
            outputs.append(out[:, :, : lane.rows].transpose(2, 1, 0, 3))
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)


@dataclass(frozen=True, slots=True)
class DecodeReads:
    """Where the single-row lanes' attention reads the pool: `slots` `[n, span]`, and the additive `mask`
    `[n, 1, 1, span]` that keeps each lane's own positions."""

    slots: mx.array
    mask: mx.array


def decode_reads(rows: DecodeRows, window: int | None, dtype: mx.Dtype, chunked: bool = False) -> DecodeReads:
    """Each single-row lane reads the `window` positions up to its own (fewer at a sequence's start, masked;
    `chunked`: those of its own chunk only), or with no window every position its block table holds (those past its
    length masked), through the block tables on the device."""
    size = rows.block_size
    if window is not None:
        positions = rows.lengths[:, None] - window + mx.arange(window, dtype=mx.int32)[None]  # [n, window]
        first = (rows.lengths[:, None] - 1) // window * window if chunked else 0
        kept = positions >= first
    else:
        span = rows.block_tables.shape[1] * size
        positions = mx.broadcast_to(mx.arange(span, dtype=mx.int32)[None], (rows.count, span))  # [n, table]
        kept = positions < rows.lengths[:, None]
    positions = mx.maximum(positions, 0)
    blocks = mx.take_along_axis(rows.block_tables, positions // size, axis=1)
    mask = mx.where(kept, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))[:, None, None, :]
    return DecodeReads(blocks * size + positions % size, mask)


def project_heads(attention: Any, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """An mlx-lm attention module's queries, keys and values of rows `x` `[T, L, hidden]` as `[T, heads, L, D]`, for
    the forwards the engine gives modules that compute attention themselves (`softcap_attention`, `llama4`)."""
    batch, length, _ = x.shape
    queries = attention.q_proj(x).reshape(batch, length, attention.n_heads, -1).transpose(0, 2, 1, 3)
    keys = attention.k_proj(x).reshape(batch, length, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = attention.v_proj(x).reshape(batch, length, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return queries, keys, values


class SharedKVCache(RaggedLayerCache):
    """A layer that attends over another layer's K/V (Gemma 4's last layers): the owner's pool arrays and window,
    which the owner wrote earlier in the same step; it writes nothing of its own."""

    def __init__(self, owner: RaggedLayerCache) -> None:
        super().__init__(owner.pool, owner.layer, owner.step)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values


def _take_kv(pool_keys: Any, pool_values: Any, slots: mx.array) -> tuple[Any, Any]:
    """The single-row lanes' keys and values at `slots` `[n, span]`: `[n, kv_heads, span, D]` each."""
    return take_rows(pool_keys, slots), take_rows(pool_values, slots)


def _masked_attention(q: mx.array, keys: Any, values: Any, scale: float, mask: Any, sinks: mx.array | None,
                      softcap: float | None, quantized: KVLayout | None = None) -> mx.array:  # fmt: skip
    """MLX's fused attention; with `softcap` the soft-capped form (which has no sinks: no family has both); over KV
    quantized as `quantized` says, mlx-lm's quantized attention (which has neither)."""
    if quantized is not None:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention

        if sinks is not None or softcap is not None:
            raise ValueError("quantized KV with attention sinks or soft-capped scores")
        return quantized_scaled_dot_product_attention(q, keys, values, scale, mask, quantized.group_size,
                                                      quantized.bits)  # fmt: skip
    if softcap is None and (values.shape[-1] == keys.shape[-1] or mx.default_device() == mx.cpu):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)
    if softcap is not None:
        if sinks is not None:
            raise ValueError("soft-capped attention with sinks")
        return softcapped_attention(q, keys, values, scale, softcap, mask)
    # values of another size than the keys: MLX's fused attention on CUDA failed at launch with them (DeepSeek-V2,
    # thirty-sixth run); on the CPU its own fallback is these same ops
    return unfused_attention(q, keys, values, scale, mask, sinks=sinks)


def softcapped_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, softcap: float,
                         mask: Any) -> mx.array:  # fmt: skip
    """`[B, H, L, D]` queries over `[B, kv_heads, S, D]` KV with scores capped to (-softcap, softcap) by a tanh
    before the mask and softmax, in mlx-lm's gemma2 op order (so its tokens). `mask`: as MLX's fused attention takes
    (additive or boolean `[.., L, S]`, "causal" with the queries as the last L of S positions, or None)."""
    return unfused_attention(q, keys, values, scale, mask, softcap=softcap)


def unfused_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                      softcap: float | None = None, sinks: mx.array | None = None) -> mx.array:  # fmt: skip
    """Attention as matmuls and a softmax: `[B, H, L, D]` queries over `[B, kv_heads, S, D]` keys and
    `[B, kv_heads, S, Dv]` values (Dv may differ from D), scores soft-capped where `softcap` is given, each head's
    `sinks` logit counted in its softmax where given. `mask`: as MLX's fused attention takes it."""
    batch, heads, rows, head_dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    repeats = heads // kv_heads
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        mask = mx.arange(length - rows, length)[:, None] >= mx.arange(length)[None]
    q = q * scale
    if repeats > 1:  # each kv head's query heads as one more axis, as mlx-lm does (no repeated KV)
        q = q.reshape(batch, kv_heads, repeats, rows, head_dim)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
        mask = mx.expand_dims(mask, 2) if mask is not None and mask.ndim == 4 else mask
    scores = q @ keys.swapaxes(-1, -2)
    if softcap is not None:
        scores = mx.tanh(scores / softcap)
        scores *= softcap
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    if sinks is not None:  # one more logit a head, in the softmax only
        sink = sinks.astype(scores.dtype).reshape(1, kv_heads, repeats, 1, 1) if repeats > 1 else \
            sinks.astype(scores.dtype).reshape(1, heads, 1, 1)
        sink = mx.broadcast_to(sink, (*scores.shape[:-1], 1))
        weights = mx.softmax(mx.concatenate([scores, sink], axis=-1), precise=True, axis=-1)[..., :-1]
    else:
        weights = mx.softmax(scores, precise=True, axis=-1)
    out = weights @ values
    return out.reshape(batch, heads, rows, values.shape[-1]) if repeats > 1 else out


def windowed_lane_mask(lane: LaneRows, keys: int, window: int, dtype: mx.Dtype, chunked: bool = False) -> mx.array:
    """The additive mask `[1, 1, rows, keys]` of a lane's query rows over its `keys` gathered positions: each row
    sees the `window` positions up to its own, or with `chunked` those of its own `window`-token chunk up to its own
    (a padded lane's own mask hides its padding too)."""
    key_positions = lane.kv_start + mx.arange(keys, dtype=mx.int32)[None, :]
    if lane.positions is not None:
        query_positions = lane.positions[:, None]
    else:  # exact slots: the lane's rows are the last of its `keys` positions
        query_positions = (lane.kv_start + keys - lane.rows + mx.arange(lane.rows, dtype=mx.int32))[:, None]
    first = query_positions // window * window if chunked else query_positions - window + 1
    outside = (key_positions > query_positions) | (key_positions < first)
    mask = mx.where(outside, mx.array(mx.finfo(dtype).min, dtype), mx.array(0, dtype))[None, None]
    return mask if lane.mask is None else mx.minimum(mask, lane.mask)


def _leads(head: mx.array, rows: mx.array, row_start: int) -> bool:
    """Whether `head` (the step's attention output so far) is exactly the rows before `rows` `[n, H, 1, D]`, in
    their layout and dtype, for the paged kernel to put first in its output."""
    return PAGED_ROWS_FIRST and head.shape == (row_start, *rows.shape[1:]) and head.dtype == rows.dtype


def _dispatching_sdpa(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, **kwargs):
        if isinstance(cache, RaggedLayerCache):
            return cache.attention(queries, scale, kwargs.get("sinks"))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    scaled_dot_product_attention.ragged_dispatcher = True
    return scaled_dot_product_attention


def install_ragged_attention(model: Any, attends: bool = True) -> None:
    """Route the attention of every mlx-lm module the model's layers come from through the dispatcher (idempotent,
    per module): a family may reuse another's attention class (SmolLM3 runs Llama's). Attention written out by hand
    (Gemma 2's soft-capped scores) gets a forward of its own that routes the same way (`softcap_attention`)."""
    from mlx_serve.gemma4 import install_gemma4_forwards  # these import this module
    from mlx_serve.llama4 import install_llama4_forwards
    from mlx_serve.mla_attention import install_mla_forwards
    from mlx_serve.softcap_attention import install_softcapped_forwards

    own_forwards = (install_softcapped_forwards(model), install_mla_forwards(model), install_llama4_forwards(model),
                    install_gemma4_forwards(model))  # fmt: skip
    routed = any(own_forwards)
    names = {type(model).__module__} | {type(m).__module__ for _, m in model.named_modules()}
    modules = [sys.modules[n] for n in sorted(names) if hasattr(sys.modules.get(n), "scaled_dot_product_attention")]
    if not modules and not routed and attends:  # `attends`: the model has attention layers to route
        raise RuntimeError(f"{type(model).__module__} has no scaled_dot_product_attention to route")
    for module in modules:
        current = module.scaled_dot_product_attention
        if not getattr(current, "ragged_dispatcher", False):
            module.scaled_dot_product_attention = _dispatching_sdpa(current)
