"""The engine's public data: what a caller submits and the events it gets back."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from mlx_serve.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. Defaults are greedy decoding."""

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # mlx-lm's: divides positive logits of recent tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_context: int = 20  # how many recent tokens the penalties look at (mlx-lm's default)
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the top k alternatives
    grammar: str | None = None  # an llguidance grammar every token must follow (`grammar`, from response_format)
    # None: none; k >= 0: each prompt token's log-probability given the tokens before it (raw, before any
    # processor), plus the top k alternatives (scoring a text, as `echo` with `logprobs` does)
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # no stop token (eos, stop_token_ids) or stop string ends the answer before this many tokens
    # vLLM's bad_words as token sequences: never generated (a word's last token is masked after the rest of it)
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def draftable(self) -> bool:
        """Whether speculative decoding may serve it: it draws from the raw logits (no bias, penalty, grammar or held
        stop tokens), so a drafted row's target is known when the row is (`sampling.draft_verdict`)."""
        return (not self.logit_bias and self.repetition_penalty == 1.0 and not self.presence_penalty
                and not self.frequency_penalty and self.grammar is None and not self.min_tokens
                and not self.bad_words)  # fmt: skip

    def validate(self, vocab_size: int) -> None:
        def bad(param: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{param} {why}", param=param)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be a non-negative integer, got {self.top_k!r}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 20):
                raise bad(name, f"must be an integer in [0, 20], got {value!r}")
        for word in self.bad_words:
            if not word or not all(isinstance(t, int) and 0 <= t < vocab_size for t in word):
                raise bad("bad_words", f"holds a word that is empty or has token ids outside the vocabulary: {word!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or not 0 <= token < vocab_size:
                raise bad("logit_bias", f"token id {token!r} is outside the vocabulary (0..{vocab_size - 1})")
            if not isinstance(bias, (int, float)) or not math.isfinite(bias) or not -100 <= bias <= 100:
                raise bad("logit_bias", f"bias for token {token} must be a number in [-100, 100], got {bias!r}")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A tokenized request. The server applies chat templates before it gets here."""

    prompt_ids: tuple[int, ...]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings: output ends before the first match
    stop_token_ids: tuple[int, ...] = ()  # added to the model's own eos ids
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the answer stays in its text
    priority: int = 1  # 0 high, 1 normal, 2 low
    cache_salt: str | None = None
    request_id: str | None = None
    adapter: str | None = None  # a LoRA adapter the engine serves (`EngineConfig.adapters`) by name; None: the base
    # "last" | "mean": an embedding request: its prompt's hidden states pooled into a unit vector (`TokenEvent.embedding`)
    pooling: str | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it (None for the first), with its top alternatives
    (None where not asked for, and for the first token)."""

    token_id: int
    logprob: float | None
    top_logprobs: tuple[TokenLogprob, ...] | None = None
    rank: int | None = None  # 1 + how many tokens were likelier (None for the first token)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One step of a request's stream. The last event has `finish_reason` (and `usage`) set.

    `text` is the newly decodable text (may be empty while a multi-byte character is incomplete, and holds
    back text that could still turn into a stop string).
    """

    request_id: str
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    usage: Usage | None = None
    error: str | None = None
    index: int = 0  # this token's index in the output
    # on the first token's event of a request that asked for them: one entry per prompt token, in order
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    embedding: tuple[float, ...] | None = None  # on the first token's event of an embedding request


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request, as the blocking `generate` returns it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: tuple[float, ...] | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    embedding: tuple[float, ...] | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    error: str | None = None
