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
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def run_mlx_lm(model, prompts: list[list[int]], max_tokens: int) -> dict:
    """mlx-lm's BatchGenerator over all prompts at once; where it cannot batch the model's caches (Llama 4's chunked
    ones), its generate_step one request after another, which is how mlx-lm serves such a model."""
    try:
        return _batched(model, prompts, max_tokens)
    except ValueError as exc:
        if "support batching" not in str(exc):
            raise
        return _one_at_a_time(model, prompts, max_tokens) | {"peer": f"generate_step, one at a time ({exc})"}


def _one_at_a_time(model, prompts: list[list[int]], max_tokens: int) -> dict:
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    tokens = steps = 0
    decode_s = 0.0
    for prompt in prompts:
        first = None
        for _, _ in zip(range(max_tokens), generate_step(mx.array(prompt), model)):
            first = first or time.perf_counter()
            tokens += 1
        steps += max_tokens
        decode_s += time.perf_counter() - first
    return {"tokens": tokens, "total_s": time.perf_counter() - t0, "steps": steps, "decode_s": decode_s}


def _batched(model, prompts: list[list[int]], max_tokens: int) -> dict:
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


def run_ours(path: Path, params, config_kwargs: dict) -> dict:
    """The same requests through `mlx_serve.workloads.offline` (what `python -m mlx_serve bench offline` runs)."""
    from dataclasses import asdict

    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.workloads import offline
    from tracing.sink import MemorySink

    config = EngineConfig(model=str(path), max_running=params.requests, trace=MemorySink(), **config_kwargs)
    engine = Engine.load(config)
    try:
        loaded = mx.get_active_memory()  # weights and the KV pool
        mx.reset_peak_memory()
        figures = asdict(offline(engine, params))
        # what the steps held above the weights and the pool: a pool layer copied instead of written in place shows
        return figures | {"peak_above_loaded_mb": (mx.get_peak_memory() - loaded) / (1 << 20)}
    finally:
        engine.shutdown()


def engine_fields(pairs: list[str]) -> dict:
    """`FIELD=VALUE` pairs as EngineConfig keywords: true/false and numbers as such, the rest as strings."""
    fields = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine takes FIELD=VALUE, not {pair!r}")
        try:
            fields[name] = json.loads(text)
        except json.JSONDecodeError:
            fields[name] = text
    return fields


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
    parser.add_argument("--decode-attention", default="auto")
    parser.add_argument("--kv-blocks", type=int, help="the KV pool's blocks (default: sized from the memory budget)")
    parser.add_argument("--engine", action="append", default=[], metavar="FIELD=VALUE",
                        help="an EngineConfig field for ours (repeatable), e.g. fuse_decode=off, pipeline=false")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import mlx_lm

    from mlx_serve.checkpoints import make_checkpoint
    from mlx_serve.model_loading import text_model
    from mlx_serve.workloads import WorkloadParams, prompt_ids

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_checkpoint(
            Path(tmp) / "model", arch=args.arch, preset=args.preset, dtype=args.dtype, quantize_bits=args.quantize
        )
        model, _ = mlx_lm.load(str(path))
        vocab = text_model(model).args.vocab_size  # a multimodal wrapper keeps it with its text model
        prompts = [list(prompt_ids(i, args.prompt_len, vocab)) for i in range(args.requests)]
        run_mlx_lm(model, prompts[:2], 4)  # warm-up
        peer = run_mlx_lm(model, prompts, args.max_tokens)
        del model
        mx.clear_cache()
        params = WorkloadParams(requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens)
        ours = run_ours(path, params, {"decode_attention": args.decode_attention, "kv_blocks": args.kv_blocks,
                                       **engine_fields(args.engine)})
    result = {
        "model": f"{args.arch}-{args.preset}-{args.dtype}" + (f"-q{args.quantize}" if args.quantize else ""),
        "device": str(mx.default_device()),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "mlx_lm": peer,
        "ours": ours,
        "throughput_ratio": ours["generated_tok_per_s"] / (peer["tokens"] / peer["total_s"]),
    }
    if args.json:
        print(json.dumps(result))
        return
    print("| engine | generated tok/s | total s | steps | decode step ms p50 | host ms/step | peak MB above loaded |")
    print("|---|---|---|---|---|---|---|")
    p, o = peer, ours
    print(f"| mlx-lm {p.get('peer', 'BatchGenerator')} | {p['tokens'] / p['total_s']:.1f} | {p['total_s']:.2f} | {p['steps']} | "
          f"{1e3 * p['decode_s'] / max(p['steps'], 1):.2f} (mean) | - | - |")
    print(f"| mlx_serve | {o['generated_tok_per_s']:.1f} | {o['total_s']:.2f} | {o['steps']} | "
          f"{o['decode_step_ms_p50']:.2f} | {o['host_ms_per_step']:.2f} | {o['peak_above_loaded_mb']:.0f} |")
    print(f"\nthroughput ratio (ours / mlx-lm): {result['throughput_ratio']:.2f}x  [{result['model']}, {result['device']}]")


if __name__ == "__main__":
    main()
