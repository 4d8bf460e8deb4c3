"""Named benchmark workloads for `python -m mlx_serve bench`: each drives a loaded `Engine` and returns figures.

Timings are taken on the client side (`time.perf_counter` when each event arrives), the way a caller of the
engine sees them; engine counters and the trace only explain where the time went.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_serve.errors import MlxServeError
from mlx_serve.types import GenerationRequest


class WorkloadFailed(MlxServeError):
    """A benchmark request ended in an error, so its figures would mean nothing."""


@dataclass(frozen=True, slots=True)
class WorkloadParams:
    """Knobs shared by the workloads; each workload reads the ones it needs."""

    requests: int = 32
    prompt_len: int = 128
    max_tokens: int = 64
    long_prompt: int = 2048
    streams: int = 4


# per-workload defaults: sizes that show the effect on the built-in tiny model in seconds
DEFAULTS: dict[str, WorkloadParams] = {
    "offline": WorkloadParams(requests=32, prompt_len=128, max_tokens=64),
    "contended": WorkloadParams(prompt_len=64, max_tokens=16, long_prompt=2048, streams=4),
    "prefix": WorkloadParams(prompt_len=1024, max_tokens=2),
}


@dataclass(frozen=True, slots=True)
class OfflineFigures:
    requests: int
    generated_tokens: int
    total_s: float
    generated_tok_per_s: float
    steps: int
    decode_step_ms_p50: float | None
    host_ms_per_step: float | None  # planning + preparation + application, from the trace


@dataclass(frozen=True, slots=True)
class ContendedFigures:
    streams: int
    long_prompt_tokens: int
    gap_p50_ms: float
    gap_p95_ms: float
    gap_max_ms: float
    long_ttft_s: float
    solo_ttft_s: float
    ttft_ratio: float  # contended / solo
    contended_prefill_rows: int
    prefill_beside_decoding: bool


@dataclass(frozen=True, slots=True)
class PrefixFigures:
    prefix_tokens: int
    cold_ttft_s: float
    cold_cached_tokens: int
    warm_ttft_s: float
    warm_cached_tokens: int
    ttft_ratio: float  # warm / cold


@dataclass(slots=True)
class StreamRecord:
    """What one client saw of one request: when it was submitted and when each token arrived."""

    submitted: float
    arrivals: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.submitted

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def prompt_ids(index: int, length: int, vocab: int) -> tuple[int, ...]:
    """Deterministic ordinary tokens (ids 10..vocab-10); the first token is unique per `index` so that no two
    requests share a cached prefix by accident."""
    span = vocab - 20
    body = [10 + (index * 7919 + j * 104729) % span for j in range(1, length)]
    return (10 + index % span, *body)


def read_stream(handle: Any, record: StreamRecord, ready_after: int = 0, ready: threading.Event | None = None) -> None:
    """Iterate a handle (submitted outside an event loop) to its end, stamping each token's arrival.
    `ready` is set after `ready_after` tokens, or at the end, so a waiter never hangs on a stream that failed."""
    try:
        for event in handle:
            if event.token_id is not None:
                record.arrivals.append(time.perf_counter())
                if ready is not None and len(record.arrivals) == ready_after:
                    ready.set()
            if event.finish_reason is not None:
                record.finish_reason, record.error = event.finish_reason, event.error
                record.cached_tokens = event.usage.cached_tokens if event.usage else 0
    finally:
        if ready is not None:
            ready.set()


def timed(engine: Any, request: GenerationRequest) -> StreamRecord:
    """Submit one request and read it to the end in this thread."""
    record = StreamRecord(time.perf_counter())
    read_stream(engine.submit(request), record)
    _check(record)
    return record


def _check(record: StreamRecord) -> None:
    if record.error or record.finish_reason == "error" or not record.arrivals:
        raise WorkloadFailed(f"a benchmark request failed: {record.error or record.finish_reason}")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _warm_up(engine: Any, prompt_len: int = 16) -> None:
    """One short request first: the first step pays one-off allocation and compilation costs."""
    prompt = prompt_ids(engine.vocab_size - 21, prompt_len, engine.vocab_size)
    timed(engine, GenerationRequest(prompt, max_tokens=2, ignore_eos=True, cache_salt="bench-warm-up"))


# offline --------------------------------------------------------------------------------------------------
def offline(engine: Any, params: WorkloadParams) -> OfflineFigures:
    """N greedy requests submitted at once, EOS ignored so each generates exactly max_tokens."""
    _warm_up(engine)
    vocab = engine.vocab_size
    requests = [
        GenerationRequest(prompt_ids(i, params.prompt_len, vocab), params.max_tokens, ignore_eos=True,
                          cache_salt=f"bench-offline-{i}")
        for i in range(params.requests)
    ]
    events = getattr(engine.trace, "events", None)  # a MemorySink's list; None when tracing is off
    first_event = len(events) if events is not None else 0
    t0 = time.perf_counter()
    completions = engine.generate(requests)
    total = time.perf_counter() - t0
    failed = [c for c in completions if c.error or c.finish_reason == "error"]
    if failed:
        raise WorkloadFailed(f"{len(failed)} offline requests failed: {failed[0].error}")
    tokens = sum(len(c.token_ids) for c in completions)
    steps, decode_p50, host = _step_figures(events[first_event:] if events is not None else None)
    return OfflineFigures(params.requests, tokens, total, tokens / total, steps, decode_p50, host)


def _step_figures(events: list | None) -> tuple[int, float | None, float | None]:
    """Steps, median decode-only step time and host ms per step, from a slice of trace events."""
    if events is None:
        return 0, None, None
    steps = [e for e in events if type(e).__name__ == "StepExecuted"]
    spans = [e for e in events if type(e).__name__ == "Span" and e.step_id is not None]
    host_s = sum(s.end - s.start for s in spans if s.name in ("planning", "preparation", "application"))
    decode = [s.measured_ms for s in steps if s.prefill_rows == 0]
    return len(steps), statistics.median(decode) if decode else None, 1e3 * host_s / max(len(steps), 1)


# contended ------------------------------------------------------------------------------------------------
def contended(engine: Any, params: WorkloadParams) -> ContendedFigures:
    """S streams decode; a long prompt arrives mid-stream. Its TTFT is compared with its TTFT alone, and the
    streams' inter-token gaps show what the prefill cost them."""
    _warm_up(engine)
    vocab, first_long = engine.vocab_size, params.streams + 1
    long_prompt = prompt_ids(first_long, params.long_prompt, vocab)

    def long_request(salt: str) -> GenerationRequest:
        return GenerationRequest(long_prompt, params.max_tokens, ignore_eos=True, cache_salt=salt)

    timed(engine, long_request("bench-long-warm"))  # the long shape's first run pays its allocations
    solo = timed(engine, long_request("bench-long-solo"))
    records, threads, handles = _start_streams(engine, params)
    try:
        long = timed(engine, long_request("bench-long-contended"))
    finally:
        for handle in handles:  # streams decode until the long request is done, then stop
            handle.cancel()
        for thread in threads:
            thread.join()
    gaps = [1e3 * g for r in records for g in r.gaps_s()]
    if not gaps:
        raise WorkloadFailed("the decoding streams produced fewer than two tokens each")
    rows = engine.status()["counters"]["contended_prefill_rows"]
    return ContendedFigures(
        params.streams, params.long_prompt, statistics.median(gaps), _percentile(gaps, 0.95), max(gaps),
        long.ttft_s, solo.ttft_s, long.ttft_s / solo.ttft_s, rows, rows > 0,
    )


