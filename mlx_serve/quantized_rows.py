"""Quantized linears over ragged rows: `[T, 1, D]` becomes one `[1, T, D]` matrix.

mlx-lm's quantized layers see a step's rows as T batch elements of one row each, and MLX's quantized matmul
then runs a matrix-vector kernel per row, reading the packed weights once per row. Folding the rows into one
matrix runs one quantized GEMM that reads them once (what mlx-lm's own prefill does with its `[1, L, D]`).

A folded linear can also hold its packed weights split over K (`split_k`): MLX's CUDA quantized GEMM runs one
thread block per 128 output columns, so a 4096-wide projection of a decode step fills 32 of the H200's 132 SMs
and reads its weights at a fraction of the bandwidth; as `splits` slices of K it runs as one batched product with
`splits` times the blocks, summed over the slices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# MLX's CUDA quantized GEMM (`qmm_sm80`, MLX 0.32): output columns per thread block, and rows per output tile from
# 33 rows up (the scheduler's row tile for quantized models, `engine_setup.row_quantum`)
QMM_BLOCK_COLUMNS = 128
QMM_ROW_TILE = 64
SPLIT_TARGET_BLOCKS = 256  # thread blocks a split product should reach (the H200 has 132 SMs)
SPLIT_MIN_WIDTH = 512  # narrowest K slice `k_splits_for` makes
SPLIT_MOST = 8  # most K slices `k_splits_for` makes (8 against 4: 790 against 747 tok/s, 8B 4-bit, 8 streams)
# MLX 0.32's CUDA quantized GEMM returns wrong sums (NaN, or 100% off) over a batch of 64-wide K slices; 128 and
# wider were exact (H200, bf16 and float32, 128 and 4,096 columns): no slice is ever narrower, whatever the floor
QMM_MIN_SLICE_WIDTH = 128
# products of this many rows or more run through `quantized_tiles` where one is given (qmm_sm80 takes 64-row
# tiles from 33 rows, where its cost per row jumps)
TILES_FROM_ROWS = 33



@dataclass(frozen=True, slots=True)
class QuantizedTiles:
    """A product for quantized linears of many rows, and which linears it takes."""

    # (x [M, K], packed weight [N, K / 8] or [S, N, K / S / 8], scales, biases, group size, bits) -> x @ W.T
    matmul: Callable[[mx.array, mx.array, mx.array, mx.array, int, int], mx.array]
    fits: Callable[[nn.Module], bool]


@dataclass(frozen=True, slots=True)
class QuantizedGemv:
    """A product for quantized linears of a few rows (a decode step's), and which linears it takes."""

    # (x [M, K] with M <= most_rows, packed weight [N, K / 8] or [S, N, K / S / 8], scales, biases, group size)
    matmul: Callable[[mx.array, mx.array, mx.array, mx.array, int], mx.array]
    most_rows: int
    fits: Callable[[nn.Module], bool]


class RowsQuantizedLinear(nn.QuantizedLinear):
    gemv: QuantizedGemv | None = None  # how products of at most `gemv.most_rows` rows run (None: as the rest)
    dequantize_from = 0  # rows from which a product runs over the dequantized weights (`DequantizedRows`); 0: never
    k_splits = 1  # > 1: weight, scales and biases held as `[k_splits, out, in / k_splits]` slices of K (`split_k`)
    tiles: QuantizedTiles | None = None  # how products of `TILES_FROM_ROWS` rows or more run (None: as the rest)

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        # an explicit --dequantize-rows is the user's choice: it goes before the tiles' auto default
        if self.dequantize_from and rows >= self.dequantize_from and self.get("global_scale") is None:
            return _dense_product(self, x)
        if self.gemv is not None and rows <= self.gemv.most_rows and x.dtype == self["scales"].dtype:
            return self._flat_product(x, self.gemv.matmul(x.reshape(rows, x.shape[-1]), *self._packed()))
        if self.tiles is not None and rows >= TILES_FROM_ROWS:
            return self._flat_product(x, self.tiles.matmul(x.reshape(rows, x.shape[-1]), *self._packed(), self.bits))
        if self.k_splits > 1:
            return self._split_product(x)
        if x.ndim == 3 and x.shape[1] == 1 and x.shape[0] > 1:
            rows = x.shape[0]
            return super().__call__(x.reshape(1, rows, x.shape[2])).reshape(rows, 1, -1)
        return super().__call__(x)

    def _packed(self) -> tuple[mx.array, mx.array, mx.array, int]:
        return self["weight"], self["scales"], self["biases"], self.group_size

    def _flat_product(self, x: mx.array, y: mx.array) -> mx.array:
        """`y`, the product of `x`'s rows as one `[rows, in]` matrix, plus the bias, in `x`'s leading shape."""
        y = y + self["bias"] if "bias" in self else y
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _split_product(self, x: mx.array) -> mx.array:
        """`x @ W.T` as one batched product over the K slices (`[splits, rows, in / splits]`), summed."""
        lead, width = x.shape[:-1], x.shape[-1]
        slices = x.reshape(-1, self.k_splits, width // self.k_splits).swapaxes(0, 1)
        y = mx.quantized_matmul(
            slices, self["weight"], scales=self["scales"], biases=self.get("biases"), transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode,
        ).sum(axis=0)  # fmt: skip
        if "bias" in self:
            y = y + self["bias"]
        return y.reshape(*lead, y.shape[-1])


def k_splits_for(out_dims: int, in_dims: int, group_size: int) -> int:
    """How many K slices give a product of `out_dims` columns `SPLIT_TARGET_BLOCKS` thread blocks, keeping each
    slice a whole number of 128-wide K tiles and quantization groups and at least `SPLIT_MIN_WIDTH` wide.
    Measured on the H200 (8B 4-bit, a 4096 x 12288 down projection of 8 rows, one layer after another): 0.210 ms
    whole, 0.133 / 0.094 / 0.082 ms in 2 / 4 / 8 slices (`python -m benchmarks.gpu.bench_quantized --projections`)."""
    tile, splits = max(QMM_MIN_SLICE_WIDTH, group_size), 1
    while splits < SPLIT_MOST and (out_dims // QMM_BLOCK_COLUMNS) * splits < SPLIT_TARGET_BLOCKS:
        width = in_dims // (2 * splits)
        if in_dims % (2 * splits) or width < SPLIT_MIN_WIDTH or width % tile:
            break
        splits *= 2
    return splits


def split_k(module: RowsQuantizedLinear, splits: int) -> None:
    """Re-lay `module`'s packed weight, scales and biases as `splits` contiguous slices of K, in place (no copy is
    kept); the module then sums a batched product over them."""
    if module.k_splits != 1 or splits == 1:
        return
    for name in ("weight", "scales", "biases"):
        if name in module:
            array = module[name]
            setattr(module, name, mx.contiguous(array.reshape(array.shape[0], splits, -1).swapaxes(0, 1)))
    module.k_splits = splits
    mx.eval(module.parameters())


def split_where_worth_it(module: Any) -> int:
    """Split a folded, affine-quantized, not yet split linear over K as `k_splits_for` says; returns its slices
    (1: left whole)."""
    if type(module) is not RowsQuantizedLinear or module.k_splits != 1 or "biases" not in module:
        return 1
    if module.get("global_scale") is not None:
        return 1
    out_dims, in_dims = module.weight.shape[0], module.scales.shape[-1] * module.group_size
    split_k(module, k_splits_for(out_dims, in_dims, module.group_size))
    return module.k_splits


def split_standalone_projections(model: Any, shared: set[int]) -> int:
    """Split over K (`split_where_worth_it`) every quantized linear of `model` whose id is not in `shared` (the
    projections whose arrays the fused forward's q/k/v and gate/up views share: re-laying those alone would keep
    both layouts); returns how many it split."""
    modules = [module for _, module in model.named_modules() if id(module) not in shared]
    return sum(split_where_worth_it(module) > 1 for module in modules)


def fold_quantized_rows(
    model: Any, dequantize_from: int = 0, tiles: QuantizedTiles | None = None, gemv: QuantizedGemv | None = None
) -> int:
    """Make the model's quantized linears fold rows, run products of `dequantize_from` rows or more (0: never)
    over their dequantized weights, those of `TILES_FROM_ROWS` or more through `tiles` and those of at most
    `gemv.most_rows` through `gemv`, each where it takes the linear's quantization; returns how many fold rows now
    (an earlier engine's included)."""
    folded = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            module.__class__ = RowsQuantizedLinear
        if type(module) is RowsQuantizedLinear:
            module.dequantize_from = dequantize_from
            module.tiles = tiles if tiles is not None and tiles.fits(module) else None
            module.gemv = gemv if gemv is not None and gemv.fits(module) else None
            folded += 1
    return folded


def affine_with_biases(module: nn.Module) -> bool:
    return getattr(module, "mode", "affine") == "affine" and "biases" in module and module.get("global_scale") is None


def reference_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                     bits: int) -> mx.array:  # fmt: skip
    """What the `quantized_tiles` kernel computes, in MLX ops on any backend: `x @ dequantize(W).T` (the weights
    rounded to the activation dtype first, as the kernel and MLX's quantized GEMM round them)."""
    return x @ _dequantized(weight, scales, biases, group_size, bits).astype(x.dtype).T


REFERENCE_TILES = QuantizedTiles(reference_matmul, affine_with_biases)  # the kernel's stand-in off CUDA (tests)


def _reference_gemv(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> mx.array:
    return reference_matmul(x, weight, scales, biases, group_size, 4)


def _affine_4bit(module: nn.Module) -> bool:
    return affine_with_biases(module) and module.bits == 4


GEMV_MOST_ROWS = 8  # the `quantized_gemv` kernel's most rows (a full lane bucket of a small decode batch)
REFERENCE_GEMV = QuantizedGemv(_reference_gemv, GEMV_MOST_ROWS, _affine_4bit)  # the kernel's stand-in off CUDA


class DequantizedRows:
    """Quantized projections of a step with at least `min_rows` rows as one dense matmul over the dequantized
    weights (weights read packed once, written and read once dense), the rest as mlx-lm's quantized matmul.

    On the H200 MLX's 4-bit matmul costs grow linearly with rows (0.038 / 0.064 / 0.119 ms for 1 / 2 / 4 rows of a
    4096 x 12288 projection, bf16 0.033-0.044 ms at any of them), so decode steps of many lanes pay a packed read
    per row, and a 2k-row prefill chunk runs at a third of the bf16 model's speed. Exact on the CPU in float32; in
    bf16 the weights round to bf16 once, as MLX's own quantized matmul rounds them, so products differ from
    mlx-lm's only in the order of their sums: opt-in (`--dequantize-rows`). The runner's quantized linears decide
    for themselves with the same threshold (`fold_quantized_rows`); this class serves what is not such a linear (a
    tied embedding's output).
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
    return _dequantized(module["weight"], module["scales"], module.get("biases"), module.group_size, module.bits,
                        module.mode)  # fmt: skip


def _dequantized(weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
                 mode: str = "affine") -> mx.array:  # fmt: skip
    """The dense `[out, in]` weight of packed arrays, whole or split over K (`split_k`'s `[splits, out, in /
    splits]`, put back in order); on CUDA by the `dequantize` kernel where it takes them (equal, ~4x faster)."""
    from mlx_serve.kernels import dequantize
    from mlx_serve.kernels.paged_attention import cuda_available

    if cuda_available() and dequantize.supports(weight, scales, biases, group_size, bits, mode):
        return dequantize.dequantize_4bit(weight, scales, biases, group_size)
    dense = mx.dequantize(weight, scales, biases, group_size, bits, mode=mode)
    return dense.swapaxes(0, 1).reshape(dense.shape[1], -1) if dense.ndim == 3 else dense
