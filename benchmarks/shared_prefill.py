"""A burst over one system prompt: N requests arrive together, each a shared S-token prefix plus its own question.

    python benchmarks/shared_prefill.py --requests 8 --system-len 1024 --question-len 32 --max-tokens 8 [--json]

Runs the same prompts through mlx-lm's BatchGenerator (the peer, which computes every prompt whole) and our engine
with `shared_prefill_tokens` on (default 256: the later requests wait for the first one's prefill and take the
prefix from the cache) and off (each computes it), each warmed up once, in one process on a dummy checkpoint.
Prints wall time, the mean and longest time to first token, and the prompt rows each engine computed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def burst(system_len: int, question_len: int, requests: int, vocab: int) -> list[list[int]]:
    """Prompts of one shared system prefix and a distinct question each (ordinary token ids)."""
    system = [10 + (i * 104729) % (vocab - 20) for i in range(system_len)]
    return [[*system, *(10 + (r * 7919 + i * 31) % (vocab - 20) for i in range(question_len))] for r in range(requests)]


def run_mlx_lm(model, prompts: list[list[int]], max_tokens: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))  # fmt: skip
    t0 = time.perf_counter()
    uids = gen.insert(prompts, [max_tokens] * len(prompts))
    first: dict[int, float] = {}
    while responses := gen.next_generated():
        now = time.perf_counter()
        for response in responses:
            first.setdefault(response.uid, now - t0)
    total = time.perf_counter() - t0
    gen.close()
    ttfts = [first[uid] for uid in uids]
    return {"total_s": total, "ttft_mean_s": statistics.mean(ttfts), "ttft_max_s": max(ttfts),
            "prompt_rows": sum(len(p) for p in prompts)}  # fmt: skip


class FirstTokens:
    """The engine observer: each request's time to first token, from its submission."""

    def __init__(self) -> None:
        self.ttfts: list[float] = []

    def on_first_token(self, ttft_s: float) -> None:
        self.ttfts.append(ttft_s)

    def on_step(self, *args: object) -> None: ...

    def on_token_gap(self, gap_s: float) -> None: ...

    def on_finish(self, *args: object) -> None: ...


def run_ours(path: Path, prompts: list[list[int]], max_tokens: int, shared: int) -> dict:
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.types import GenerationRequest

    observer = FirstTokens()
    config = EngineConfig(model=str(path), max_running=len(prompts), shared_prefill_tokens=shared, observer=observer)
    engine = Engine.load(config)
    try:
        engine.generate([GenerationRequest(prompt_ids=(11, 12, 13), max_tokens=2, cache_salt="warm-up")])
        before, observer.ttfts = engine.stats(), []
        # a salt of the run's own: the warm-up leaves nothing in the cache for it
        requests = [GenerationRequest(prompt_ids=tuple(p), max_tokens=max_tokens, ignore_eos=True,
                                      cache_salt=f"burst-{shared}") for p in prompts]  # fmt: skip
        t0 = time.perf_counter()
        engine.generate(requests)
        total = time.perf_counter() - t0
        after = engine.stats()
    finally:
        engine.shutdown()
    return {"total_s": total, "ttft_mean_s": statistics.mean(observer.ttfts), "ttft_max_s": max(observer.ttfts),
            "prompt_rows": after["prompt_tokens_total"] - before["prompt_tokens_total"],
            "waits": after["shared_prefill_waits_total"] - before["shared_prefill_waits_total"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import mlx_lm

    from mlx_serve.checkpoints import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "model", arch=args.arch, preset=args.preset, dtype=args.dtype)
        model, _ = mlx_lm.load(str(path))
        prompts = burst(args.system_len, args.question_len, args.requests, model.args.vocab_size)
        run_mlx_lm(model, prompts[:2], 2)  # warm-up
        peer = run_mlx_lm(model, prompts, args.max_tokens)
        del model
        mx.clear_cache()
        result = {
            "model": f"{args.arch}-{args.preset}-{args.dtype}", "device": str(mx.default_device()),
            "requests": args.requests, "system_len": args.system_len, "question_len": args.question_len,
            "mlx_lm": peer,
            "ours_shared": run_ours(path, prompts, args.max_tokens, 256),
            "ours_unshared": run_ours(path, prompts, args.max_tokens, 0),
        }  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return
    print("| engine | wall s | TTFT mean / max s | prompt rows computed |")
    print("|---|---|---|---|")
    for name, key in (("mlx-lm BatchGenerator", "mlx_lm"), ("mlx_serve, shared prefill on", "ours_shared"),
                      ("mlx_serve, shared prefill off", "ours_unshared")):  # fmt: skip
        r = result[key]
        print(f"| {name} | {r['total_s']:.3f} | {r['ttft_mean_s']:.3f} / {r['ttft_max_s']:.3f} | {r['prompt_rows']:,} |")
    print(f"\n[{result['model']}, {result['device']}, {args.requests} x ({args.system_len} + {args.question_len})]")


if __name__ == "__main__":
    main()
