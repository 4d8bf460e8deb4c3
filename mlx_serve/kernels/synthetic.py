"""Random paged-KV decode problems for the kernel tests and micro-benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_serve.kv_pool import slot_array
from mlx_serve.ragged import DecodeRows, LaneRows


@dataclass(frozen=True, slots=True)
class DecodeProblem:
    queries: mx.array  # [n, heads, 1, head_dim]
    pool_keys: mx.array  # [num_blocks * block_size, kv_heads, head_dim]
    pool_values: mx.array
    rows: DecodeRows
    scale: float


def random_decode_problem(
    lengths: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int = 16,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    sharpness: float = 1.0,
) -> DecodeProblem:
    """Lanes with these KV lengths, their blocks scattered at random over a pool with a few unused blocks."""
    rng = np.random.default_rng(seed)
    needed = [-(-length // block_size) for length in lengths]
    num_blocks = sum(needed) + spare_blocks
    order = rng.permutation(num_blocks).tolist()
    tables: list[tuple[int, ...]] = []
    for count in needed:
        tables.append(tuple(order[:count]))
        order = order[count:]
    width = max(needed)
    lanes = tuple(
        LaneRows(i, 1, mx.array(slot_array(table, 0, length, block_size)))
        for i, (table, length) in enumerate(zip(tables, lengths))
    )
    rows = DecodeRows(
        count=len(lengths),
        block_tables=mx.array([list(t) + [0] * (width - len(t)) for t in tables], dtype=mx.int32),
        lengths=mx.array(lengths, dtype=mx.int32),
        block_size=block_size,
        lanes=lanes,
    )
    key = mx.random.key(seed)
    kq, kk, kv = mx.random.split(key, 3)
    slots = num_blocks * block_size
    return DecodeProblem(
        # sharpness > 1 makes softmax peakier: large logits test the running max
        queries=(sharpness * mx.random.normal((len(lengths), kv_heads * group, 1, head_dim), key=kq)).astype(
            dtype
        ),
        pool_keys=mx.random.normal((slots, kv_heads, head_dim), key=kk).astype(dtype),
        pool_values=mx.random.normal((slots, kv_heads, head_dim), key=kv).astype(dtype),
        rows=rows,
        scale=head_dim**-0.5,
    )
