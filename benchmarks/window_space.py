"""What the window space buys: sliding-window layers keep only the blocks their windows reach, so the same memory
budget holds more long requests at once. A Gemma 3 layout (five sliding-window layers to one full-attention layer,
windows of `--window` tokens) with dummy weights, `--requests` prompts of `--prompt` tokens all sent at once, served
twice under one `--budget-mb` of KV memory: with the window space off (`--window-kv-tokens 0`: every layer keeps every
token) and on (its default size). Both runs must give the same greedy tokens. The peer: the KV bytes mlx-lm's own
caches hold for one of the requests (its rotating caches keep a window too), against what the pool holds for one.

    python benchmarks/window_space.py --prompt 4000 --requests 8 --window 512 --budget-mb 60
"""

from __future__ import annotations

import argparse
import threading
import time

from benchmarks.gpu.models import dummy_of_config
from mlx_serve.checkpoints.builder import checkpoint_config
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest


def gemma3_layout(window: int, context: int) -> dict:
    config = checkpoint_config("gemma3_text", "tiny")
    config.update(num_hidden_layers=6, sliding_window=window, sliding_window_pattern=6, max_position_embeddings=context)
    return config


def serve(dummy, prompts: list[tuple[int, ...]], budget_mb: float, window_kv_tokens: int | None, max_tokens: int,
          max_running: int) -> dict:  # fmt: skip
    weights_gb = dummy.weight_bytes / 2**30
    config = EngineConfig(model="gemma3-layout", memory_budget_gb=weights_gb + budget_mb / 0.9 / 1024,
                          window_kv_tokens=window_kv_tokens, max_running=max_running, warm_up=False)  # fmt: skip
    engine = Engine.from_model(dummy.model, dummy.tokenizer, dummy.config, config)
    most_running, done = 0, threading.Event()

    def watch() -> None:
        nonlocal most_running
        while not done.wait(0.02):
            most_running = max(most_running, engine.stats()["running"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.perf_counter()
    try:
        completions = engine.generate([GenerationRequest(prompt_ids=p, max_tokens=max_tokens) for p in prompts])
        elapsed = time.perf_counter() - started
        counters = engine.status()["counters"]
    finally:
        done.set()
        watcher.join()
        engine.shutdown()
    return {
        "window_kv_tokens": window_kv_tokens, "pool_mib": engine.pool.nbytes / 2**20,
        "full_tokens": engine.pool.num_blocks * engine.pool.block_size,
        "window_tokens": engine.pool.window_blocks * engine.pool.block_size,
        "most_running": most_running, "preemptions": counters["preemptions"], "seconds": elapsed,
        "tokens": [list(c.token_ids) for c in completions],
    }  # fmt: skip


def mlx_lm_cache_bytes(dummy, prompt: tuple[int, ...], max_tokens: int) -> int:
    """The bytes mlx-lm's prompt cache holds after generating `max_tokens` tokens of `prompt`."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(dummy.peer_model)
    for _ in generate_step(mx.array(prompt), dummy.peer_model, max_tokens=max_tokens, prompt_cache=cache):
        pass
    return sum(c.nbytes for c in cache)


def pool_bytes_of_one(engine_layout, tokens: int, window: int, block_size: int, windowed: bool) -> int:
    """What the pool holds for one decoding request of `tokens` tokens: its blocks, in the window space only those
    its window reaches."""
    per_token, window_per_token = engine_layout.bytes_per_token(), engine_layout.windowed_bytes_per_token()
    blocks = -(-tokens // block_size)
    if not windowed:
        return blocks * block_size * per_token
    reach = min(blocks, -(-(window - 1) // block_size) + 1)
    return block_size * (blocks * (per_token - window_per_token) + reach * window_per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4000)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--budget-mb", type=float, default=60.0, help="KV memory (the budget past the weights)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-running", type=int, default=8)
    args = parser.parse_args()
    dummy = dummy_of_config("gemma3-layout", gemma3_layout(args.window, args.prompt + args.max_tokens + 64), "float32")
    prompts = [tuple(10 + (i * 7919 + j * 104729) % 1500 for j in range(args.prompt)) for i in range(args.requests)]
    runs = [serve(dummy, prompts, args.budget_mb, tokens, args.max_tokens, args.max_running) for tokens in (0, None)]
    print(f"gemma3 layout (5 sliding-window layers of {args.window} tokens : 1 full), {args.requests} x {args.prompt}-token "
          f"prompts, {args.max_tokens} tokens each, {args.budget_mb:.0f} MiB of KV budget")  # fmt: skip
    print(f"{'window space':14} {'pool MiB':>9} {'full tokens':>12} {'window tokens':>14} {'most running':>13} "
          f"{'preemptions':>12} {'seconds':>8}")  # fmt: skip
    for run in runs:
        label = "off" if run["window_kv_tokens"] == 0 else "on (auto)"
        print(f"{label:14} {run['pool_mib']:9.1f} {run['full_tokens']:12d} {run['window_tokens']:14d} "
              f"{run['most_running']:13d} {run['preemptions']:12d} {run['seconds']:8.1f}")  # fmt: skip
    from mlx_serve.model_loading import kv_layout

    layout, tokens = kv_layout(dummy.model, (args.window,) * 5 + (None,)), args.prompt + args.max_tokens
    peer = mlx_lm_cache_bytes(dummy, prompts[0], args.max_tokens)
    ours = [pool_bytes_of_one(layout, tokens, args.window, 16, windowed) for windowed in (False, True)]
    print(f"KV one {tokens}-token request holds: mlx-lm's caches {peer / 2**20:.2f} MiB; the pool "
          f"{ours[0] / 2**20:.2f} MiB without the window space, {ours[1] / 2**20:.2f} MiB with it")  # fmt: skip
    same = runs[0]["tokens"] == runs[1]["tokens"]
    print(f"same greedy tokens in both runs: {same}")
    if not same:
        raise SystemExit("the window space changed the tokens")


if __name__ == "__main__":
    main()
