"""The workloads both engines run, and the arithmetic both are measured with."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, slots=True)
class BenchParams:
    stream_counts: tuple[int, ...] = (1, 8, 32, 64)
    decode_prompt: int = 1024  # history of every decoding stream (ARCHITECTURE.md's 8B point: 32 x 1k)
    decode_tokens: int = 64
    prefill_lengths: tuple[int, ...] = (2048, 8192)
    contended_streams: int = 8
    contended_prompt: int = 512
    contended_long: int = 16384
    tokens_before: int = 16  # tokens every stream has before the long prompt arrives
    tokens_after: int = 16  # tokens every stream gets after the long prompt's first token
    prefix_len: int = 8192
    suffix_len: int = 32


FULL = BenchParams()
QUICK = replace(FULL, decode_tokens=32)
TINY = BenchParams(  # the script's own check on a CPU with the tiny shapes
    stream_counts=(1, 4),
    decode_prompt=64,
    decode_tokens=8,
    prefill_lengths=(128, 256),
    contended_streams=2,
    contended_prompt=32,
    contended_long=512,
    tokens_before=4,
    tokens_after=4,
    prefix_len=256,
    suffix_len=8,
)


class Prompts:
    """Random token ids, distinct for every prompt so no two requests share a prefix by accident."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.high = vocab_size - 64  # the dummy tokenizer's special tokens sit at the end of the vocabulary

    def one(self, length: int) -> list[int]:
        return self.rng.integers(16, self.high, size=length).tolist()

    def many(self, count: int, length: int) -> list[list[int]]:
        return [self.one(length) for _ in range(count)]


WARM_STEPS = 3  # steps dropped at the start of a window: first uses of a shape are JIT-compiled


def steady_rate(times: list[float], counts: list[int], width: int) -> dict:
    """Tokens/s over the steps where all `width` streams decoded: tokens after the first such step / its span."""
    steps = [(t, c) for t, c in zip(times, counts) if c == width]
    if len(steps) >= 3 * WARM_STEPS:
        steps = steps[WARM_STEPS:]
    if len(steps) < 3:
        return {"tok_s": None, "step_ms": None, "steps": len(steps)}
    span = steps[-1][0] - steps[0][0]
    tokens = sum(c for _, c in steps[1:])
    return {"tok_s": tokens / span, "step_ms": 1e3 * span / (len(steps) - 1), "steps": len(steps)}


def gap_summary(gaps: list[float], before: list[float], after: list[float] | None = None) -> dict:
    """Inter-token gaps of the decoding streams: the whole window (from each stream's first token), their
    uncontended median before arrival, and the longest gap before and from the long prompt's arrival (`after`: the
    gaps that end after it), which says whether the window's longest gap is the arrival's or the streams' own start."""
    if not gaps:
        return {"gap_p50_ms": None, "gap_max_ms": None, "gap_ratio": None}
    p50, top = statistics.median(gaps), max(gaps)
    calm = statistics.median(before) if before else None
    return {
        "gap_p50_ms": 1e3 * p50,
        "gap_max_ms": 1e3 * top,
        "gap_ratio": top / p50,
        "calm_p50_ms": 1e3 * calm if calm else None,
        "gap_ratio_vs_calm": top / calm if calm else None,
        "gap_max_before_ms": 1e3 * max(before) if before else None,
        "gap_max_from_arrival_ms": 1e3 * max(after) if after else None,
        "gaps": len(gaps),
    }
