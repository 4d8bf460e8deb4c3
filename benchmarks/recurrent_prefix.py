"""What state snapshots buy a model with recurrent layers: a chat's later turns read only what follows the earlier
turn's last snapshot. A Qwen3-Next layout (gated delta nets, every second layer full attention) with dummy weights; a
conversation of `--turns` turns, the first prompt `--prompt` tokens, each later one the conversation so far (prompt and
answer) and `--follow` new tokens; served twice: with `--state-snapshots 0` (no prefix hits: a state is not paged)
and with the default snapshots. Both runs must give the same greedy tokens. The peer: mlx-lm's own time to the first
token of the last turn's whole prompt (its generate_step, one request alone, no cache carried between turns).

    python benchmarks/recurrent_prefix.py --prompt 3000 --follow 100 --turns 3
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from benchmarks.gpu.models import dummy_of_config
from mlx_serve.checkpoints.builder import checkpoint_config
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest


def qwen3_next_layout(layers: int, context: int) -> dict:
    config = checkpoint_config("qwen3_next", "tiny")
    config.update(num_hidden_layers=layers, max_position_embeddings=context)
    return config


def converse(dummy, first: list[int], follows: list[list[int]], max_tokens: int, snapshots: int | None) -> dict:
    config = EngineConfig(model="qwen3-next-layout", kv_blocks=2048, state_snapshots=snapshots, warm_up=False)
    engine = Engine.from_model(dummy.model, dummy.tokenizer, dummy.config, config)
    prompt, ttfts, tokens = list(first), [], []
    try:
        for turn in range(len(follows) + 1):
            started = time.perf_counter()
            handle = engine.submit(GenerationRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens, ignore_eos=True))
            answer = []
            for event in handle:
                if event.token_id is not None:
                    if not answer:
                        ttfts.append(time.perf_counter() - started)
                    answer.append(event.token_id)
            tokens.append(answer)
            if turn < len(follows):
                prompt = prompt + answer + follows[turn]
        counters = engine.status()["counters"]
    finally:
        engine.shutdown()
    return {"ttft_s": ttfts, "tokens": tokens, "hits": counters["prefix_hit_tokens"], "last_prompt": prompt}


def mlx_lm_ttft(model, prompt: list[int]) -> float:
    from mlx_lm.generate import generate_step

    started = time.perf_counter()
    token, _ = next(generate_step(mx.array(prompt), model, max_tokens=1))
    mx.eval(token)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=3000)
    parser.add_argument("--follow", type=int, default=100)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    context = args.prompt + args.turns * (args.follow + args.max_tokens) + 64
    dummy = dummy_of_config("qwen3-next-layout", qwen3_next_layout(args.layers, context), "float32")
    first = [10 + (j * 104729) % 1500 for j in range(args.prompt)]
    follows = [[10 + (t * 7919 + j * 104729) % 1500 for j in range(args.follow)] for t in range(1, args.turns)]
    runs = {label: converse(dummy, first, follows, args.max_tokens, snapshots)
            for label, snapshots in (("off (--state-snapshots 0)", 0), ("on (default)", None))}  # fmt: skip
    peer = mlx_lm_ttft(dummy.peer_model, runs["on (default)"]["last_prompt"])
    print(f"Qwen3-Next layout ({args.layers} layers, half gated delta nets), {args.turns} turns: {args.prompt} tokens, "
          f"then +{args.max_tokens} answer +{args.follow} new each turn")  # fmt: skip
    print(f"{'snapshots':26} " + " ".join(f"{f'turn {t + 1} TTFT s':>14}" for t in range(args.turns))
          + f" {'prefix hits':>12}")  # fmt: skip
    for label, run in runs.items():
        print(f"{label:26} " + " ".join(f"{s:14.3f}" for s in run["ttft_s"]) + f" {run['hits']:12d}")
    print(f"mlx-lm generate_step, last turn's {len(runs['on (default)']['last_prompt'])}-token prompt: TTFT {peer:.3f} s")
    same = runs["off (--state-snapshots 0)"]["tokens"] == runs["on (default)"]["tokens"]
    print(f"same greedy tokens in both runs: {same}")
    if not same:
        raise SystemExit("the snapshots changed the tokens")


if __name__ == "__main__":
    main()