def _start_streams(engine: Any, params: WorkloadParams) -> tuple[list[StreamRecord], list[threading.Thread], list]:
    """Submit the decoding streams, each read by its own thread, and return once each has a few tokens."""
    room = min(engine.context_length, engine.pool.num_blocks * engine.pool.block_size) - params.prompt_len - 1
    records, threads, handles, readiness = [], [], [], []
    for i in range(params.streams):
        request = GenerationRequest(prompt_ids(i + 1, params.prompt_len, engine.vocab_size), room, ignore_eos=True,
                                    cache_salt=f"bench-stream-{i}")
        records.append(StreamRecord(time.perf_counter()))
        handles.append(engine.submit(request))
        readiness.append(threading.Event())
        threads.append(threading.Thread(target=read_stream, args=(handles[-1], records[-1], 4, readiness[-1]),
                                        daemon=True))
        threads[-1].start()
    for ready, record in zip(readiness, records):
        ready.wait()
        _check(record)
    return records, threads, handles


# prefix ---------------------------------------------------------------------------------------------------
def prefix(engine: Any, params: WorkloadParams) -> PrefixFigures:
    """A shared prefix: the first request computes it (cold), a continuation of it reuses its KV blocks (warm)."""
    _warm_up(engine)
    shared = prompt_ids(0, params.prompt_len, engine.vocab_size)

    def continuation(k: int) -> GenerationRequest:
        suffix = tuple(10 + (k * 31 + j) % (engine.vocab_size - 20) for j in range(8))
        return GenerationRequest(shared + suffix, params.max_tokens, ignore_eos=True, cache_salt="bench-prefix")

    cold = timed(engine, continuation(0))
    warm = [timed(engine, continuation(k)) for k in (1, 2, 3)]
    warm_ttft = statistics.median(r.ttft_s for r in warm)
    return PrefixFigures(
        params.prompt_len, cold.ttft_s, cold.cached_tokens, warm_ttft, warm[0].cached_tokens, warm_ttft / cold.ttft_s
    )


WORKLOADS: dict[str, Callable[[Any, WorkloadParams], Any]] = {
    "offline": offline,
    "contended": contended,
    "prefix": prefix,
}
