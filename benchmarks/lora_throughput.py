"""Per-request LoRA adapters: decode tokens/s of N greedy streams on the base model, all on one adapter, and spread
over several adapters in the same steps; mlx-lm's BatchGenerator with that one adapter loaded (its LoRA layers) is
the peer.

    python benchmarks/lora_throughput.py --preset 0.6b --streams 4 --max-tokens 16 --adapters 4 [--json]

Adapters are dummy (`make-adapter`: rank 8 on q_proj and v_proj of every layer). Every engine run's tokens are
checked against mlx-lm's generate_step with the request's adapter loaded.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def peer_run(path: Path, adapter: Path, prompts: list[list[int]], max_tokens: int) -> float:
    """mlx-lm's BatchGenerator over the base model with `adapter` applied: decode tokens/s after the first token."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, _ = load(str(path), adapter_path=str(adapter))
    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))  # fmt: skip
    gen.insert(prompts, [max_tokens] * len(prompts))
    stamps, tokens = [], 0
    while responses := gen.next_generated():
        stamps.append(time.perf_counter())
        tokens += len(responses)
    gen.close()
    return (tokens - len(prompts)) / (stamps[-1] - stamps[0])


def engine_run(path: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str | None],
               max_tokens: int) -> tuple[float, list[list[int]]]:  # fmt: skip
    from mlx_serve.adapter_specs import AdapterSpec
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.types import GenerationRequest

    specs = tuple(AdapterSpec(name, str(p)) for name, p in adapters.items())
    engine = Engine.load(EngineConfig(model=str(path), kv_blocks=256, adapters=specs))
    try:
        engine.generate([GenerationRequest(prompt_ids=tuple(prompts[0]), max_tokens=2, adapter=names[0])])  # warm-up
        handles = engine.submit_all([GenerationRequest(prompt_ids=tuple(p), max_tokens=max_tokens, adapter=name)
                                     for p, name in zip(prompts, names)])  # fmt: skip
        with ThreadPoolExecutor(len(handles)) as pool:  # each stream read as its tokens arrive
            streams = list(pool.map(lambda h: [(e.token_id, time.perf_counter()) for e in h if e.token_id is not None],
                                    handles))  # fmt: skip
    finally:
        engine.shutdown()
    first = max(s[0][1] for s in streams)  # every stream decoding from here
    last = max(s[-1][1] for s in streams)
    decoded = sum(1 for s in streams for _, t in s if t > first)
    return decoded / (last - first), [[token for token, _ in s] for s in streams]


@functools.lru_cache(maxsize=8)
def _reference_model(path: Path, adapter: Path | None):
    """mlx-lm's model with `adapter` loaded, once per adapter (not once per prompt checked)."""
    from mlx_lm import load

    return load(str(path), adapter_path=str(adapter) if adapter else None)[0]


def reference(path: Path, adapter: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model = _reference_model(path, adapter)
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=("tiny", "0.6b"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from mlx_serve.checkpoints import make_checkpoint
    from mlx_serve.checkpoints.adapters import make_adapter

    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "model", arch="qwen3", preset=args.preset, seed=0, dtype=args.dtype)
        adapters = {f"a{i}": make_adapter(path, Path(tmp) / f"a{i}", seed=i + 1) for i in range(args.adapters)}
        prompts = [[10 + (s * 7919 + i * 104729) % 1000 for i in range(32)] for s in range(args.streams)]
        cases = {
            "base": [None] * args.streams,
            "one adapter": ["a0"] * args.streams,
            f"{args.adapters} adapters": [f"a{s % args.adapters}" for s in range(args.streams)],
        }
        rows = [{"case": "one adapter", "engine": "mlx-lm BatchGenerator, adapter on",
                 "tok_s": peer_run(path, adapters["a0"], prompts, args.max_tokens)}]  # fmt: skip
        for case, names in cases.items():
            tok_s, tokens = engine_run(path, adapters, prompts, names, args.max_tokens)
            same = all(got == reference(path, adapters.get(name), p, args.max_tokens)[: len(got)]
                       for p, name, got in zip(prompts, names, tokens))  # fmt: skip
            rows.append({"case": case, "engine": "mlx_serve", "tok_s": tok_s, "identical": same})
    if args.json:
        print(json.dumps({"preset": args.preset, "streams": args.streams, "rows": rows}))
        return
    print(f"qwen3 {args.preset} {args.dtype}, {args.streams} greedy streams, {args.max_tokens} tokens each")
    for r in rows:
        print(f"{r['case']:12} {r['engine']:32} {r['tok_s']:8.1f} tok/s  {r.get('identical', '')}")


if __name__ == "__main__":
    main()
