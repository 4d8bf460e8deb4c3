"""Drafts from a small model (`--draft-model`, as mlx-lm's): a model of the same vocabulary guesses the next few
tokens greedily, and the served model verifies them as extra rows of the request's decode lane (the scheduler's
speculative decoding; `sampling.draft_verdict` keeps greedy answers the model's own and sampled ones distributed as
its). The draft keeps an mlx-lm cache per drafting request, holding the request's tokens as far as they agree with
what it last saw: after a verdict it is cut back to the tokens kept, then fed what is new.

It runs on the engine thread (the scheduler asks it while planning). A request's prompt is fed at most
`feed_per_step` tokens a step, so a long prompt never holds a step (and every stream in it) for long; it drafts
once the draft has read it all. Its caches hold at most `most_tokens` tokens together (the memory kept for them):
a request that would take more stops drafting, and its cache goes. Each drafting request costs the step its own
draft forwards (one read-back each): a draft model is for a few streams, as in mlx-lm, not for a full batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from mlx_serve.errors import InvalidRequest
from scheduler.request import Request

log = logging.getLogger(__name__)

FEED_PER_STEP = 512  # prompt tokens a draft reads a step (a 0.6B draft: ~10 ms on an M-class GPU)


@dataclass(slots=True)
class _DraftState:
    cache: list[Any]
    tokens: list[int] = field(default_factory=list)  # what the cache holds, in order


class DraftModel:
    """A `DraftSource` (scheduler.speculation) backed by a small model."""

    def __init__(self, model: Any, most_tokens: int, feed_per_step: int = FEED_PER_STEP) -> None:
        self.model = model
        self.most_tokens = most_tokens
        self.feed_per_step = feed_per_step
        self._states: dict[str, _DraftState] = {}
        self._failed: set[str] = set()  # requests the draft model failed for: they draft no more

    @property
    def held_tokens(self) -> int:
        # a copy first: /v1/status reads this from an HTTP thread while the engine thread adds and drops caches
        return sum(len(state.tokens) for state in list(self._states.values()))

    def propose(self, request: Request, most: int) -> tuple[int, ...]:
        """Up to `most` tokens the draft would say next (none while it is still reading the request's tokens). A
        draft is only a guess: where the draft model fails, the request goes on without drafts, never fails."""
        try:
            return self._propose(request, most)
        except Exception:
            log.exception("the draft model failed for %s: it goes on without drafts", request.request_id)
            self.discard(request.request_id)
            self._failed.add(request.request_id)
            return ()

    def _propose(self, request: Request, most: int) -> tuple[int, ...]:
        if request.request_id in self._failed:
            return ()
        state = self._states.get(request.request_id)
        others = self.held_tokens - (len(state.tokens) if state is not None else 0)
        if others + request.num_tokens + most > self.most_tokens:  # its cache would outgrow the memory kept for them
            self.discard(request.request_id)
            return ()
        if state is None:
            state = self._states[request.request_id] = _DraftState(make_prompt_cache(self.model))
        known = request.tokens(0, request.num_tokens)
        kept = _common_prefix(state.tokens, known)
        if kept < len(state.tokens):  # the served model rejected some drafts: forget them
            trim_prompt_cache(state.cache, len(state.tokens) - kept)
            del state.tokens[kept:]
        new = known[kept:]
        if not new:  # the draft must read the request's last token before it can guess the next
            trim_prompt_cache(state.cache, 1)
            new = known[-1:]
            del state.tokens[-1:]
        if len(new) > self.feed_per_step:
            self._feed(state, new[: self.feed_per_step])
            return ()
        # every draft is fed back lazily: one read-back for all of them
        logits = self._feed(state, new, evaluate=False)
        drafts = []
        for i in range(most):
            token = mx.argmax(logits, axis=-1)
            drafts.append(token)
            if i + 1 < most:
                logits = self.model(token.reshape(1, 1), cache=state.cache)[0, -1]
        mx.eval(drafts, [c.state for c in state.cache])
        proposed = tuple(int(t) for t in drafts)
        state.tokens.extend(proposed[:-1])
        return proposed

    def observe(self, request: Request, accepted: int) -> None:
        """Nothing to learn: the next proposal cuts the cache back to what the served model kept."""

    def discard(self, request_id: str) -> None:
        """The request is done: its cache's memory is free."""
        self._states.pop(request_id, None)
        self._failed.discard(request_id)

    def _feed(self, state: _DraftState, tokens: list[int], evaluate: bool = True) -> mx.array:
        logits = self.model(mx.array(tokens, dtype=mx.int32)[None], cache=state.cache)[0, -1]
        state.tokens.extend(tokens)
        if evaluate:
            mx.eval([c.state for c in state.cache])
        return logits


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_draft_model(draft: Any, vocab_size: int, path: Path | str) -> None:
    """Refuse a draft the engine cannot use: another vocabulary, or caches that cannot be cut back (windows)."""
    draft_vocab = int(draft.args.vocab_size)
    if draft_vocab != vocab_size:
        raise InvalidRequest(f"draft model {path}: its vocabulary has {draft_vocab} tokens, the served model's "
                             f"{vocab_size}; a draft must share the tokenizer", param="draft_model")  # fmt: skip
    # a sliding window's rotating cache can be cut back only until it wraps: full attention's caches only
    if not all(type(cache) is KVCache for cache in make_prompt_cache(draft)):
        raise InvalidRequest(f"draft model {path}: its caches cannot be cut back after a rejected draft (sliding "
                             "windows); pick a draft with full attention", param="draft_model")  # fmt: skip
