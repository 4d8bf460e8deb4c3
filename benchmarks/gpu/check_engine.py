"""Greedy parity of our engine (GPU fast paths on) with mlx-lm's generate_step, run before the benchmark.

Prompts longer than the prefill KV bucket and the row ceiling exercise chunked prefill over padded history and
the paged decode kernel. Exits 1 if float32 tokens agree less than 90% or bf16 first tokens less than 2 of 3.

    python -m benchmarks.gpu.check_engine
"""

from __future__ import annotations

import sys

import mlx.core as mx

from benchmarks.gpu.models import build_dummy_model
from benchmarks.gpu.workloads import Prompts
from mlx_serve import quantized_rows
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest

LENGTHS = (1500, 2600, 300)
TOKENS = 12


def mlx_lm_tokens(model, prompt: list[int]) -> list[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=TOKENS)
    return [int(token) for (token, _), _ in zip(steps, range(TOKENS))]


def our_tokens(
    dummy, prompts: list[list[int]], compile_decode: str, fuse_decode: str, fuse_mixed: str = "auto",
    compile_mixed: str = "auto", **engine: str,
) -> list[list[int]]:  # fmt: skip
    config = EngineConfig(
        model="check", kv_blocks=1024, decode_attention="auto", row_ceiling=1024, compile_decode=compile_decode,
        fuse_decode=fuse_decode, fuse_mixed=fuse_mixed, compile_mixed=compile_mixed, **engine,
    )  # fmt: skip
    engine = Engine.from_model(dummy.model, dummy.tokenizer, dummy.config, config)
    try:
        requests = [
            GenerationRequest(prompt_ids=tuple(p), max_tokens=TOKENS, ignore_eos=True) for p in prompts
        ]
        return [list(c.token_ids) for c in engine.generate(requests)]
    finally:
        engine.shutdown()


def agreement(
    dtype: str, compile_decode: str = "auto", fuse_decode: str = "auto", fuse_mixed: str = "auto",
    compile_mixed: str = "auto", shape: str = "tiny", **engine: str,
) -> tuple[float, float]:  # fmt: skip
    """`engine`: further EngineConfig settings (split_quantized_k, chunk_attention)."""
    dummy = build_dummy_model(shape, dtype, seed=3)
    prompts = [Prompts(dummy.config["vocab_size"], seed=n).one(n) for n in LENGTHS]
    theirs = [mlx_lm_tokens(dummy.peer_model, p) for p in prompts]
    ours = our_tokens(dummy, prompts, compile_decode, fuse_decode, fuse_mixed, compile_mixed, **engine)
    same = sum(a == b for t, o in zip(theirs, ours) for a, b in zip(t, o)) / (TOKENS * len(prompts))
    first = sum(t[0] == o[0] for t, o in zip(theirs, ours)) / len(prompts)
    print(
        f"{shape} {dtype}, compile {compile_decode}, fuse {fuse_decode}, mixed {fuse_mixed}, "
        f"compiled mixed {compile_mixed} {engine}: tokens agree {same:.0%}, first tokens {first:.0%}; "
        f"ours {ours[0][:6]} theirs {theirs[0][:6]}"
    )
    return same, first


def main() -> int:
    same32, _ = agreement("float32")  # defaults: on CUDA, steps with prefill through the fused forward too
    fused_mixed32, _ = agreement("float32", "auto", "auto", "on", "on", defer_mixed_traces=False)  # ... compiled
    eager_mixed32, _ = agreement("float32", "auto", "auto", "off")  # steps with prefill through mlx-lm's modules
    unfused32, _ = agreement("float32", "auto", "off", "off")
    eager32, _ = agreement("float32", "off", "off", "off")
    matmul32, _ = agreement("float32", chunk_attention="matmul")  # prefill chunks through two matmuls
    _, first16 = agreement("bfloat16")
    agreement("bfloat16", "auto", "off", "off")
    # 4-bit split over K where slices can be 128 wide (the tiny shape's down_proj; 64-wide slices: MLX is wrong)
    quantized_rows.SPLIT_MIN_WIDTH = 128
    _, first_split = agreement("bfloat16", shape="tiny-4bit")
    _, first_split_all = agreement("bfloat16", "on", "on", "on", shape="tiny-4bit", split_quantized_k="all")
    firsts = min(first16, first_split, first_split_all)
    ok = min(same32, fused_mixed32, eager_mixed32, unfused32, eager32, matmul32) >= 0.9 and firsts >= 2 / 3
    print("engine check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
