"""mlx-lm, measured as it is used: BatchGenerator (what mlx_lm.server runs) and generate_step (batch 1)."""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from benchmarks.gpu.workloads import BenchParams, Prompts, gap_summary, steady_rate


def _generator(model: Any, batch: int, prefill_batch: int | None = None) -> Any:
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=prefill_batch or batch)


def decode(model: Any, prompts: Prompts, p: BenchParams, streams: int, prefill_batch: int | None = None) -> dict:
    """`prefill_batch`: prompts prefilled together (all `streams` unless given). The rate counts only steps where
    every stream decodes, yet it still moves with it: streams admitted 8 at a time start apart, and 30B-A3B's 64
    streams read 513 tok/s so against 581-589 all at once (H100, n30_6)."""
    gen = _generator(model, streams, prefill_batch)
    gen.insert(prompts.many(streams, p.decode_prompt), [p.decode_tokens] * streams)
    times, counts = [], []
    while responses := gen.next_generated():
        times.append(time.perf_counter())
        counts.append(len(responses))
    gen.close()
    return steady_rate(times, counts, streams)


def generate_step_decode(model: Any, prompts: Prompts, p: BenchParams) -> dict:
    from mlx_lm.generate import generate_step

    times = []
    prompt = mx.array(prompts.one(p.decode_prompt))
    for _, _ in zip(generate_step(prompt, model, max_tokens=p.decode_tokens), range(p.decode_tokens)):
        times.append(time.perf_counter())
    return steady_rate(times, [1] * len(times), 1)


def prefill(model: Any, prompts: Prompts, length: int) -> dict:
    """TTFT of one prompt alone; the second of two runs, so JIT compilation of new shapes stays out."""
    _prefill_once(model, prompts, length)
    return _prefill_once(model, prompts, length)


def _prefill_once(model: Any, prompts: Prompts, length: int) -> dict:
    gen = _generator(model, 1)
    prompt = prompts.one(length)
    t0 = time.perf_counter()
    gen.insert([prompt], [1])
    while not gen.next_generated():
        pass
    ttft = time.perf_counter() - t0
    gen.close()
    return {"ttft_s": ttft, "tok_s": length / ttft}


def contended(model: Any, prompts: Prompts, p: BenchParams) -> dict:
    """Streams decode; a long prompt arrives after `tokens_before` tokens; streams stop `tokens_after` later."""
    gen = _generator(model, p.contended_streams + 1)
    uids = gen.insert(prompts.many(p.contended_streams, p.contended_prompt), [100_000] * p.contended_streams)
    times: dict[int, list[float]] = {uid: [] for uid in uids}
    long_uid, arrival, first = None, None, None
    while True:
        responses = gen.next_generated()
        now = time.perf_counter()
        for r in responses:
            if r.uid == long_uid:
                first = first or now
            else:
                times[r.uid].append(now)
        if long_uid is None and min(len(t) for t in times.values()) >= p.tokens_before:
            arrival = time.perf_counter()
            long_uid = gen.insert([prompts.one(p.contended_long)], [1])[0]
            marks = {uid: len(t) for uid, t in times.items()}
        if first is not None and min(len(t) for t in times.values()) >= max(marks.values()) + p.tokens_after:
            break
    gen.remove(uids)
    gen.close()
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    before = [b - a for uid, t in times.items() for a, b in zip(t[: marks[uid]], t[1 : marks[uid]])]
    after = [b - a for t in times.values() for a, b in zip(t, t[1:]) if b > arrival]
    return {"long_ttft_s": first - arrival, **gap_summary(gaps, before, after)}
