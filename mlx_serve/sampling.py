"""Per-request sampling inside a batched step.

Every sampling row has its own parameters. Greedy rows without logits processors are decided by one argmax;
the others go through mlx-lm's own logits processors, a grammar's mask (`grammar`), and filters (top-p, min-p,
top-k) one row at a time.
A seeded request draws from its own key chain, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlx_serve.types import SamplingParams


@dataclass(slots=True)
class RequestSampler:
    """A request's sampling state across steps."""

    params: SamplingParams
    processors: list = field(default_factory=list)
    key: mx.array | None = None
    history: mx.array | None = None  # the last `penalty_context` input tokens, kept on the device
    constraint: Any = None  # a grammar.Constraint (response_format): masks each sample, needs each token read

    @classmethod
    def create(cls, params: SamplingParams, constraint: Any = None, stop_ids: Iterable[int] = ()) -> RequestSampler:
        """`stop_ids`: the tokens that would end the request, held back for its first `params.min_tokens`."""
        processors = make_logits_processors(
            logit_bias=dict(params.logit_bias) if params.logit_bias else None,
            repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
            repetition_context_size=params.penalty_context,
            presence_penalty=params.presence_penalty or None,
            presence_context_size=params.penalty_context,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=params.penalty_context,
        )
        if params.min_tokens and stop_ids:
            processors.append(HoldStops(tuple(stop_ids), params.min_tokens))
        if params.bad_words:
            processors.append(BanWords(params.bad_words))
        # mx.random.key takes 0 .. 2**64 - 1; OpenAI's seeds are signed, and choice i of n takes seed + i
        key = mx.random.key(params.seed % 2**64) if params.seed is not None else None
        return cls(params=params, processors=processors, key=key, constraint=constraint)

    def observe(self, start: int, inputs: mx.array) -> None:
        """Track the tokens that pass through the model (lazily: a pending decode token is not known yet).

        A lane starting at position 0 is a (re)computation from scratch.
        """
        if not self.processors:
            return
        if start == 0 or self.history is None:
            self.history = inputs
        else:
            self.history = mx.concatenate([self.history, inputs])
        # a bad word's tokens before its last are matched against the newest inputs, however long the word
        context = max([self.params.penalty_context, *(len(word) - 1 for word in self.params.bad_words)])
        self.history = self.history[-context:]

    @property
    def is_plain_greedy(self) -> bool:
        return self.params.greedy and not self.processors and self.constraint is None

    @property
    def shapes_logits(self) -> bool:
        """Whether this row's logits change before the draw (processors or a grammar)."""
        return bool(self.processors) or self.constraint is not None

    def next_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub


@dataclass(slots=True)
class HoldStops:
    """A logits processor (mlx-lm's signature) that forbids the stop tokens for the request's first `left` samples
    (vLLM's `min_tokens`); it counts the samples it takes part in, one a token."""

    stop_ids: tuple[int, ...]
    left: int

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.left <= 0:
            return logits
        self.left -= 1
        return logits.at[..., mx.array(self.stop_ids)].add(-mx.inf)


@dataclass(slots=True)
class BanWords:
    """A logits processor (mlx-lm's signature) for vLLM's `bad_words`: a one-token word is always masked, a longer
    one's last token where the tokens generated just before are the rest of it (matched on the device, against the
    request's newest inputs: only once that many tokens were generated, so a prompt's tail never counts)."""

    words: tuple[tuple[int, ...], ...]
    generated: int = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        always = [word[0] for word in self.words if len(word) == 1]
        if always:
            logits = logits.at[..., mx.array(always)].add(-mx.inf)
        for word in self.words:
            prefix = word[:-1]
            if not prefix or len(prefix) > self.generated:
                continue
            follows = mx.all(tokens[-len(prefix) :] == mx.array(prefix))
            logits = logits.at[..., word[-1]].add(mx.where(follows, -mx.inf, 0.0))
        self.generated += 1
        return logits


@dataclass(frozen=True, slots=True)
class SampledRows:
    tokens: mx.array  # [S] int32
    logprobs: mx.array  # [S, V] log-probabilities after processors (what the token was drawn from)


def _process(sampler: RequestSampler, logits: mx.array) -> mx.array:
    if sampler.processors:
        tokens = sampler.history if sampler.history is not None else mx.array([], dtype=mx.int32)
        for processor in sampler.processors:
            logits = processor(tokens, logits)
    if sampler.constraint is not None:  # last, so that no processor lifts a token the grammar forbids
        logits = logits + mx.array(sampler.constraint.mask()).astype(logits.dtype)
    return logits


def _draw(sampler: RequestSampler, logprobs: mx.array) -> mx.array:
    params = sampler.params
    if params.greedy:
        return mx.argmax(logprobs, axis=-1)
    return mx.random.categorical(_target(params, logprobs), key=sampler.next_key())


def _target(params: SamplingParams, logprobs: mx.array) -> mx.array:
    """The (unnormalised) log-weights a sampled request draws from: top-p, min-p and top-k, then the temperature."""
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temperature)


def draft_verdict(sampler: RequestSampler, logprobs: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Speculative sampling of one lane's drafted rows `[D, V]` (log-probabilities), row j checking `drafts[j]`:
    whether each draft is kept, and the token that replaces it where it is not. Greedy: kept where it is the argmax,
    replaced by the argmax. Sampled (a draft is one token with certainty): kept with the target's probability of it,
    else replaced by a draw from the target without it, which leaves every emitted token distributed as the target
    (Leviathan et al.'s rule with a one-hot proposal)."""
    if sampler.params.greedy:
        best = mx.argmax(logprobs, axis=-1)
        return best == drafts, best
    target = _target(sampler.params, logprobs)
    target = target - mx.logsumexp(target, axis=-1, keepdims=True)
    chance = mx.exp(mx.take_along_axis(target, drafts[:, None], axis=-1)[:, 0])
    kept = mx.random.uniform(shape=chance.shape, key=sampler.next_key()) < chance
    without = mx.put_along_axis(target, drafts[:, None], mx.array(-mx.inf, target.dtype), axis=-1)
    return kept, mx.random.categorical(without, key=sampler.next_key())


def sample_rows(logits: mx.array, samplers: list[RequestSampler]) -> SampledRows:
    """Pick one token per row of `logits` `[S, V]`, row i with `samplers[i]`."""
    if any(s.shapes_logits for s in samplers):
        rows = [_process(s, logits[i : i + 1]) for i, s in enumerate(samplers)]
        logits = mx.concatenate(rows, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if all(s.is_plain_greedy for s in samplers):
        return SampledRows(mx.argmax(logprobs, axis=-1).astype(mx.int32), logprobs)
    tokens = [_draw(s, logprobs[i : i + 1]).reshape(1) for i, s in enumerate(samplers)]
    return SampledRows(mx.concatenate(tokens).astype(mx.int32), logprobs)


def top_logprobs(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k most likely token ids and their log-probabilities of each row of `[..., V]`, most likely first."""
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
