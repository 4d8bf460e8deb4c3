"""Prompt-lookup drafts for speculative decoding: the tokens that followed the latest earlier occurrence of a
request's last few tokens (in its prompt or its own output). A decode lane carries them as extra rows; one
forward pass verifies them all, and the engine keeps the longest prefix the model agrees with (greedy), plus the
model's own next token. Code edits, summaries and quoting repeat the prompt: several tokens a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scheduler.request import Request

BACKLOG_PER_CALL = 4096  # prompt positions indexed a step (~4 ms of Python; a 32k prompt is indexed in 8 steps)
MOST_MISSES = 2  # rests stop growing at 2 ** 2 - 1 steps (a verified row is cheap on a GPU)


class DraftSource(Protocol):
    """Where a request's drafts come from: prompt lookup (`PromptLookup`, the default) or a draft model the engine
    supplies (`mlx_serve.draft_model`). Asked on the engine thread while a step is planned."""

    def propose(self, request: Request, most: int) -> tuple[int, ...]: ...

    def observe(self, request: Request, accepted: int) -> None: ...


@dataclass(slots=True)
class PromptLookup:
    """Drafts by prompt lookup: each request keeps its own `NgramIndex` (on `Request.ngrams`)."""

    longest: int

    def propose(self, request: Request, most: int) -> tuple[int, ...]:
        if request.ngrams is None:
            request.ngrams = NgramIndex(min(2, self.longest), self.longest)
        return request.ngrams.propose(request, most)

    def observe(self, request: Request, accepted: int) -> None:
        if request.ngrams is not None:
            request.ngrams.observe(accepted)


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram (`shortest` to `longest` tokens) of a request's tokens last occurred with a token after it.
    Tokens appended since the last call are indexed at once (they are the latest occurrences); the tokens before the
    first call (the prompt) are indexed newest first, at most `backlog` positions a call, so that a long prompt's
    index never holds one step (and every stream in it) for tens of milliseconds."""

    shortest: int
    longest: int
    backlog: int = BACKLOG_PER_CALL
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position of the token after it
    low: int = -1  # positions [low, high) have their n-grams (those ending there) indexed; -1: no call yet
    high: int = 0
    misses: int = 0  # drafts rejected whole in a row
    resting: int = 0  # steps to go without drafting

    def propose(self, request: Request, most: int) -> tuple[int, ...]:
        """Up to `most` tokens that followed the latest earlier occurrence of the request's longest matching tail."""
        total = request.num_tokens
        if self.resting > 0:
            self.resting -= 1
            return ()
        if most <= 0 or total < self.shortest + 1:
            return ()
        self._index(request, total)
        for n in range(min(self.longest, total), self.shortest - 1, -1):
            after = self.ends.get(request.tokens(total - n, total))
            if after is not None:
                return request.tokens(after, min(after + most, total))
        return ()

    def observe(self, accepted: int) -> None:
        """A verified draft's outcome: after each draft rejected whole, rest 1, then 3 steps (a verified row
        costs compute, and a request whose answer does not repeat its input wastes it); any accepted draft resets."""
        self.misses = 0 if accepted else self.misses + 1
        self.resting = (1 << min(self.misses, MOST_MISSES)) - 1

    def _index(self, request: Request, total: int) -> None:
        """Index the n-grams ending at each position whose next token is known (not the tail itself): the new ones
        overwriting (they are later), then some of the backlog, which never overwrites (it is earlier)."""
        if self.low < 0:
            self.low = self.high = total
        self._add(request, range(self.high, total), overwrite=True)
        self.high = total
        stop = max(self.shortest, self.low - self.backlog)
        self._add(request, range(self.low - 1, stop - 1, -1), overwrite=False)
        self.low = min(self.low, stop)

    def _add(self, request: Request, ends: range, overwrite: bool) -> None:
        if not ends:
            return
        first, last = min(ends[0], ends[-1]), max(ends[0], ends[-1])
        offset = max(0, first - self.longest)
        window = request.tokens(offset, last)
        for end in ends:
            for n in range(self.shortest, min(self.longest, end) + 1):
                key = window[end - n - offset : end - offset]
                if overwrite:
                    self.ends[key] = end
                else:
                    self.ends.setdefault(key, end)
