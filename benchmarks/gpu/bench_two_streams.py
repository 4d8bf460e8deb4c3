"""Would a prefill chunk on a second MLX stream keep the decoding streams' tokens flowing?

    python -m benchmarks.gpu.bench_two_streams [--shape 0.6b --streams 8 --history 1024 --prompt 16384
        --chunk 2048 --every 1 2 4]

Today a contended step carries the decode rows and a prefill chunk in one forward, so the streams' next tokens wait
for the whole chunk (0.6B beside 8 streams: gaps up to ~20 ms against a 4-7 ms decode step, NOTES session 32). On
MLX's CUDA backend each MLX stream has its own CUDA stream, so a chunk queued on a second one may run beside the
decode steps. This measures what that buys before the engine changes, with mlx-lm's model and caches alone:

- `decode`: the streams' steps alone, one in flight, each step's tokens read after the next one is submitted (the
  engine's way);
- `prefill`: the prompt's chunks alone, back to back (its solo time);
- `serial` / `concurrent`, for each `--every K`: the decode loop submits one chunk after every K-th decode step, on
  the decode steps' stream (a chunk between two decode steps: what one stream does) or on a second stream.

Each mode reports the decode submissions' and chunks' host times, the streams' gaps (host read-backs) from the
first chunk on, the prompt's time from its first chunk's start to its last chunk's end (the device clock where
there is one), and whether the streams' tokens and the prompt's last hidden state equal those of the runs alone.
Prints one JSON object (milliseconds).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from benchmarks.gpu.workloads import FULL, Prompts, gap_summary

BEFORE = FULL.tokens_before  # decode steps before the first chunk: the calm gaps
WARM = 3  # first decode steps left out of the gaps: their shapes' first uses
TOKENS_AFTER = FULL.tokens_after  # gaps kept after the prompt's end, as the GPU bench's window keeps after its first token


@dataclass(frozen=True, slots=True)
class Workload:
    histories: mx.array  # [streams, history] token ids
    chunks: tuple[mx.array, ...]  # the long prompt's pieces, [1, chunk] each


@dataclass(slots=True)
class Timeline:
    """What one run saw: host times of the streams' read-backs, submissions, the prompt's device clock."""

    reads: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    decode_submit_ms: list[float] = field(default_factory=list)
    chunk_submit_ms: list[float] = field(default_factory=list)
    first_chunk_step: int | None = None
    prompt_ms: float | None = None
    prompt_end: float | None = None  # host clock (the device's, shifted) when its last chunk ended, if known
    last_hidden: mx.array | None = None


def next_tokens(model: Any, tokens: mx.array, cache: list) -> mx.array:
    """Greedy next tokens `[B, 1]` of a forward over `tokens` `[B, L]`, the head run on the last rows only."""
    h = model.model(tokens, cache=cache)[:, -1:, :]
    logits = model.lm_head(h) if hasattr(model, "lm_head") else model.model.embed_tokens.as_linear(h)
    return mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)


class Clock:
    """The device's own clock (`GpuStepClock`) where MLX runs on CUDA, else the host's at read-back."""

    def __init__(self) -> None:
        self.device = None
        if mx.cuda.is_available():
            from mlx_serve.kernels.step_clock import GpuStepClock

            self.device = GpuStepClock()

    def stamp(self, after: mx.array) -> mx.array | None:
        return self.device.stamp(after) if self.device else None

    def span_ms(self, start: mx.array | None, end: mx.array | None, host_start: float) -> float:
        if self.device is None:
            return 1e3 * (time.perf_counter() - host_start)
        return (self.device.read_ns(end) - self.device.read_ns(start)) / 1e6

    def host_offset(self) -> float | None:
        """Host seconds less device seconds, read with the device idle (within a read-back's latency)."""
        if self.device is None:
            return None
        ns = self.device.read_ns(self.device.stamp(mx.zeros((1,))))
        return time.perf_counter() - ns / 1e9

    def end_on_host(self, end: mx.array | None, offset: float | None) -> float | None:
        return None if offset is None or end is None else self.device.read_ns(end) / 1e9 + offset


def submit_chunk(model: Any, chunk: mx.array, cache: list) -> mx.array:
    """Queue one chunk of the prompt on the current stream; its last hidden state `[1, hidden]`."""
    last = model.model(chunk, cache=cache)[:, -1, :]
    mx.async_eval(last, *[c.state for c in cache])
    return last


def prefill_alone(model: Any, work: Workload, clock: Clock) -> Timeline:
    cache, line = make_prompt_cache(model), Timeline()
    host_start = time.perf_counter()
    start = clock.stamp(work.chunks[0])
    for chunk in work.chunks:
        line.last_hidden = submit_chunk(model, chunk, cache)
    end = clock.stamp(line.last_hidden)
    mx.eval(line.last_hidden)
    line.prompt_ms = clock.span_ms(start, end, host_start)
    return line


def decode_loop(model: Any, work: Workload, steps: int, clock: Clock, every: int = 0, stream: Any = None) -> Timeline:
    """`steps` decode steps of every stream; with `every` > 0, one chunk after every `every`-th step from step
    BEFORE on, queued on `stream`."""
    cache, prompt_cache, line = make_prompt_cache(model), make_prompt_cache(model), Timeline()
    pending = next_tokens(model, work.histories, cache)
    mx.eval(pending)
    offset = clock.host_offset()
    start = end = None
    host_start = 0.0
    for step in range(steps):
        began = time.perf_counter()
        following = next_tokens(model, pending, cache)
        mx.async_eval(following)
        line.decode_submit_ms.append(1e3 * (time.perf_counter() - began))
        index, due = divmod(step - BEFORE, every) if every else (0, 1)
        if step >= BEFORE and due == 0 and index < len(work.chunks):
            began = time.perf_counter()
            with mx.stream(stream):
                if index == 0:
                    line.first_chunk_step, host_start, start = step, began, clock.stamp(work.chunks[0])
                line.last_hidden = submit_chunk(model, work.chunks[index], prompt_cache)
                if index == len(work.chunks) - 1:
                    end = clock.stamp(line.last_hidden)
            line.chunk_submit_ms.append(1e3 * (time.perf_counter() - began))
        line.tokens.append(pending.tolist())  # the previous step's tokens, read once the next one is queued
        line.reads.append(time.perf_counter())
        pending = following
    if line.last_hidden is not None:
        mx.eval(line.last_hidden)
        line.prompt_ms = clock.span_ms(start, end, host_start)
        line.prompt_end = clock.end_on_host(end, offset)
    return line


def summary(line: Timeline, calm: Timeline | None, solo: Timeline | None) -> dict:
    reads = line.reads
    if line.prompt_end is not None:  # the bench's window: up to 16 tokens after the prompt's end
        done = next((i for i, t in enumerate(reads) if t > line.prompt_end), len(reads))
        reads = reads[: done + TOKENS_AFTER + 1]
    gaps = [b - a for a, b in zip(reads, reads[1:])]
    first = line.first_chunk_step
    before = gaps[WARM : first - 1] if first else gaps[WARM:]
    after = gaps[first - 1 :] if first else []
    med = lambda values: round(statistics.median(values), 3) if values else None  # noqa: E731
    out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in gap_summary(before + after, before, after).items()}
    out |= {"decode_submit_p50_ms": med(line.decode_submit_ms), "chunk_submit_p50_ms": med(line.chunk_submit_ms)}
    out["chunk_submit_max_ms"] = round(max(line.chunk_submit_ms), 3) if line.chunk_submit_ms else None
    if line.prompt_ms is not None:
        out["prompt_ms"] = round(line.prompt_ms, 3)
    if solo is not None and line.prompt_ms is not None:
        out["prompt_vs_solo"] = round(line.prompt_ms / solo.prompt_ms, 3)
        out["prompt_matches_solo"] = bool(mx.array_equal(line.last_hidden, solo.last_hidden).item())
    if calm is not None:
        out["tokens_match_alone"] = line.tokens == calm.tokens[: len(line.tokens)]  # the calm run is the longest
    return out


