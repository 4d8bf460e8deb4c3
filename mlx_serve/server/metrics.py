"""Prometheus metrics: histograms fed by the engine's observer calls, and gauges/counters read from
`engine.stats()` at scrape time. Everything lives in this object's own registry (no process globals)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "mlx_serve"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ROW_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)

# engine.stats() key -> (metric name, help); gauges are current values, counters only grow
STAT_GAUGES = {
    "queue_depth": ("queue_depth", "Requests waiting for admission"),
    "running": ("running_requests", "Requests holding KV (prefilling or decoding)"),
    "kv_blocks_total": ("kv_blocks_capacity", "KV blocks in the pool"),
    "kv_blocks_used": ("kv_blocks_used", "KV blocks referenced by running requests"),
    "kv_blocks_cached": ("kv_blocks_cached", "Unreferenced KV blocks kept for prefix reuse"),
    "window_blocks_total": ("window_blocks_capacity", "Blocks of the sliding-window layers' window space"),
    "window_blocks_used": ("window_blocks_used", "Window-space blocks referenced by running requests"),
    "window_blocks_cached": ("window_blocks_cached", "Unreferenced window-space blocks kept for prefix reuse"),
    "compiled_shapes": ("compiled_shapes", "Step shapes replayed from a compiled trace (decode and mixed steps)"),
    "compiled_shapes_waiting": ("compiled_shapes_waiting",
                                "Mixed step shapes met but not traced yet (their steps run eager until the engine is quiet)"),
    "adapter_bytes": ("adapter_bytes", "Bytes the LoRA adapters' stacked matrices hold"),
    "adapter_limit_bytes": ("adapter_limit_bytes", "Bytes the adapters' matrices may grow to (--adapter-memory-gb)"),
    "draft_tokens_held": ("draft_cache_tokens", "Tokens the draft model's caches hold"),
    "draft_tokens_limit": ("draft_cache_tokens_limit", "Tokens the draft model's caches may hold (--draft-kv-tokens)"),
    "recurrent_slots_total": ("recurrent_state_slots", "Request state slots of the recurrent layers (max_running)"),
    "recurrent_slots_used": ("recurrent_state_slots_used", "Recurrent state slots held by running requests"),
    "recurrent_snapshots_kept": ("recurrent_state_snapshots", "Snapshots of requests' states kept for prefix hits"),
}
STAT_COUNTERS = {
    "prefix_hit_tokens_total": ("prefix_hit_tokens", "Prompt tokens served from the prefix cache"),
    "prefix_hashes_recalled_total": ("prefix_hashes_recalled",
                                     "Block hashes prompts copied from a finished request's chain instead of hashing"),
    "shared_prefill_waits_total": ("shared_prefill_waits",
                                   "Admissions put off a step while a running prefill computed the prompt's next blocks"),
    "prompt_tokens_total": ("prompt_tokens", "Prompt tokens computed by prefill (prefix-cache hits excluded)"),
    "generation_tokens_total": ("generation_tokens", "Tokens generated"),
    "steps_total": ("steps", "Engine steps run"),
    "budget_halvings_total": ("budget_halvings", "Row-budget halvings in contended steps"),
    "traces_wanted_total": ("traces_wanted",
                            "Contended steps cut smaller only because their larger shape had no compiled trace yet"),
    "preemptions_total": ("preemptions", "Requests preempted by recomputation"),
    "draft_tokens_total": ("draft_tokens", "Drafted tokens verified by speculative decoding"),
    "accepted_draft_tokens_total": ("accepted_draft_tokens", "Drafted tokens the model agreed with (kept)"),
}


class EngineStatsCollector(Collector):
    """Reads the engine's counters when Prometheus scrapes, so nothing is copied on the hot path."""

    def __init__(self, read_stats: Callable[[], dict[str, Any]]) -> None:
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.read_stats()
        for key, (name, doc) in STAT_GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=stats[key])
        for key, (name, doc) in STAT_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=stats[key])
        # the engine counts computed prefill rows, so the prompt tokens seen are hits plus computed rows
        hits = stats.get("prefix_hit_tokens_total", 0)
        seen = hits + stats.get("prompt_tokens_total", 0)
        hit_rate = hits / seen if seen else 0.0
        yield GaugeMetricFamily(f"{PREFIX}_prefix_hit_rate", "Share of prompt tokens served from the prefix cache",
                                value=hit_rate)


class ServerMetrics:
    """The engine observer (on_step, on_first_token, on_token_gap, on_finish) plus the registry /metrics serves.

    Observer methods run on the engine thread: each is one or two prometheus updates (thread-safe, cheap).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.token_gap = Histogram(f"{PREFIX}_inter_token_seconds", "Time between a stream's tokens",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram(f"{PREFIX}_step_seconds", "Engine step wall time",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.step_rows = Histogram(f"{PREFIX}_step_rows", "Rows (tokens) per engine step", buckets=ROW_BUCKETS,
                                   registry=r)
        self.prefill_rows = Counter(f"{PREFIX}_prefill_rows", "Prefill rows run", registry=r)
        self.decode_rows = Counter(f"{PREFIX}_decode_rows", "Decode rows run", registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Finished requests by reason", ["reason"],
                                registry=r)
        self.http_errors = Counter(f"{PREFIX}_http_errors", "Requests refused or failed, by status", ["status"],
                                   registry=r)
        self._stats: EngineStatsCollector | None = None

    def watch(self, read_stats: Callable[[], dict[str, Any]]) -> None:
        """Serve `read_stats()` (normally `engine.stats`) at every scrape."""
        if self._stats is not None:
            self.registry.unregister(self._stats)
        self._stats = EngineStatsCollector(read_stats)
        self.registry.register(self._stats)

    def on_step(self, elapsed_ms: float, rows: int, prefill_rows: int, decode_lanes: int,
                budget_halvings: int) -> None:
        self.step_time.observe(elapsed_ms / 1000.0)
        self.step_rows.observe(rows)
        self.prefill_rows.inc(prefill_rows)
        self.decode_rows.inc(decode_lanes)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_token_gap(self, gap_s: float) -> None:
        self.token_gap.observe(gap_s)

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.finished.labels(reason=reason).inc()

    def on_http_error(self, status: int) -> None:
        self.http_errors.labels(status=str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
