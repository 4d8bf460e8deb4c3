"""GPU time of a contended step's parts by row count and history length, on Qwen3-8B shapes (bf16).

A step of 8 decode lanes and a 128-row chunk costs ~20 ms on the H200 against 8 for the lanes alone, and only ~2 ms
of it scales with the rows. This times what could be the rest, each as `layers` calls with distinct weights (so
nothing stays in L2, as in a real step): the projections at total row counts around the chunk sizes (a 128-row
chunk beside 8 lanes is 136 rows: a GEMM may tile it as 256), and the chunk's attention (history gather + masked
SDPA) by padded history.

    python -m benchmarks.gpu.bench_step_rows
"""

from __future__ import annotations

import argparse
import functools
import json

import mlx.core as mx

from benchmarks.gpu.bench_kernel import time_ms

LAYERS = 36  # Qwen3-8B's
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
PROJECTIONS = (("qkv", 4096, 6144), ("gate_up", 4096, 24576), ("down_proj", 12288, 4096))
ROWS = (8, 64, 120, 128, 136, 248, 256, 264, 504, 512, 520)
HISTORIES = (8320, 9216, 12288, 16384)


def _products(x: mx.array, weights: list[mx.array]) -> list[mx.array]:
    return [x @ w.T for w in weights]


def _sdpa(q: list[mx.array], kv: list[mx.array], mask: mx.array | str) -> list[mx.array]:
    return [mx.fast.scaled_dot_product_attention(a, b, b, scale=HEAD_DIM**-0.5, mask=mask) for a, b in zip(q, kv)]


def _copies(kv: list[mx.array]) -> list[mx.array]:
    return [mx.contiguous(b[:, :, ::-1]) for b in kv]  # a history gather's traffic, for one of K and V


def projections(rows: tuple[int, ...], layers: int) -> None:
    for name, k, n in PROJECTIONS:
        weights = [(0.02 * mx.random.normal((n, k))).astype(mx.bfloat16) for _ in range(layers)]
        mx.eval(weights)
        for m in rows:
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            mx.eval(x)
            ms = time_ms(functools.partial(_products, x, weights)) / layers
            print(json.dumps({"part": "projection", "name": name, "rows": m, "ms": round(ms, 4),
                              "weight_tb_s": round(n * k * 2 / 1e9 / ms, 2)}), flush=True)  # fmt: skip
        weights = None
        mx.clear_cache()


def attention(rows: int, layers: int) -> None:
    q = [mx.random.normal((1, HEADS, rows, HEAD_DIM)).astype(mx.bfloat16) for _ in range(layers)]
    for history in HISTORIES:
        kv = [mx.random.normal((1, KV_HEADS, history, HEAD_DIM)).astype(mx.bfloat16) for _ in range(layers)]
        mask = mx.zeros((1, 1, rows, history), mx.bfloat16)
        mx.eval(q, kv, mask)
        row = {"part": "attention", "rows": rows, "history": history}
        row["sdpa_masked_ms"] = time_ms(functools.partial(_sdpa, q, kv, mask)) / layers
        row["sdpa_causal_ms"] = time_ms(functools.partial(_sdpa, q, kv, "causal")) / layers
        row["kv_copy_ms"] = time_ms(functools.partial(_copies, kv)) / layers
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        kv = None
        mx.clear_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--chunk", type=int, default=128, help="query rows of the attention part")
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()
    projections(tuple(int(r) for r in args.rows.split(",")), args.layers)
    attention(args.chunk, args.layers)


if __name__ == "__main__":
    main()
