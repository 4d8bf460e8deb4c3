"""Single-row steps through one `mx.compile`d function.

A decode step builds the same ~40 ops per layer every time; building and encoding them op by op costs more host
time than the GPU needs to run them (H200, 8B: 6-14 ms of host work against a 4-10 ms step). Compiled, the
graph is traced once per shape and replayed, and MLX fuses its elementwise chains. Shapes repeat because the
lane count and the block-table width are rounded up to buckets; padding lanes write and read the pool's scratch
block, and their logits are dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_serve.adapters import AdapterRows
from mlx_serve.fused_decode import FusedDecode
from mlx_serve.kv_pool import KVPool
from mlx_serve.ragged import DecodeAttention, DecodeRows, RaggedLayerCache, StepLayout
from scheduler import Lane


def lane_bucket(lanes: int) -> int:
    """Lanes a step is padded to: powers of two up to 8, then multiples of 8 (at most 7 idle rows)."""
    if lanes <= 8:
        return 1 << max(lanes - 1, 0).bit_length()
    return -(-lanes // 8) * 8


def width_bucket(blocks: int) -> int:
    """Block-table width a step is padded to: powers of two up to 256 blocks, then multiples of 256."""
    if blocks <= 256:
        return 1 << max(blocks - 1, 0).bit_length()
    return -(-blocks // 256) * 256


@dataclass(frozen=True, slots=True)
class DecodeTables:
    """The single-row lanes of a step padded to `count` lanes and `width` blocks; pad lanes sit in the scratch
    block (one token of history, position 0), so their attention is finite and their logits are dropped."""

    tables: np.ndarray  # [count, width] int32 block ids
    lengths: np.ndarray  # [count] KV length including the new row
    positions: np.ndarray  # [count] the new row's position
    slots: np.ndarray  # [count] the pool slot it writes
    # the same in the pool's window space (its sliding-window layers); None where it has none
    window_tables: np.ndarray | None = None
    window_slots: np.ndarray | None = None


def decode_tables(lanes: Sequence[Lane], count: int, pool: KVPool) -> DecodeTables:
    size = pool.block_size
    width = width_bucket(max(-(-lane.end // size) for lane in lanes)) if lanes else 1
    lengths = np.ones(count, dtype=np.int32)
    positions = np.zeros(count, dtype=np.int32)
    for i, lane in enumerate(lanes):
        lengths[i], positions[i] = lane.end, lane.start
    tables = padded_tables([lane.block_ids for lane in lanes], count, width, pool.scratch_block)
    meta = DecodeTables(tables, lengths, positions, _row_slots(tables, positions, size))
    if not pool.window_blocks:
        return meta
    windows = [pool.window_table(lane.window_block_ids) for lane in lanes]
    window_tables = padded_tables(windows, count, width, pool.window_scratch_block)
    return replace(meta, window_tables=window_tables, window_slots=_row_slots(window_tables, positions, size))


def padded_tables(tables: Sequence[Sequence[int]], count: int, width: int, scratch: int) -> np.ndarray:
    """`[count, width]` int32: each lane's blocks, then the scratch block (pad lanes all scratch)."""
    padded = np.full((count, width), scratch, dtype=np.int32)
    for i, table in enumerate(tables):
        used = min(len(table), width)
        padded[i, :used] = table[:used]
    return padded


