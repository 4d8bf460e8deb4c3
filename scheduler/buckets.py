"""Shape buckets of prefill lanes on CUDA: MLX builds a cuDNN attention graph (and `mx.compile` a trace) per new
shape, so a growing history and the chunk sizes must repeat a few shapes.

The engine pads to these shapes and the scheduler plans with them (`SchedulerConfig.kv_bucket`): a chunk runs, and
costs, as its padded shape, so budgets land on query buckets and the cost model counts the padded work."""

from __future__ import annotations

KV_BUCKET = 1024  # history bucket unit of prefill lanes on CUDA
QUERY_BUCKET_MIN = 64  # fewest query rows a bucketed prefill lane's attention runs with


def query_bucket(rows: int) -> int:
    """Query rows a bucketed prefill lane's attention is padded to: a power of two or 1.5x one, at least 64
    (under 1.5x padding). Chunk budgets are such numbers already (halved, or 1.5x a halved one); this catches
    a prompt's last, partial chunk and a budget grown to fill a row tile."""
    if rows <= QUERY_BUCKET_MIN:
        return QUERY_BUCKET_MIN
    power = 1 << (rows - 1).bit_length()
    return power * 3 // 4 if rows <= power * 3 // 4 else power


def query_buckets(max_rows: int) -> list[int]:
    """Every `query_bucket` up to the one `max_rows` needs, smallest first."""
    buckets, rows = [], QUERY_BUCKET_MIN
    while not buckets or buckets[-1] < query_bucket(max_rows):
        buckets.append(rows)
        rows = query_bucket(rows + 1)
    return buckets


def history_bucket(end: int, unit: int) -> int:
    """Padded KV length of a prefill lane: 1, 2, 4, 8 units, then multiples of 4 units (at most 2x padding where
    attention is cheap, at most 1.5x beyond), so a 16k prompt's chunks meet 6 shapes on the way, not 17."""
    units = -(-end // unit)
    if units <= 8:
        return unit * (1 << (units - 1).bit_length())
    return unit * (-(-units // 4) * 4)
