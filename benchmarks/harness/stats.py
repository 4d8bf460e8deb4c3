"""Per-slot metrics and the promotion gate: a difference counts only beyond max(2%, 2x measured noise);
noise above 5% makes the metric inconclusive."""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.harness.client import RequestResult
from tracing.analysis import percentile

MIN_GATE = 0.02
NOISE_LIMIT = 0.05

# name -> what it measures; every metric here is "lower is better"
METRICS = {
    "ttft_stream_p50_ms": "TTFT of the streaming requests (p50)",
    "ttft_long_ms": "TTFT of the long prefill",
    "ttft_interactive_p50_ms": "TTFT of short interactive requests (p50)",
    "ttft_interactive_max_ms": "TTFT of short interactive requests (max)",
    "stream_gap_p95_ms": "chunk gaps of the streams (p95)",
    "stream_gap_max_ms": "chunk gaps of the streams (max)",
    "ms_per_output_token": "total workload time per output token",
    "ttft_followup_p50_ms": "TTFT of prefix-continuation follow-ups (p50)",
    "peak_rss_mb": "peak server memory (RSS)",
}


def ms(values: list[float]) -> list[float]:
    return [v * 1000 for v in values]


def contended_metrics(results: list[RequestResult], wall_s: float) -> dict[str, float]:
    def role(name: str) -> list[RequestResult]:
        return [r for r in results if r.role == name]

    def ttfts(group: list[RequestResult]) -> list[float]:
        return ms([r.ttft_s for r in group if r.ttft_s is not None])

    stream_gaps = ms([gap for r in role("stream") for gap in r.gaps_s])
    output_tokens = sum(r.completion_tokens or len(r.chunk_times) for r in results)
    interactive = ttfts(role("interactive"))
    return {
        "ttft_stream_p50_ms": percentile(ttfts(role("stream")), 50),
        "ttft_long_ms": percentile(ttfts(role("long")), 50),
        "ttft_interactive_p50_ms": percentile(interactive, 50),
        "ttft_interactive_max_ms": max(interactive, default=math.nan),
        "stream_gap_p95_ms": percentile(stream_gaps, 95),
        "stream_gap_max_ms": max(stream_gaps, default=math.nan),
        "ms_per_output_token": wall_s * 1000 / output_tokens if output_tokens else math.nan,
    }


def prefix_metrics(results: list[RequestResult]) -> dict[str, float]:
    followups = ms([r.ttft_s for r in results if r.role == "followup" and r.ttft_s is not None])
    return {"ttft_followup_p50_ms": percentile(followups, 50)}


def relative_noise(pairs: list[tuple[float, float]]) -> float:
    """Mean relative disagreement between an arm's two measurements in each ABBA round."""
    spreads = [abs(a - b) / ((a + b) / 2) for a, b in pairs if (a + b) > 0 and not math.isnan(a + b)]
    return sum(spreads) / len(spreads) if spreads else math.nan


@dataclass(frozen=True, slots=True)
class Verdict:
    metric: str
    baseline: float  # arm A mean
    candidate: float  # arm B mean
    delta: float  # (B - A) / A; negative means B is lower (better)
    noise: float
    gate: float
    verdict: str  # better | worse | same | inconclusive
    rounds_lower: int = 0  # rounds in which B's mean was below A's (direction, whatever the gate says)
    rounds: int = 0


def verdict(metric: str, a_pairs: list[tuple[float, float]], b_pairs: list[tuple[float, float]]) -> Verdict:
    a_values = [v for pair in a_pairs for v in pair]
    b_values = [v for pair in b_pairs for v in pair]
    a_mean, b_mean = sum(a_values) / len(a_values), sum(b_values) / len(b_values)
    noise = max(relative_noise(a_pairs), relative_noise(b_pairs))
    gate = max(MIN_GATE, 2 * noise) if not math.isnan(noise) else math.nan
    delta = (b_mean - a_mean) / a_mean if a_mean else math.nan
    if math.isnan(noise) or math.isnan(delta) or noise > NOISE_LIMIT:
        outcome = "inconclusive"
    elif delta < -gate:
        outcome = "better"
    elif delta > gate:
        outcome = "worse"
    else:
        outcome = "same"
    lower = sum(1 for a, b in zip(a_pairs, b_pairs, strict=False) if sum(b) < sum(a))
    return Verdict(metric, a_mean, b_mean, delta, noise, gate, outcome, lower, min(len(a_pairs), len(b_pairs)))
