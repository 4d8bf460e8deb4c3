"""Turning committed tokens into stream events: incremental detokenization, stop strings, usage.

Runs on the engine thread. Text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from mlx_serve.types import GenerationRequest, PromptLogprob, TokenEvent, TokenLogprob, Usage


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


@dataclass(slots=True)
class RequestStream:
    """Per-request output state."""

    request_id: str
    request: GenerationRequest
    detokenizer: Any  # mlx-lm's streaming detokenizer
    arrival: float
    emitted: int = 0  # characters of detokenizer text already sent
    token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False
    # with `prompt_logprobs` asked for: the entries of the prompt's tokens so far (the first one has no logprob)
    prompt_logprobs: list[PromptLogprob] | None = None
    embedding: tuple[float, ...] | None = None  # an embedding request's vector, sent on the first event

    def __post_init__(self) -> None:
        if self.request.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [PromptLogprob(self.request.prompt_ids[0], None)]

    def add_prompt_logprobs(self, first: int, entries: list[PromptLogprob]) -> None:
        """A step's entries from prompt position `first` on; those already had (rows recomputed after a
        preemption) are skipped."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(entries[len(self.prompt_logprobs) - first :])

    def add_token(
        self,
        token_id: int,
        logprob: float | None,
        top: tuple[TokenLogprob, ...] | None,
        finish_reason: str | None,
        is_stop_token: bool,
    ) -> tuple[TokenEvent, bool]:
        """The event for one committed token; the flag says a stop string ended the request here."""
        now = time.perf_counter()
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        index = len(self.token_ids)
        self.token_ids.append(token_id)
        if not is_stop_token:
            self.detokenizer.add_token(token_id)
        if finish_reason is not None:
            self.detokenizer.finalize()
        text = self.detokenizer.text
        stop_hit = False
        # stop strings act from the request's `min_tokens`-th token on (vLLM's rule)
        stops = self.request.stop if len(self.token_ids) >= self.request.sampling.min_tokens else ()
        if stops:
            found = _find_stop(text, stops, max(0, self.emitted - max(len(s) for s in stops)))
            if found is not None:
                cut = found[0] + (len(found[1]) if self.request.include_stop_str_in_output else 0)
                text, stop_hit, finish_reason = text[:cut], True, "stop"
        end = len(text) if (finish_reason or not stops) else len(text) - _held_back(text, stops)
        delta = text[self.emitted : max(end, self.emitted)]
        self.emitted = max(end, self.emitted)
        event = TokenEvent(
            request_id=self.request_id,
            token_id=token_id,
            text=delta,
            logprob=logprob,
            top_logprobs=top,
            finish_reason=finish_reason,
            index=index,
            prompt_logprobs=tuple(self.prompt_logprobs) if index == 0 and self.prompt_logprobs is not None else None,
            embedding=self.embedding if index == 0 else None,
        )
        return event, stop_hit

    def final_text(self) -> str:
        return self.detokenizer.text


def _find_stop(text: str, stops: tuple[str, ...], search_from: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` from `search_from` on: where it starts, and which it is."""
    hits = [(i, s) for s in stops if (i := text.find(s, search_from)) >= 0]
    return min(hits) if hits else None


def with_usage(event: TokenEvent, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> TokenEvent:
    return replace(event, usage=Usage(prompt_tokens, completion_tokens, cached_tokens))
