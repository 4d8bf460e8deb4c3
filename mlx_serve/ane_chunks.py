"""Prefill chunks the scheduler placed on the ANE lane, around one step of the runner.

A chunk is submitted before the step's GPU work (so the lane reads the prompt while the GPU decodes) and
collected after it: its K/V go back into the pool, and a final chunk's last hidden state goes through the LM
head in MLX. A lane failure or timeout reruns the chunk on the GPU path: the request is never lost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_serve.ane import handoff
from mlx_serve.ane.lane import LaneError, PrefillLane
from mlx_serve.kv_pool import KVPool
from scheduler.plan import Lane, Path
from tracing.events import Span


@dataclass(frozen=True, slots=True)
class AneChunk:
    lane: Lane
    pending: Any  # the lane's PendingChunk


@dataclass(frozen=True, slots=True)
class AneOutcome:
    lane: Lane
    logits: mx.array | None  # [1, vocab] for a final chunk
    span: Span | None  # None when the chunk fell back to the GPU
    error: str | None = None


def split_lanes(lanes: tuple[Lane, ...], prefill_lane: PrefillLane | None) -> tuple[list[Lane], list[Lane]]:
    """(GPU lanes, ANE lanes): an ANE-placed chunk the lane cannot take runs on the GPU."""
    gpu, ane = [], []
    for lane in lanes:
        takes = prefill_lane is not None and lane.path is Path.ANE and prefill_lane.accepts(lane.start, lane.rows)
        (ane if takes else gpu).append(lane)
    return gpu, ane


def submit(prefill_lane: PrefillLane, lanes: list[Lane], pool: KVPool) -> list[AneChunk]:
    return [AneChunk(lane, handoff.submit_from_pool(prefill_lane, lane, pool)) for lane in lanes]


def collect(prefill_lane: PrefillLane, chunk: AneChunk, pool: KVPool, timeout_s: float, step_id: int) -> AneOutcome:
    """Wait for one chunk and hand its K/V to the pool; on LaneError say so (the runner reruns it on the GPU)."""
    try:
        result = chunk.pending.result(timeout_s)
    except LaneError as exc:
        return AneOutcome(chunk.lane, None, None, error=str(exc))
    handoff.write_back(result, chunk.lane, pool)
    logits = prefill_lane.logits(result.hidden[-1:]) if chunk.lane.samples else None
    return AneOutcome(chunk.lane, logits, result.span(step_id))


def on_gpu(lane: Lane) -> Lane:
    return dataclasses.replace(lane, path=Path.GPU)
