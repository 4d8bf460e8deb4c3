"""Shape buckets of prefill lanes on CUDA: MLX builds a cuDNN attention graph (and `mx.compile` a trace) per new
shape, so a growing history and the chunk sizes must repeat a few shapes."""

from __future__ import annotations

KV_BUCKET = 1024  # history bucket unit of prefill lanes on CUDA
QUERY_BUCKET_MIN = 64  # fewest query rows a bucketed prefill lane's attention runs with


def query_bucket(rows: int) -> int:
    """Query rows a bucketed prefill lane's attention is padded to: a power of two, at least 64. Chunk budgets
    are powers of two already; this catches a prompt's last, partial chunk."""
    return max(QUERY_BUCKET_MIN, 1 << (rows - 1).bit_length())


def history_bucket(end: int, unit: int) -> int:
    """Padded KV length of a prefill lane: 1, 2, 4, 8 units, then multiples of 4 units (at most 2x padding where
    attention is cheap, at most 1.5x beyond), so a 16k prompt's chunks meet 6 shapes on the way, not 17."""
    units = -(-end // unit)
    if units <= 8:
        return unit * (1 << (units - 1).bit_length())
    return unit * (-(-units // 4) * 4)
