"""A small stand-in for `mlx_serve.engine.Engine` with the same public API, for fast HTTP-layer tests.

Tokens are a deterministic function of the prompt, the seed and the position, so tests can predict them.
Each token waits for `asyncio.sleep(token_delay_s)` so that streams can be interrupted mid-way.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from mlx_serve.errors import ContextLengthExceeded, QueueFull
from mlx_serve.handle import submit_each
from mlx_serve.types import GenerationRequest, TokenEvent, TokenLogprob, Usage


def fake_token(request: GenerationRequest, position: int, vocab_size: int) -> int:
    seed = request.sampling.seed or 0
    forced = [t for t, bias in (request.sampling.logit_bias or {}).items() if bias >= 100]
    if forced:  # a +100 bias makes a token certain, as in a real sampler
        return forced[0]
    return (sum(request.prompt_ids) * 31 + position * 7 + seed * 13) % vocab_size


@dataclass
class FakeHandle:
    engine: FakeEngine
    request: GenerationRequest
    request_id: str
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        self.engine.cancelled.append(self.request_id)
        if self.task is not None and not self.task.done():
            self.task.cancel()
            self.events.put_nowait(self._last("cancelled", self.engine.produced.get(self.request_id, 0)))
        self.engine.active.pop(self.request_id, None)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self.events.get()
            yield event
            if event.finish_reason is not None:
                return

    def _last(self, reason: str, count: int) -> TokenEvent:
        usage = Usage(len(self.request.prompt_ids), count, 0)
        return TokenEvent(self.request_id, None, "", finish_reason=reason, usage=usage, index=count)


class FakeEngine:
    model_id = "fake-model"
    context_length = 4096

    def __init__(self, tokenizer: Any, queue_limit: int = 64, token_delay_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer.get_vocab())
        self.queue_limit = queue_limit
        self.token_delay_s = token_delay_s
        self.active: dict[str, FakeHandle] = {}
        self.produced: dict[str, int] = {}
        self.cancelled: list[str] = []
        self.submitted: list[GenerationRequest] = []
        self.fail_with: str | None = None  # make every stream end in an engine error
        self.script: list[int] | None = None  # when set, every request outputs these tokens, then stops
        self._ids = itertools.count()

    def submit(self, request: GenerationRequest) -> FakeHandle:
        request.sampling.validate(self.vocab_size)
        if len(request.prompt_ids) + request.max_tokens > self.context_length:
            raise ContextLengthExceeded(f"{len(request.prompt_ids)} + {request.max_tokens} tokens exceed the "
                                        f"context of {self.context_length}", param="max_tokens")
        if len(self.active) >= self.queue_limit:
            raise QueueFull("the request queue is full")
        request_id = request.request_id or f"fake-{next(self._ids)}"
        handle = FakeHandle(self, request, request_id)
        handle.task = asyncio.get_running_loop().create_task(self._produce(handle))
        self.active[request_id] = handle
        self.submitted.append(request)
        return handle

    def submit_all(self, requests: list[GenerationRequest]) -> list[FakeHandle]:
        return submit_each(self.submit, requests)  # the engine's contract: all or none

    async def _produce(self, handle: FakeHandle) -> None:
        request, text, shown = handle.request, "", 0
        for position in range(request.max_tokens):
            await asyncio.sleep(self.token_delay_s)
            if self.fail_with:
                handle.events.put_nowait(TokenEvent(handle.request_id, None, "", finish_reason="error",
                                                    error=self.fail_with))
                return
            token = self.script[position % len(self.script)] if self.script else \
                fake_token(request, position, self.vocab_size)
            text += self.tokenizer.decode([token])
            self.produced[handle.request_id] = position + 1
            cut = min((text.find(s) for s in request.stop if s in text), default=-1)
            script_done = self.script is not None and position + 1 == len(self.script)
            reason = "stop" if cut >= 0 or script_done else ("length" if position + 1 == request.max_tokens else None)
            end = cut if cut >= 0 else len(text)
            handle.events.put_nowait(self._event(handle, token, text[shown:end], position, reason))
            shown = end
            if reason:
                break
        self.active.pop(handle.request_id, None)

    def _event(self, handle: FakeHandle, token: int, text: str, position: int, reason: str | None) -> TokenEvent:
        k = handle.request.sampling.logprobs
        top = tuple(TokenLogprob((token + i) % self.vocab_size, -0.5 - i) for i in range(k)) if k else None
        usage = Usage(len(handle.request.prompt_ids), position + 1, 0) if reason else None
        return TokenEvent(handle.request_id, token, text, logprob=-0.5 if k is not None else None,
                          top_logprobs=top, finish_reason=reason, usage=usage, index=position)

    def status(self) -> dict[str, Any]:
        requests = [{"id": h.request_id, "phase": "decoding", "priority": h.request.priority,
                     "prompt_tokens": len(h.request.prompt_ids), "computed_tokens": len(h.request.prompt_ids),
                     "output_tokens": self.produced.get(h.request_id, 0), "cached_tokens": 0, "arrival_s": 0.0}
                    for h in self.active.values()]
        return {"model": self.model_id, "requests": requests, "counters": {"steps": 0},
                "kv": {"blocks_total": 1024, "blocks_used": len(self.active), "blocks_cached": 0, "block_size": 16}}

    def stats(self) -> dict[str, Any]:
        return {"queue_depth": 0, "running": len(self.active), "kv_blocks_total": 1024,
                "kv_blocks_used": len(self.active), "kv_blocks_cached": 0, "prefix_hit_tokens_total": 5,
                "prompt_tokens_total": 20, "generation_tokens_total": sum(self.produced.values()),
                "steps_total": 3, "budget_halvings_total": 0, "preemptions_total": 0}

    def shutdown(self, timeout_s: float = 10.0) -> None:
        for handle in list(self.active.values()):
            handle.cancel()
