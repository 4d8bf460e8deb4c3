"""Micro-benchmark of decode attention over paged KV on the GPU: the CUDA kernel against the pure-MLX paths.

Times one decode step's attention for every layer (36 calls, Qwen3-8B: 32 heads, 8 KV heads x 128) and, as the
yardstick, mlx-lm's way: one SDPA over a contiguous `[lanes, kv_heads, L, D]` cache. Prints a table; with
`--out FILE` also writes the numbers as JSON.

    python benchmarks/gpu/bench_kernel.py --out $OUT/kernel_bench.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import mlx.core as mx

from mlx_serve.kernels.paged_attention import batched_decode_attention, paged_decode_attention
from mlx_serve.kernels.synthetic import random_decode_problem
from mlx_serve.ragged import reference_decode_attention

LAYERS = 36
SHAPES = [(32, 1024), (1, 1024), (8, 1024), (64, 1024), (64, 4096), (8, 16384)]  # (lanes, history)
PATHS = {
    "kernel": functools.partial(paged_decode_attention, blockwise=False),
    "blockwise": functools.partial(paged_decode_attention, blockwise=True),
    "batched": batched_decode_attention,
    "reference": reference_decode_attention,
}


def time_ms(fn, repeats: int = 10) -> float:
    mx.eval(fn())  # warm-up: JIT compilation and allocation stay out of the numbers
    mx.eval(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def bench_shape(lanes: int, history: int, paths: list[str]) -> dict:
    p = random_decode_problem([history] * lanes, 8, 4, 128, 16, dtype=mx.bfloat16, seed=lanes + history)
    mx.eval(p.queries, p.pool_keys, p.pool_values)
    kv_bytes = lanes * history * 8 * 128 * 2 * 2 * LAYERS
    row = {"lanes": lanes, "history": history, "kv_gb_per_step": kv_bytes / 1e9}
    for name in paths:
        fn = PATHS[name]
        row[f"{name}_ms"] = time_ms(
            lambda fn=fn: [fn(p.queries, p.pool_keys, p.pool_values, p.rows, p.scale) for _ in range(LAYERS)]
        )
    # mlx-lm's decode: SDPA over a dense cache of the same length
    keys = mx.random.normal((lanes, 8, history, 128)).astype(mx.bfloat16)
    values = mx.random.normal((lanes, 8, history, 128)).astype(mx.bfloat16)
    mx.eval(keys, values)
    row["contiguous_sdpa_ms"] = time_ms(
        lambda: [
            mx.fast.scaled_dot_product_attention(p.queries, keys, values, scale=p.scale)
            for _ in range(LAYERS)
        ]
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for lanes, history in SHAPES:
        paths = ["kernel", "blockwise"] + (["batched", "reference"] if lanes * history <= 8 * 1024 else [])
        rows.append(bench_shape(lanes, history, paths))
        print(json.dumps(rows[-1]), flush=True)
    print(
        f"\nattention of one decode step, {LAYERS} layers, 32 heads / 8 KV heads x 128, bf16 (ms, median of 10)"
    )
    names = ["kernel", "blockwise", "batched", "reference", "contiguous_sdpa"]
    print("| lanes x history | " + " | ".join(names) + " | best kernel TB/s |")
    print("|---|" + "---|" * (len(names) + 1))
    for r in rows:
        cells = " | ".join(f"{r[n + '_ms']:.2f}" if n + "_ms" in r else "-" for n in names)
        best = min(r["kernel_ms"], r["blockwise_ms"])
        print(f"| {r['lanes']} x {r['history']} | {cells} | {r['kv_gb_per_step'] / best:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


def variants(spec: str) -> list[dict[str, int]]:
    """`--variants` text: variants split by `;`, each `NAME=value` pairs split by `,` (e.g. `PIPE=2;PIPE=3,THREADS=128`)."""
    return [{k: int(v) for k, v in (pair.split("=") for pair in variant.split(","))} for variant in spec.split(";") if variant]


if __name__ == "__main__":
    main()

