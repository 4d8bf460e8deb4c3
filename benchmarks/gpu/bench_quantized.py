"""Micro-benchmark of MLX's quantized matmul on the GPU by row count: what decode lanes of a 4-bit model cost.

One Qwen3-8B MLP-sized projection (4096 -> 12288, 4-bit, group 64) against the same in bf16, for M rows given
as one `[1, M, K]` matrix (how the runner folds a step's rows), as `[M, 1, K]` (how mlx-lm batches decode), and
dequantized to a dense matmul (`DequantizedRows`, `--dequantize-rows`); up to 2,048 rows, a prefill chunk.

    python -m benchmarks.gpu.bench_quantized
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn

from benchmarks.gpu.bench_kernel import time_ms
from mlx_serve.quantized_rows import DequantizedRows

K, N, CALLS = 4096, 12288, 36


def main() -> None:
    dense = nn.Linear(K, N, bias=False)
    dense.weight = mx.random.normal((N, K)).astype(mx.bfloat16) * 0.02
    quant = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4)
    mx.eval(dense.parameters(), quant.parameters())
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


if __name__ == "__main__":
    main()
