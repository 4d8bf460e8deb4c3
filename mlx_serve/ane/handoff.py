"""The runner's two calls around an ANE chunk: read the lane's past K/V out of the engine's KV pool and
submit it, then write the chunk's new K/V back. Everything on the engine thread.

    pending = submit_from_pool(ane_lane, plan_lane, pool)      # before the step's GPU work
    ... GPU decode / prefill lanes run ...
    result = pending.result(timeout_s)                          # LaneError -> rerun plan_lane on the GPU
    write_back(result, plan_lane, pool)
"""

from __future__ import annotations

import mlx.core as mx

from mlx_serve.ane.lane import ChunkResult, LayerKV, PendingChunk, PrefillLane
from mlx_serve.kv_pool import KVPool, slot_array
from scheduler.plan import Lane


def past_kv(plan_lane: Lane, pool: KVPool) -> list[LayerKV]:
    """Each layer's K/V of positions [0, start) as `[1, KVH, start, D]`; empty for a first chunk."""
    if plan_lane.start == 0:
        return []
    slots = mx.array(slot_array(plan_lane.block_ids, 0, plan_lane.start, pool.block_size))
    return [LayerKV(*pool.gather(layer, slots)) for layer in range(pool.layout.num_layers)]


def submit_from_pool(lane: PrefillLane, plan_lane: Lane, pool: KVPool) -> PendingChunk:
    return lane.submit(plan_lane.request_id, plan_lane.token_ids, plan_lane.start, past_kv(plan_lane, pool))


def write_back(result: ChunkResult, plan_lane: Lane, pool: KVPool) -> None:
    """Store the chunk's new K/V at its positions [start, end) in the pool, in the pool's dtype."""
    slots = mx.array(slot_array(plan_lane.block_ids, plan_lane.start, plan_lane.end, pool.block_size))
    dtype = pool.layout.dtype
    for layer, kv in enumerate(result.kv):
        keys = kv.keys[0].transpose(1, 0, 2).astype(dtype)
        values = kv.values[0].transpose(1, 0, 2).astype(dtype)
        pool.write(layer, slots, keys, values)
