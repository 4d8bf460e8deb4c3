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
    dequantize_from = 0  # rows from which a product runs over the dequantized weights (`DequantizedRows`); 0: never

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if self.dequantize_from and rows >= self.dequantize_from and self.get("global_scale") is None:
            return _dense_product(self, x)
        if x.ndim == 3 and x.shape[1] == 1 and x.shape[0] > 1:
            rows = x.shape[0]
            return super().__call__(x.reshape(1, rows, x.shape[2])).reshape(rows, 1, -1)
        return super().__call__(x)


def fold_quantized_rows(model: Any, dequantize_from: int = 0) -> int:
    """Make the model's quantized linears fold rows, and run products of `dequantize_from` rows or more (0:
    never) over their dequantized weights; returns how many it changed."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            module.__class__ = RowsQuantizedLinear
            changed += 1
        if type(module) is RowsQuantizedLinear:
            module.dequantize_from = dequantize_from
    return changed


class DequantizedRows:
    """Quantized projections of a step with at least `min_rows` rows as one dense matmul over the dequantized
    weights (weights read packed once, written and read once dense), the rest as mlx-lm's quantized matmul.

    On the H200 MLX's 4-bit matmul costs grow linearly with rows (0.038 / 0.064 / 0.119 ms for 1 / 2 / 4 rows of a
    4096 x 12288 projection, bf16 0.033-0.044 ms at any of them), so decode steps of many lanes pay a packed read
    per row, and a 2k-row prefill chunk runs at a third of the bf16 model's speed. Exact on the CPU in float32; in
    bf16 the weights round to bf16 before the product, so greedy tokens can differ from mlx-lm's in the last
    place: opt-in (`--dequantize-rows`). The runner's quantized linears decide for themselves with the same
    threshold (`fold_quantized_rows`); this class serves what is not such a linear (a tied embedding's output).
    """

    def __init__(self, min_rows: int) -> None:
        self.min_rows = min_rows

    def applies(self, module: nn.Module, rows: int) -> bool:
        return (
            self.min_rows > 0
            and rows >= self.min_rows
            and isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
            and module.get("global_scale") is None
        )

    def linear(self, module: nn.Module, x: mx.array) -> mx.array:
        """`module(x)` for a linear over rows `[T, D]`."""
        return _dense_product(module, x) if self.applies(module, x.shape[0]) else module(x)

    def embedding_as_linear(self, embedding: nn.Module, x: mx.array) -> mx.array:
        """`embedding.as_linear(x)` (tied output projections)."""
        if not self.applies(embedding, x.shape[0]):
            return embedding.as_linear(x)
        return x @ _dense_weight(embedding).T


def _dense_product(module: nn.Module, x: mx.array) -> mx.array:
    y = x @ _dense_weight(module).T
    return y + module["bias"] if "bias" in module else y


def _dense_weight(module: nn.Module) -> mx.array:
    return mx.dequantize(
        module["weight"], module["scales"], module.get("biases"), module.group_size, module.bits, mode=module.mode
    )
