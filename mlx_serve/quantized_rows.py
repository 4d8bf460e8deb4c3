"""Quantized linears over ragged rows: `[T, 1, D]` becomes one `[1, T, D]` matrix.

mlx-lm's quantized layers see a step's rows as T batch elements of one row each, and MLX's quantized matmul
then runs a matrix-vector kernel per row, reading the packed weights once per row. Folding the rows into one
matrix runs one quantized GEMM that reads them once (what mlx-lm's own prefill does with its `[1, L, D]`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class RowsQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 3 and x.shape[1] == 1 and x.shape[0] > 1:
            rows = x.shape[0]
            return super().__call__(x.reshape(1, rows, x.shape[2])).reshape(rows, 1, -1)
        return super().__call__(x)


def fold_quantized_rows(model: Any) -> int:
    """Make the model's quantized linears fold rows; returns how many it changed."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            module.__class__ = RowsQuantizedLinear
            changed += 1
    return changed
