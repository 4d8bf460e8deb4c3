"""A prefill chunk's attention over its padded history, MLX's fused SDPA against `MatmulChunkAttention`, by rows.

Each call's queries are the previous call's output, so the calls run one after another as a forward pass's
layers do (independent calls would run side by side in MLX's CUDA graph and hide a kernel that fills few SMs: a
64-row chunk over 8k tokens gives cuDNN 32 thread blocks). Keys and values differ per call (36 layers' worth),
bf16, the bucketed lane's additive mask. Prints ms a call, one JSON line per (shape, rows, history).

    python -m benchmarks.gpu.bench_chunk_attention
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from benchmarks.gpu.bench_kernel import time_ms
from mlx_serve.ragged import MatmulChunkAttention, sdpa_chunk_attention

SHAPES = {"8b": (32, 8, 128), "0.6b": (16, 8, 128)}  # heads, kv heads, head dim
LAYERS = 36


def chained(attention, q: mx.array, layers: list[tuple[mx.array, mx.array]], mask: mx.array, scale: float) -> mx.array:
    for keys, values in layers:
        q = attention(q, keys, values, scale, mask)
    return q


def measure(shape: str, rows: int, history: int) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    padded = history + 128
    q = mx.random.normal((1, heads, rows, head_dim)).astype(mx.bfloat16)
    layers = [
        (mx.random.normal((1, kv_heads, padded, head_dim)).astype(mx.bfloat16),
         mx.random.normal((1, kv_heads, padded, head_dim)).astype(mx.bfloat16))
        for _ in range(LAYERS)
    ]  # fmt: skip
    query_pos = mx.arange(history - rows, history)[:, None]
    visible = mx.arange(padded)[None, :] <= query_pos
    mask = mx.where(visible, mx.array(0, mx.bfloat16), mx.array(-1e30, mx.bfloat16))[None, None]
    mx.eval(q, layers, mask)
    scale = head_dim**-0.5
    matmul = MatmulChunkAttention(max_rows=1 << 20)
    return {
        "shape": shape, "rows": rows, "history": history,
        "sdpa_ms": time_ms(lambda: chained(sdpa_chunk_attention, q, layers, mask, scale)) / LAYERS,
        "matmul_ms": time_ms(lambda: chained(matmul, q, layers, mask, scale)) / LAYERS,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8b,0.6b")
    parser.add_argument("--rows", default="16,32,64,128,256,512")
    parser.add_argument("--histories", default="2048,8192,16384")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        for history in (int(h) for h in args.histories.split(",")):
            for rows in (int(r) for r in args.rows.split(",")):
                row = measure(shape, rows, history)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
                mx.clear_cache()


if __name__ == "__main__":
    main()
