"""Prompt log-probabilities: each prompt token's log-probability given the tokens before it (scoring a text).

A request that asks for them (`SamplingParams.prompt_logprobs`) has every row of its prompt chunks, not only the
last, run through the LM head: the row at position q scores the prompt token at q + 1. Such chunks run on the eager
path (compiled steps and the ANE lane return the last row's logits only), and the engine keeps the request off the
prefix cache's shared blocks, so no row of its prompt is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_serve.sampling import top_logprobs
from mlx_serve.types import PromptLogprob, TokenLogprob
from scheduler import Lane

# rows put through the LM head at once: bounds the [rows, vocabulary] float32 temporaries (256 x 152k: 156 MB)
SCORE_SLICE_ROWS = 256


@dataclass(frozen=True, slots=True)
class ScoredRows:
    """A step's rows that score a prompt: `rows` rows from `row_start`, the first at prompt position `position`."""

    request_id: str
    row_start: int
    rows: int
    position: int


@dataclass(frozen=True, slots=True)
class QueuedScores:
    """One lane's scores, queued on the device with the step; read back with its tokens."""

    request_id: str
    first: int  # the prompt position of the first entry (the first row's position + 1)
    logprobs: mx.array  # [n] each next prompt token's log-probability
    ranks: mx.array  # [n] its rank among the vocabulary (1: the likeliest)
    top_ids: mx.array | None  # [n, k], most likely first (None: k is 0)
    top_logprobs: mx.array | None


class PromptScorer:
    """The requests that asked for prompt log-probabilities, and the work a step does for them."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (prompt ids, top k)

    def add(self, request_id: str, prompt_ids: Sequence[int], top: int) -> None:
        self._prompts[request_id] = (np.asarray(prompt_ids, dtype=np.int32), top)

    def discard(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)

    def rows(self, lane: Lane, row_start: int) -> ScoredRows | None:
        """The lane's rows that score a prompt token (rows before the prompt's last): None if it has none."""
        entry = self._prompts.get(lane.request_id)
        if entry is None:
            return None
        rows = min(lane.end, len(entry[0]) - 1) - lane.start
        return ScoredRows(lane.request_id, row_start, rows, lane.start) if rows > 0 else None

    def wants(self, lanes: Sequence[Lane]) -> bool:
        """Whether any of the lanes has rows that score a prompt (then the step runs eager, on the GPU path)."""
        return bool(self._prompts) and any(self.rows(lane, 0) is not None for lane in lanes)

    def queue(self, hidden: mx.array, scored: Sequence[ScoredRows], logits: Callable[[mx.array], mx.array]
              ) -> list[QueuedScores]:
        """The lanes' scores from the step's hidden states `[T, hidden]` (`logits`: the model's LM head)."""
        queued = []
        for part in scored:
            prompt, top = self._prompts[part.request_id]
            targets = prompt[part.position + 1 : part.position + 1 + part.rows]
            pieces = [
                _score_slice(logits(hidden[part.row_start + i : part.row_start + min(i + SCORE_SLICE_ROWS, part.rows)]),
                             targets[i : i + SCORE_SLICE_ROWS], top)
                for i in range(0, part.rows, SCORE_SLICE_ROWS)
            ]  # fmt: skip
            chosen = mx.concatenate([piece.chosen for piece in pieces])
            ranks = mx.concatenate([piece.ranks for piece in pieces])
            ids = mx.concatenate([piece.top_ids for piece in pieces]) if top else None
            values = mx.concatenate([piece.top_logprobs for piece in pieces]) if top else None
            queued.append(QueuedScores(part.request_id, part.position + 1, chosen, ranks, ids, values))
        return queued

    def read(self, queued: Sequence[QueuedScores]) -> dict[str, tuple[int, list[PromptLogprob]]]:
        """Request id -> (the prompt position of its first entry, its entries), read back from the device."""
        out = {}
        for scores in queued:
            entry = self._prompts.get(scores.request_id)
            if entry is None:  # finished meanwhile (cancelled): nobody reads its scores
                continue
            out[scores.request_id] = (scores.first, _entries(scores, entry[0]))
        return out


@dataclass(frozen=True, slots=True)
class _SliceScores:
    chosen: mx.array
    ranks: mx.array
    top_ids: mx.array | None
    top_logprobs: mx.array | None


def _score_slice(logits: mx.array, targets: np.ndarray, top: int) -> _SliceScores:
    """Log-probabilities of `targets` under rows of `logits` `[n, V]`, their ranks, and the top `top` of each row."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
    ranks = 1 + (logprobs > chosen[:, None]).sum(axis=-1).astype(mx.int32)
    if not top:
        return _SliceScores(chosen, ranks, None, None)
    return _SliceScores(chosen, ranks, *top_logprobs(logprobs, top))


def score_arrays(queued: Sequence[QueuedScores]) -> list[mx.array]:
    """What evaluating the scores needs (queued with the step's other outputs)."""
    return [a for q in queued for a in (q.logprobs, q.ranks, q.top_ids, q.top_logprobs) if a is not None]


def _entries(scores: QueuedScores, prompt: np.ndarray) -> list[PromptLogprob]:
    chosen, ranks = scores.logprobs.tolist(), scores.ranks.tolist()
    ids = scores.top_ids.tolist() if scores.top_ids is not None else None
    values = scores.top_logprobs.tolist() if scores.top_logprobs is not None else None
    return [
        PromptLogprob(int(prompt[scores.first + i]), logprob,
                      tuple(map(TokenLogprob, ids[i], values[i])) if ids is not None else None, ranks[i])
        for i, logprob in enumerate(chosen)
    ]  # fmt: skip
