"""Speculative decoding by prompt lookup, one greedy stream: decode tokens/s of mlx-lm's generate_step (the peer),
our engine without drafts, and with up to K drafted tokens a step, on a dummy checkpoint, in one process.

    python benchmarks/speculative.py --preset 0.6b --max-tokens 128 --draft-tokens 4 8 [--json]

Two prompts: `fresh` (random tokens) and `continued` (the random prompt followed by the first half of the model's
own answer to it, so the answer's second half is asked for). Drafts come from the prompt and the answer so far: a
dummy model's greedy answers fall into loops, which its earlier tokens predict; a trained model's come from text it
quotes or edits (not measurable without real weights). Every engine run's tokens are checked against mlx-lm's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def mlx_lm_run(model, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """mlx-lm's greedy tokens and decode tokens/s (after the first token)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens, stamps = [], []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(int(token))
        stamps.append(time.perf_counter())
    return tokens, (len(tokens) - 1) / (stamps[-1] - stamps[0])


def mlx_lm_drafted_run(model, prompt: list[int], max_tokens: int, drafts: int) -> tuple[list[int], float]:
    """mlx-lm's speculative_generate_step with the model as its own draft: tokens and decode tokens/s."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    tokens, stamps = [], []
    steps = speculative_generate_step(mx.array(prompt), model, model, num_draft_tokens=drafts, max_tokens=max_tokens)
    for token, _, _ in steps:
        tokens.append(int(token))
        stamps.append(time.perf_counter())
    return tokens, (len(tokens) - 1) / (stamps[-1] - stamps[0])


def engine_runs(path: Path, prompts: list[list[int]], max_tokens: int, drafts: int,
                draft_model: Path | None = None) -> list[dict]:  # fmt: skip
    """One engine (loaded once: on CUDA its warm-up takes seconds), each prompt run alone after a warm-up."""
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.types import GenerationRequest

    engine = Engine.load(EngineConfig(model=str(path), kv_blocks=512, speculative_tokens=drafts,
                                      draft_model=str(draft_model) if draft_model else None))  # fmt: skip
    runs = []
    try:
        for prompt in prompts:
            engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=4)])  # warm-up
            before = engine.status()["counters"]
            stamps, tokens = [], []
            for event in engine.submit(GenerationRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens)):
                if event.token_id is not None:
                    tokens.append(event.token_id)
                    stamps.append(time.perf_counter())
            after = engine.status()["counters"]
            runs.append({
                "tokens": tokens,
                "decode_tok_s": (len(tokens) - 1) / (stamps[-1] - stamps[0]),
                "steps": after["steps"] - before["steps"],
                "drafted": after["draft_tokens"] - before["draft_tokens"],
                "accepted": after["accepted_draft_tokens"] - before["accepted_draft_tokens"],
            })  # fmt: skip
    finally:
        engine.shutdown()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=("tiny", "0.6b"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--self-draft", type=int, default=0, metavar="K",
                        help="also the model as its own draft model, K drafts a step, ours against mlx-lm's "
                             "speculative_generate_step (every draft agrees: the mechanism's cost, not a real draft's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from mlx_lm import load

    from mlx_serve.checkpoints import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "model", arch="qwen3", preset=args.preset, seed=0, dtype=args.dtype)
        model, _ = load(str(path))
        fresh = [10 + (i * 104729) % 1000 for i in range(args.prompt_len)]
        answer, _ = mlx_lm_run(model, fresh, 2 * args.max_tokens)
        prompts = {"fresh": fresh, "continued": fresh + answer[: args.max_tokens]}
        peers = {}
        for name, prompt in prompts.items():
            mlx_lm_run(model, prompt, 8)  # warm-up
            peers[name] = mlx_lm_run(model, prompt, args.max_tokens)
        ours = {f"mlx_serve, {drafts} drafts" if drafts else "mlx_serve":
                engine_runs(path, list(prompts.values()), args.max_tokens, drafts)
                for drafts in (0, *args.draft_tokens)}  # fmt: skip
        drafted_peers = {}
        if args.self_draft:
            ours[f"mlx_serve, self-draft {args.self_draft}"] = engine_runs(
                path, list(prompts.values()), args.max_tokens, args.self_draft, draft_model=path)
            for name, prompt in prompts.items():
                drafted_peers[name] = mlx_lm_drafted_run(model, prompt, args.max_tokens, args.self_draft)[1]
        rows = []
        for i, name in enumerate(prompts):
            reference, peer = peers[name]
            rows.append({"prompt": name, "engine": "mlx-lm generate_step", "decode_tok_s": peer})
            if name in drafted_peers:
                rows.append({"prompt": name, "engine": f"mlx-lm self-draft {args.self_draft}",
                             "decode_tok_s": drafted_peers[name]})  # fmt: skip
            for label, runs in ours.items():
                run = runs[i]
                rows.append({"prompt": name, "engine": label,
                             "decode_tok_s": run["decode_tok_s"], "vs_peer": run["decode_tok_s"] / peer,
                             "steps": run["steps"], "drafted": run["drafted"], "accepted": run["accepted"],
                             "identical": run["tokens"] == reference})  # fmt: skip
    if args.json:
        print(json.dumps({"preset": args.preset, "dtype": args.dtype, "max_tokens": args.max_tokens, "rows": rows}))
        return
    print(f"qwen3 {args.preset} {args.dtype}, {args.max_tokens} greedy tokens, one stream")
    print(f"{'prompt':9} {'engine':27} {'tok/s':>8} {'vs mlx-lm':>9} {'steps':>6} {'drafted':>8} {'accepted':>8} same")
    for r in rows:
        extra = (f"{r['vs_peer']:9.2f} {r['steps']:6d} {r['drafted']:8d} {r['accepted']:8d} {r['identical']}"
                 if "steps" in r else "")  # fmt: skip
        print(f"{r['prompt']:9} {r['engine']:27} {r['decode_tok_s']:8.1f} {extra}")


if __name__ == "__main__":
    main()
