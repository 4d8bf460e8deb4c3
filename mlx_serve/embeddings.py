"""Embeddings: a prompt's final hidden states pooled into one unit vector (`GenerationRequest.pooling`).

"last" takes the last prompt row's hidden state (decoder embedding models: Qwen3-Embedding, e5-mistral, gte-Qwen),
"mean" the mean over every prompt row, summed chunk by chunk on the device. Both are L2-normalised, as OpenAI's
/v1/embeddings returns them. Such chunks run eager (compiled steps return logits only) and off the ANE lane; a mean
request keeps off the prefix cache's shared blocks, so that no row of its prompt is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from scheduler import Lane

POOLINGS = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PooledRows:
    """A step's prompt rows of an embedding request: `rows` rows from `row_start`, the first at prompt position
    `position`; `final`: they end the prompt."""

    request_id: str
    row_start: int
    rows: int
    position: int
    final: bool


@dataclass(frozen=True, slots=True)
class QueuedEmbedding:
    request_id: str
    vector: mx.array  # [hidden] float32, unit length


class Pooler:
    """The embedding requests, and the work a step does for them."""

    def __init__(self) -> None:
        self._requests: dict[str, tuple[int, str]] = {}  # request id -> (prompt length, pooling)
        self._sums: dict[str, mx.array] = {}  # "mean": the hidden states summed over the rows computed so far

    def add(self, request_id: str, prompt_length: int, pooling: str) -> None:
        self._requests[request_id] = (prompt_length, pooling)

    def discard(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._sums.pop(request_id, None)

    def rows(self, lane: Lane, row_start: int) -> PooledRows | None:
        """The lane's prompt rows, if its request pools them (None otherwise, or once past the prompt)."""
        entry = self._requests.get(lane.request_id)
        if entry is None or lane.start >= entry[0]:
            return None
        rows = min(lane.end, entry[0]) - lane.start
        return PooledRows(lane.request_id, row_start, rows, lane.start, lane.start + rows == entry[0])

    def wants(self, lanes: Sequence[Lane]) -> bool:
        """Whether any lane has prompt rows to pool (then the step runs eager)."""
        return bool(self._requests) and any(self.rows(lane, 0) is not None for lane in lanes)

    def queue(self, hidden: mx.array, pooled: Sequence[PooledRows]) -> tuple[list[QueuedEmbedding], list[mx.array]]:
        """The step's finished embeddings from its hidden states `[T, hidden]`, and every array it must evaluate
        (the running sums too, so no step's graph outlives it)."""
        done, pending = [], []
        for part in pooled:
            length, pooling = self._requests[part.request_id]
            if pooling == "last":
                vector = hidden[part.row_start + part.rows - 1].astype(mx.float32) if part.final else None
            else:
                rows = hidden[part.row_start : part.row_start + part.rows].astype(mx.float32).sum(axis=0)
                # a lane from position 0 is a (re)computation: a preempted request starts its sum again
                total = rows if part.position == 0 else self._sums[part.request_id] + rows
                self._sums[part.request_id] = total
                pending.append(total)
                vector = total / length if part.final else None
            if vector is not None:
                vector = vector / mx.maximum(mx.linalg.norm(vector), 1e-12)
                done.append(QueuedEmbedding(part.request_id, vector))
                pending.append(vector)
        return done, pending

    def read(self, queued: Sequence[QueuedEmbedding]) -> dict[str, list[float]]:
        """Request id -> its embedding, read back from the device (cancelled requests are left out)."""
        return {q.request_id: q.vector.tolist() for q in queued if q.request_id in self._requests}