def _row_slots(tables: np.ndarray, positions: np.ndarray, size: int) -> np.ndarray:
    """The pool slot each lane's new row writes."""
    return (tables[np.arange(len(positions)), positions // size] * size + positions % size).astype(np.int32)


class CompiledDecode:
    """Runs a step whose lanes are all single rows; returns the logits of the real lanes `[n, vocab]`."""

    def __init__(
        self,
        model: Any,
        pool: KVPool,
        attention: DecodeAttention,
        logits: Callable[[mx.array], mx.array],
        fused: FusedDecode | None = None,
        min_lanes: int = 1,
    ) -> None:
        self.model = model
        self.pool = pool
        self.attention = attention
        self.logits = logits
        self.fused = fused  # the fused forward; None: mlx-lm's modules through ragged caches
        self.min_lanes = min_lanes  # a step of 2+ lanes is padded to at least this many (see ModelRunner)
        self._step = mx.compile(self._traced)
        # steps with rows of LoRA adapters replay traces of their own, which hold the adapters' stacks as constants:
        # dropped whenever an adapter is loaded or unloaded (`forget_adapter_traces`)
        self._adapted_step: Callable[..., Any] | None = None
        self._selection: AdapterRows | None = None
        self.shapes: set[tuple[int, ...]] = set()  # (lanes, width) buckets traced so far; (lanes, width, 1) adapted
        # when MLX last traced a step (`time.perf_counter()`): a trace costs tens of ms of host time, so a report can
        # tell a retraced step from a stalled one
        self.trace_times: deque[float] = deque(maxlen=64)

    def __call__(
        self, lanes: Sequence[Lane], tokens: mx.array, adapter_slots: Sequence[int] = (),
        selection: AdapterRows | None = None,
    ) -> mx.array:  # fmt: skip
        """`tokens` `[len(lanes)]` are the lanes' inputs (possibly still being computed by the previous step);
        `adapter_slots` each lane's adapter slot (0: the base) where some lane has one, read through `selection`."""
        n = len(lanes)
        count = max(lane_bucket(n), self.min_lanes) if n > 1 else 1
        meta = decode_tables(lanes, count, self.pool)
        if count > n:
            tokens = mx.concatenate([tokens, mx.zeros((count - n,), dtype=tokens.dtype)])
        windowed = [] if meta.window_tables is None else [mx.array(meta.window_slots), mx.array(meta.window_tables)]
        inputs = (tokens, mx.array(meta.positions), mx.array(meta.slots), mx.array(meta.tables),
                  mx.array(meta.lengths), windowed, self.pool.keys, self.pool.values)  # fmt: skip
        if adapter_slots:
            if self._adapted_step is None:
                self._adapted_step = mx.compile(self._traced_adapted)
            self._selection = selection
            slots = np.zeros(count, dtype=np.uint32)  # pad lanes run the base model
            slots[:n] = adapter_slots
            self.shapes.add((count, meta.tables.shape[1], 1))
            logits, keys, values = self._adapted_step(mx.array(slots), *inputs)
        else:
            self.shapes.add((count, meta.tables.shape[1]))
            logits, keys, values = self._step(*inputs)
        self.pool.keys[:], self.pool.values[:] = keys, values
        return logits[:n] if count > n else logits

    def writes_in_place(self, adapted: bool) -> bool:
        """Whether a replay writes K/V in place (the fused forward's CUDA prologue), not through MLX's scatter; traces
        with adapter rows run the model's own modules."""
        return self.fused is not None and self.fused.writes_in_place and not adapted

    def forget_adapter_traces(self) -> None:
        """An adapter was loaded or unloaded: its stacks changed, so the traces holding the old ones go."""
        self._adapted_step = None
        self.shapes = {shape for shape in self.shapes if len(shape) == 2}

    def _traced_adapted(self, adapter_slots: mx.array, *inputs: Any) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """`_traced` through the model's modules (the fused forward is the base model's), each row's adapter slot an
        input of the trace (the adapted linears read it as the graph is built)."""
        self._selection.rows = adapter_slots
        try:
            return self._run(None, *inputs)
        finally:
            self._selection.rows = None

    def _traced(self, *inputs: Any) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        return self._run(self.fused, *inputs)

    def _run(
        self,
        fused: FusedDecode | None,
        tokens: mx.array,
        positions: mx.array,
        slots: mx.array,
        tables: mx.array,
        lengths: mx.array,
        windowed: list[mx.array],
        keys: list[mx.array],
        values: list[mx.array],
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        self.trace_times.append(time.perf_counter())  # mx.compile calls this only while tracing
        pool = self.pool.view(keys, values)
        rows = DecodeRows(tables.shape[0], tables, lengths, pool.block_size, lanes=())
        if fused is not None:
            return self.logits(fused(tokens, positions, slots, rows, pool)), pool.keys, pool.values
        window = None
        if windowed:  # the window space's write slots and tables, for the sliding-window layers
            window_slots, window_tables = windowed
            window_rows = DecodeRows(window_tables.shape[0], window_tables, lengths, pool.block_size, lanes=())
            window = StepLayout(positions, window_slots, window_rows, lanes=())
        layout = StepLayout(positions, slots, rows, lanes=(), decode_attention=self.attention, windowed=window)
        caches = [RaggedLayerCache(pool, layer, layout) for layer in range(len(keys))]
        hidden = self.model.model(tokens[:, None], cache=caches)[:, 0, :]
        return self.logits(hidden), pool.keys, pool.values
