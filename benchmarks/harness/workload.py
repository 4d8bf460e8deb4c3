"""The measured workloads, as lists of request specs with exact prompts and arrival triggers.

`contended`: N streaming requests; a long prefill arrives once every stream has received some chunks; short
interactive requests arrive as the streams advance further. Arrivals follow stream progress, not wall time, so
both arms see the same interleaving whatever their speed. `prefix_reuse`: a primer, then follow-ups that share
its prefix on purpose (their cached tokens are expected, and checked to be non-zero).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.harness.prompts import PromptBuilder


@dataclass(frozen=True, slots=True)
class ContendedWorkload:
    streams: int = 4
    stream_prompt: int = 256
    stream_tokens: int = 128
    long_prompt: int = 2048
    long_tokens: int = 16
    long_after_chunks: int = 8  # the long prefill arrives when every stream has this many chunks
    interactive: int = 3
    interactive_prompt: int = 64
    interactive_tokens: int = 16
    interactive_every_chunks: int = 8  # one more interactive request each time the streams advance this much


@dataclass(frozen=True, slots=True)
class PrefixReuseWorkload:
    prefix: int = 1024
    suffix: int = 32
    followups: int = 3
    tokens: int = 16


@dataclass(frozen=True, slots=True)
class RequestSpec:
    name: str
    role: str  # stream | long | interactive | warmup | primer | followup
    prompt: str
    prompt_tokens: int
    max_tokens: int
    cache_salt: str
    after_chunks: int = 0  # start once every stream has received this many chunks (0: at once)
    expect_cached: bool = False


class RequestFactory:
    """Builds the requests one server process sees, each opening with its own first token.

    `key` names the ABBA pair (round, pair): both arms of a pair get identical prompts, so their outputs can be
    compared; every pair and every request gets fresh openers and salts, so nothing is cached by accident.
    """

    def __init__(self, builder: PromptBuilder, key: str, opener_offset: int = 0) -> None:
        self.builder = builder
        self.key = key
        self.rng = random.Random(key)
        self.next_opener = opener_offset

    def spec(self, name: str, role: str, tokens: int, max_tokens: int, after_chunks: int = 0,
             prefix: str = "", salt: str | None = None, expect_cached: bool = False) -> RequestSpec:
        if prefix:
            body = self.builder.text(tokens, rng=self.rng)
            prompt, count = prefix + body, None
        else:
            prompt = self.builder.text(tokens, opener=self.builder.opener(self.next_opener), rng=self.rng)
            self.next_opener += 1
            count = tokens
        if count is None:
            count = len(self.builder.encode(prompt))
        return RequestSpec(name, role, prompt, count, max_tokens, salt or f"{self.key}/{name}", after_chunks,
                           expect_cached)


def warmup_requests(factory: RequestFactory, long_prompt: int) -> list[RequestSpec]:
    """The same warm-up for every arm: a short request, then one at the long prompt's size."""
    return [factory.spec("warmup-short", "warmup", 32, 4), factory.spec("warmup-long", "warmup", long_prompt, 2)]


def contended_requests(factory: RequestFactory, w: ContendedWorkload) -> list[RequestSpec]:
    specs = [factory.spec(f"stream-{i}", "stream", w.stream_prompt, w.stream_tokens) for i in range(w.streams)]
    specs.append(factory.spec("long", "long", w.long_prompt, w.long_tokens, after_chunks=w.long_after_chunks))
    for i in range(w.interactive):
        after = w.long_after_chunks + (i + 1) * w.interactive_every_chunks
        specs.append(factory.spec(f"interactive-{i}", "interactive", w.interactive_prompt, w.interactive_tokens,
                                  after_chunks=after))
    return specs


def prefix_reuse_requests(factory: RequestFactory, w: PrefixReuseWorkload) -> list[RequestSpec]:
    """Run in order: the primer fills the cache, each follow-up continues its prefix under the same salt."""
    salt = f"{factory.key}/prefix"
    primer = factory.spec("primer", "primer", w.prefix, w.tokens, salt=salt)
    followups = [
        factory.spec(f"followup-{i}", "followup", w.suffix, w.tokens, prefix=primer.prompt, salt=salt,
                     expect_cached=True)
        for i in range(w.followups)
    ]
    return [primer, *followups]
