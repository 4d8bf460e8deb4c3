"""Folding ragged rows into one matrix for quantized linears changes the kernel, not the numbers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_serve.quantized_rows import RowsQuantizedLinear, fold_quantized_rows


def test_folded_rows_equal_row_by_row_results():
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32))
    nn.quantize(model, group_size=32, bits=4)
    x = mx.random.normal((37, 1, 64))
    expected = model(x)
    assert fold_quantized_rows(model) == 2
    assert all(type(layer) is RowsQuantizedLinear for layer in model.layers)
    got = model(x)
    assert got.shape == expected.shape == (37, 1, 32)
    assert mx.array_equal(got, expected)
    single = x[:1]  # one row stays a matrix-vector product, as mlx-lm's own decode
    assert model(single).shape == (1, 1, 32)