def workload(model: Any, vocab_size: int, streams: int, history: int, prompt: int, chunk: int) -> Workload:
    prompts = Prompts(vocab_size)
    histories = mx.array(prompts.many(streams, history))
    tokens = mx.array(prompts.one(prompt))[None]
    return Workload(histories, tuple(tokens[:, i : i + chunk] for i in range(0, prompt, chunk)))


def measure(model: Any, work: Workload, everies: tuple[int, ...]) -> dict:
    clock = Clock()
    prefill_alone(model, work, clock)  # first uses of the chunk's shapes compile their kernels
    solo = prefill_alone(model, work, clock)
    warm = decode_loop(model, work, BEFORE + 48, clock)  # and the decode step's
    step_ms = 1e3 * statistics.median(b - a for a, b in zip(warm.reads[WARM:], warm.reads[WARM + 1 :]))
    # long enough to see the prompt end even if every chunk waits for the host's cadence, then 16 steps more
    tail = math.ceil(solo.prompt_ms / step_ms) + TOKENS_AFTER
    steps = {every: BEFORE + every * len(work.chunks) + tail for every in everies}
    calm = decode_loop(model, work, max(steps.values()), clock)
    result = {"decode": summary(calm, None, None), "prefill": {"prompt_ms": round(solo.prompt_ms, 3)}}
    second = mx.new_stream(mx.default_device())
    for every in everies:
        for mode, stream in (("serial", mx.default_stream(mx.default_device())), ("concurrent", second)):
            line = decode_loop(model, work, steps[every], clock, every, stream)
            result[f"{mode}_every_{every}"] = summary(line, calm, solo)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--history", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    from benchmarks.gpu.models import build_dummy_model

    dummy = build_dummy_model(args.shape)
    work = workload(dummy.model, dummy.config["vocab_size"], args.streams, args.history, args.prompt, args.chunk)
    result = {"shape": args.shape, "device": str(mx.default_device()), "streams": args.streams,
              "history": args.history, "prompt": args.prompt, "chunk": args.chunk}  # fmt: skip
    print(json.dumps(result | measure(dummy.model, work, tuple(args.every))))


if __name__ == "__main__":
    main()
