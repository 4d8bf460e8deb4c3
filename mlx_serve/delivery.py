"""The output side of the engine: per-request streams and handles, token events, the final event with usage.

Runs on the engine thread, except `reserve`, which `submit` calls from any thread. Events for streams read on an
event loop wait in an `Outbox` until `flush`, once per step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mlx_serve.errors import QueueFull
from mlx_serve.handle import Outbox, RequestHandle
from mlx_serve.outputs import RequestStream, with_usage
from mlx_serve.types import TokenEvent
from scheduler import FinishReason, Request, RequestState
from tracing.events import RequestFinished, TokenCommitted


class NullObserver:
    """The metrics hooks the engine calls (from its own thread); the server supplies a real one."""

    def on_step(self, elapsed_ms: float, rows: int, prefill_rows: int, decode_lanes: int, budget_halvings: int) -> None:
        pass

    def on_first_token(self, ttft_s: float) -> None:
        pass

    def on_token_gap(self, gap_s: float) -> None:
        pass

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        pass


class Delivery:
    def __init__(
        self,
        observer: Any,
        trace: Any,
        on_stop_string: Callable[[str], None],  # the request must finish in the scheduler too
        on_closed: Callable[[str], None],  # the request's per-request engine state can go
    ) -> None:
        self.observer = observer
        self.trace = trace
        self._on_stop_string = on_stop_string
        self._on_closed = on_closed
        self._streams: dict[str, RequestStream] = {}
        self._handles: dict[str, RequestHandle] = {}
        self._outbox = Outbox()  # events for handles read on event loops, until `flush`
        self._outstanding = 0  # reserved and not yet finished
        self._count_lock = threading.Lock()
        self.generation_tokens = 0

    def reserve(self, limit: int, queue_limit: int) -> None:
        """Count a new request in, or refuse it at once when `limit` are already outstanding (any thread)."""
        with self._count_lock:
            if self._outstanding >= limit:
                raise QueueFull(f"the request queue is full ({queue_limit} waiting); retry later")
            self._outstanding += 1

    def open(self, stream: RequestStream, handle: RequestHandle) -> None:
        self._streams[stream.request_id] = stream
        self._handles[stream.request_id] = handle

    def is_open(self, request_id: str) -> bool:
        return request_id in self._handles

    def open_ids(self) -> list[str]:
        return list(self._handles)

    def add_prompt_logprobs(self, scores: dict[str, tuple[int, list[Any]]]) -> None:
        """A step's prompt log-probabilities (request id -> first prompt position, entries), before its tokens."""
        for rid, (first, entries) in scores.items():
            stream = self._streams.get(rid)
            if stream is not None:
                stream.add_prompt_logprobs(first, entries)

    def add_embeddings(self, embeddings: dict[str, list[float]]) -> None:
        """A step's finished embeddings, before its tokens."""
        for rid, vector in embeddings.items():
            if (stream := self._streams.get(rid)) is not None:
                stream.embedding = tuple(vector)

    def publish(self, request: Request, sample: Any, last: bool = True) -> None:
        """The event for a committed token: the request's newest (`last`; the final event when the request is done),
        or one before it in the same step (accepted drafts)."""
        rid = request.request_id
        stream = self._streams.get(rid)
        if stream is None or sample is None:
            return
        finished = last and request.state is RequestState.FINISHED
        reason = request.finish_reason.value if finished and request.finish_reason else None
        is_stop_token = finished and request.finish_reason is FinishReason.STOP
        gap_from = stream.last_token_time
        event, stop_hit = stream.add_token(sample.token_id, sample.logprob, sample.top_logprobs, reason, is_stop_token)
        self.generation_tokens += 1
        if gap_from is None:
            self.observer.on_first_token(stream.first_token_time - stream.arrival)
        else:
            self.observer.on_token_gap(stream.last_token_time - gap_from)
        if self.trace.enabled:
            self.trace.emit(TokenCommitted(self.trace.now(), rid, event.index))
        if stop_hit:
            if not finished:
                self._on_stop_string(rid)
            finished, reason = True, "stop"
        if finished:
            self.finish(rid, reason or "stop", request, last_event=event)
        else:
            self._outbox.post(self._handles[rid], event)

    def flush(self) -> int:
        """Hand the events posted since the last flush to the loops that read them (the engine calls it after each
        step and each admission pass: an event never waits longer than that); returns how many."""
        return self._outbox.flush()

    def finish(
        self, rid: str, reason: str, request: Request | None, last_event: TokenEvent | None = None, error: str | None = None
    ) -> None:
        """Send the final event (with usage) and forget the request. Exactly once per request."""
        handle, stream = self._handles.pop(rid, None), self._streams.pop(rid, None)
        if handle is None:
            return
        self._on_closed(rid)
        with self._count_lock:
            self._outstanding -= 1
        prompt = len(stream.request.prompt_ids) if stream else 0
        completion = len(stream.token_ids) if stream else 0
        cached = request.num_cached_tokens if request else 0
        event = last_event or TokenEvent(rid, None, "", finish_reason=reason, error=error)
        event = with_usage(event, prompt, completion, cached)
        if event.finish_reason != reason:
            event = replace(event, finish_reason=reason)
        self._outbox.post(handle, event)
        self.observer.on_finish(reason, prompt, completion, cached)
        if self.trace.enabled:
            self.trace.emit(RequestFinished(self.trace.now(), rid, reason, prompt, completion, cached))
