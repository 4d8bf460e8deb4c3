"""Offline throughput and step overhead: our engine against mlx-lm's BatchGenerator, same model, same run.

    python benchmarks/offline_throughput.py --arch qwen3 --preset tiny --requests 32 --prompt-len 128 \\
        --max-tokens 64 [--quantize 4] [--json]

Builds (or takes with --model) a dummy checkpoint, runs the same greedy prompts through both (each warmed up
once), and prints generated tokens/s, wall time per generation step, and for ours the host-side share of each
step (scheduling, preparation and output handling, from the engine's trace). EOS is ignored on both sides so
both generate exactly max_tokens per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[10 + (i * 7919 + j * 104729) % (vocab - 20) for j in range(length)] for i in range(n)]


def run_mlx_lm(model, prompts: list[list[int]], max_tokens: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    t0 = time.perf_counter()
    gen.insert(prompts, [max_tokens] * len(prompts))
    tokens, steps, first = 0, 0, None
    while responses := gen.next_generated():
        first = first or time.perf_counter()
        steps += 1
        tokens += len(responses)
    total = time.perf_counter() - t0
    gen.close()
    return {"tokens": tokens, "total_s": total, "steps": steps, "decode_s": total - (first - t0)}


def run_ours(path: Path, prompts: list[list[int]], max_tokens: int, config_kwargs: dict) -> dict:
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.types import GenerationRequest
    from tracing.sink import MemorySink

    sink = MemorySink()
    engine = Engine.load(EngineConfig(model=str(path), max_running=len(prompts), trace=sink, **config_kwargs))
    requests = [GenerationRequest(prompt_ids=tuple(p), max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    try:
        engine.generate(requests[:2])  # warm-up: compile paths, allocate
        sink.events.clear()
        t0 = time.perf_counter()
        completions = engine.generate(requests)
        total = time.perf_counter() - t0
    finally:
        engine.shutdown()
    steps = [e for e in sink.events if type(e).__name__ == "StepExecuted"]
    spans = [e for e in sink.events if type(e).__name__ == "Span" and e.step_id is not None]
    host = sum(s.end - s.start for s in spans if s.name in ("planning", "preparation", "application"))
    decode_steps = [s.measured_ms for s in steps if s.prefill_rows == 0]
    return {
        "tokens": sum(len(c.token_ids) for c in completions),
        "total_s": total,
        "steps": len(steps),
        "decode_step_ms_p50": statistics.median(decode_steps) if decode_steps else None,
        "host_ms_per_step": 1e3 * host / max(len(steps), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="an existing checkpoint (default: build a dummy one)")
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", type=int, choices=(4, 8))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--decode-attention", default="reference")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import mlx_lm

    from mlx_serve.checkpoints import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_checkpoint(
            Path(tmp) / "model", arch=args.arch, preset=args.preset, dtype=args.dtype, quantize_bits=args.quantize
        )
        model, tokenizer = mlx_lm.load(str(path))
        prompts = _prompts(args.requests, args.prompt_len, model.args.vocab_size)
        run_mlx_lm(model, prompts[:2], 4)  # warm-up
        peer = run_mlx_lm(model, prompts, args.max_tokens)
        del model
        mx.clear_cache()
        ours = run_ours(path, prompts, args.max_tokens, {"decode_attention": args.decode_attention})
    result = {
        "model": f"{args.arch}-{args.preset}-{args.dtype}" + (f"-q{args.quantize}" if args.quantize else ""),
        "device": str(mx.default_device()),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "mlx_lm": peer,
        "ours": ours,
        "throughput_ratio": (ours["tokens"] / ours["total_s"]) / (peer["tokens"] / peer["total_s"]),
    }
    if args.json:
        print(json.dumps(result))
        return
    print("| engine | generated tok/s | total s | steps | decode step ms p50 | host ms/step |")
    print("|---|---|---|---|---|---|")
    p, o = peer, ours
    print(f"| mlx-lm BatchGenerator | {p['tokens'] / p['total_s']:.1f} | {p['total_s']:.2f} | {p['steps']} | "
          f"{1e3 * p['decode_s'] / max(p['steps'], 1):.2f} (mean) | - |")
    print(f"| mlx_serve | {o['tokens'] / o['total_s']:.1f} | {o['total_s']:.2f} | {o['steps']} | "
          f"{o['decode_step_ms_p50']:.2f} | {o['host_ms_per_step']:.2f} |")
    print(f"\nthroughput ratio (ours / mlx-lm): {result['throughput_ratio']:.2f}x  [{result['model']}, {result['device']}]")


if __name__ == "__main__":
    main()
