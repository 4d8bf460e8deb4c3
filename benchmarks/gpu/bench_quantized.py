"""Micro-benchmark of MLX's quantized matmul on the GPU by row count: what decode lanes of a 4-bit model cost.

One Qwen3-8B MLP-sized projection (4096 -> 12288, 4-bit, group 64) against the same in bf16, for M rows given
as one `[1, M, K]` matrix (how the runner folds a step's rows), as `[M, 1, K]` (how mlx-lm batches decode), and
dequantized to a dense matmul (`DequantizedRows`, `--dequantize-rows`); up to 2,048 rows, a prefill chunk.

    python -m benchmarks.gpu.bench_quantized
    python -m benchmarks.gpu.bench_quantized --projections   # every 8B projection the fused decode step runs

The second form looks for the 4-bit 8-lane decode step's missing time (16.6 ms against 7.7 for bf16 8B in the
seventh run, though the 4096x12288 product of 8 rows costs what bf16 does): each projection of the fused 8B
forward (and the LM head), rows given as the fused forward gives them (`[M, K]`), bf16 against 4-bit.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import mlx.nn as nn

from benchmarks.gpu.bench_kernel import time_ms
from mlx_serve.quantized_rows import DequantizedRows

K, N, CALLS = 4096, 12288, 36
# (name, in, out) of Qwen3-8B's products in the fused decode forward
PROJECTIONS = (("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 24576), ("down_proj", 12288, 4096),
               ("lm_head", 4096, 151936))  # fmt: skip


def _layers(k: int, n: int) -> tuple[nn.Linear, nn.QuantizedLinear]:
    dense = nn.Linear(k, n, bias=False)
    dense.weight = mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02
    quant = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4)
    mx.eval(dense.parameters(), quant.parameters())
    return dense, quant


def projections() -> None:
    for name, k, n in PROJECTIONS:
        dense, quant = _layers(k, n)
        for m in (1, 8, 32, 64):
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            mx.eval(x)
            row = {
                "projection": name, "rows": m,
                "bf16_ms": time_ms(lambda x=x, f=dense: [f(x) for _ in range(CALLS)]) / CALLS,
                "q4_ms": time_ms(lambda x=x, f=quant: [f(x) for _ in range(CALLS)]) / CALLS,
            }  # fmt: skip
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def by_rows() -> None:
    dense, quant = _layers(K, N)
    dequantized = DequantizedRows(1)
    for m in (1, 2, 4, 8, 16, 32, 64, 256, 1024, 2048):
        x = mx.random.normal((1, m, K)).astype(mx.bfloat16)
        rows = x.reshape(m, 1, K)
        mx.eval(x, rows)
        # dense figures first, on a line of their own: the quantized kernel at 8 rows once outran a 40 s limit
        first = {
            "rows": m,
            "bf16_ms": time_ms(lambda x=x: [dense(x) for _ in range(CALLS)]) / CALLS,
            "q4_dequantized_ms": time_ms(lambda x=x: [dequantized.linear(quant, x[0]) for _ in range(CALLS)]) / CALLS,
        }
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in first.items()}), flush=True)
        second = {
            "rows": m,
            "q4_matrix_ms": time_ms(lambda x=x: [quant(x) for _ in range(CALLS)]) / CALLS,
        }
        if m <= 64:  # decode batches only: mlx-lm's prefill folds rows itself
            second["q4_rows_ms"] = time_ms(lambda rows=rows: [quant(rows) for _ in range(CALLS)]) / CALLS
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in second.items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--projections", action="store_true", help="every 8B projection at 1-64 rows instead")
    projections() if parser.parse_args().projections else by_rows()


if __name__ == "__main__":
    main()
