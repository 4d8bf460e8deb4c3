"""Quantized KV (`--kv-bits`): what a token of KV costs, how many tokens one budget holds, and decode tokens/s of N
greedy streams, with KV in the model's dtype and quantized to 8 and 4 bits. The peer, in the same run: mlx-lm's own
caches for one of the requests (KVCache, and the QuantizedKVCache its --kv-bits makes) and its generate_step's
tokens with them, which every engine run must match.

    python benchmarks/quantized_kv.py --preset 0.6b --streams 4 --prompt 512 --max-tokens 32 --budget-gb 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx


def peer(path: Path, prompt: list[int], max_tokens: int, bits: int | None) -> tuple[list[int], int, float]:
    """mlx-lm's generate_step with its caches (quantized from the first token where `bits`): tokens, the bytes its
    caches hold after them, decode tokens/s of the one stream."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    model, _ = load(str(path))
    cache = [QuantizedKVCache(64, bits) if bits and type(c) is KVCache else c for c in make_prompt_cache(model)]
    tokens, stamps = [], []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache):
        tokens.append(int(token))
        stamps.append(time.perf_counter())
    return tokens, sum(c.nbytes for c in cache), (len(stamps) - 1) / (stamps[-1] - stamps[0])


def engine_run(path: Path, prompts: list[list[int]], max_tokens: int, bits: int | None, budget_gb: float) -> dict:
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.types import GenerationRequest

    engine = Engine.load(EngineConfig(model=str(path), memory_budget_gb=budget_gb, kv_bits=bits, warm_up=False,
                                      max_model_len=4096))  # fmt: skip
    try:
        engine.generate([GenerationRequest(prompt_ids=tuple(prompts[0][:32]), max_tokens=2)])  # warm-up
        handles = engine.submit_all([GenerationRequest(prompt_ids=tuple(p), max_tokens=max_tokens) for p in prompts])
        with ThreadPoolExecutor(len(handles)) as pool:
            streams = list(pool.map(lambda h: [(e.token_id, time.perf_counter()) for e in h if e.token_id is not None],
                                    handles))  # fmt: skip
        layout, pool_tokens = engine.pool.layout, engine.pool.num_blocks * engine.pool.block_size
    finally:
        engine.shutdown()
    first = max(s[0][1] for s in streams)
    decoded = sum(1 for s in streams for _, t in s if t > first)
    return {"bits": bits, "bytes_per_token": layout.bytes_per_token(), "pool_tokens": pool_tokens,
            "tok_s": decoded / (max(s[-1][1] for s in streams) - first),
            "tokens": [[token for token, _ in s] for s in streams]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="0.6b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget-gb", type=float, default=8.0)
    args = parser.parse_args()
    from mlx_serve.checkpoints import make_checkpoint

    prompts = [[10 + (i * 7919 + j * 104729) % 1500 for j in range(args.prompt)] for i in range(args.streams)]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "m", arch="qwen3", preset=args.preset, dtype=args.dtype, seed=0)
        rows = []
        for bits in (None, 8, 4):
            ours = engine_run(path, prompts, args.max_tokens, bits, args.budget_gb)
            want, peer_bytes, peer_tok_s = peer(path, prompts[0], args.max_tokens, bits)
            rows.append((ours, peer_bytes, peer_tok_s, ours["tokens"][0] == want))
    tokens = args.prompt + args.max_tokens
    print(f"qwen3 {args.preset} {args.dtype}, {args.streams} streams of {args.prompt} + {args.max_tokens} tokens, "
          f"budget {args.budget_gb} GiB")  # fmt: skip
    print(f"{'KV':>7} {'bytes/token':>12} {'pool tokens':>12} {'tok/s (all)':>12} {'mlx-lm MiB/request':>19} "
          f"{'ours MiB/request':>17} {'mlx-lm tok/s (1)':>17} {'= mlx-lm':>9}")  # fmt: skip
    for ours, peer_bytes, peer_tok_s, same in rows:
        label = f"{ours['bits']}-bit" if ours["bits"] else args.dtype
        print(f"{label:>7} {ours['bytes_per_token']:12d} {ours['pool_tokens']:12d} {ours['tok_s']:12.1f} "
              f"{peer_bytes / 2**20:19.2f} {ours['bytes_per_token'] * tokens / 2**20:17.2f} {peer_tok_s:17.1f} "
              f"{str(same):>9}")  # fmt: skip
    if not all(same for *_, same in rows):
        raise SystemExit("an engine run's tokens differ from mlx-lm's")


if __name__ == "__main__":
    main()
