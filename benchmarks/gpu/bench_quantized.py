"""Micro-benchmark of MLX's quantized matmul on the GPU by row count: what decode lanes of a 4-bit model cost.

One Qwen3-8B MLP-sized projection (4096 -> 12288, 4-bit, group 64) against the same in bf16, for M rows given
as one `[1, M, K]` matrix (how the runner folds a step's rows), as `[M, 1, K]` (how mlx-lm batches decode), and
dequantized to a dense matmul (`DequantizedRows`, `--dequantize-rows`); up to 2,048 rows, a prefill chunk.

    python -m benchmarks.gpu.bench_quantized
    python -m benchmarks.gpu.bench_quantized --projections   # every 8B projection the fused decode step runs
    python -m benchmarks.gpu.bench_quantized --tiles   # the quantized-tiles kernel against MLX's 4-bit GEMM, by rows
    python -m benchmarks.gpu.bench_quantized --gemv   # the GEMV kernel against MLX's 4-bit matmul, 1-8 rows

The second form looks for the 4-bit 8-lane decode step's missing time (16.6 ms against 7.7 for bf16 8B in the
seventh run, though the 4096x12288 product of 8 rows costs what bf16 does when one layer is called 36 times, its
packed weights then served from L2): each projection of the fused 8B forward (and the LM head) over distinct
layers, rows given as the fused forward gives them (`[M, K]`), bf16 against 4-bit and 4-bit split over K. MLX's
4-bit GEMM (`qmm_sm80`) runs one thread block per 128 output columns, so a 4096-wide projection gets 32 blocks on
132 SMs; a batched product over K slices gets `splits` times as many.
"""

from __future__ import annotations

import argparse
import functools
import json

import mlx.core as mx
import mlx.nn as nn

from benchmarks.gpu.bench_kernel import time_ms, variants
from mlx_serve.kernels.dequantize import dense_matmul, dequantize_4bit
from mlx_serve.kernels.quantized_gemv import quantized_gemv
from mlx_serve.kernels.quantized_tiles import quantized_tiles_matmul
from mlx_serve.quantized_rows import DequantizedRows, k_splits_for, reference_matmul

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


def _split_k(quant: nn.QuantizedLinear, splits: int) -> tuple[mx.array, mx.array, mx.array]:
    """The packed weight, scales and biases as `splits` contiguous slices of K: `[splits, N, K / splits / ...]`."""
    n = quant.weight.shape[0]
    parts = (quant.weight, quant.scales, quant.biases)
    return tuple(mx.contiguous(a.reshape(n, splits, -1).transpose(1, 0, 2)) for a in parts)


def _split_k_product(x: mx.array, sliced: tuple[mx.array, mx.array, mx.array], splits: int) -> mx.array:
    """`x @ W.T` as one batched quantized matmul over K slices (splits x more thread blocks), summed over slices."""
    m, k = x.shape
    xs = x.reshape(m, splits, k // splits).transpose(1, 0, 2)
    return mx.quantized_matmul(xs, *sliced, transpose=True, group_size=64, bits=4).sum(axis=0)


def projections() -> None:
    """Each projection as `calls` distinct layers called one after another (each call's input waits for the
    previous call's output, as in a forward pass: independent calls would run side by side in MLX's CUDA graph and
    hide a kernel that fills few SMs; a 4-bit layer fits the H200's 50 MB L2, so the layers are distinct), bf16
    against 4-bit, and 4-bit split over K."""
    for name, k, n in PROJECTIONS:
        for row in _projection_rows(name, k, n):
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def _chained(x: mx.array, products: list) -> list[mx.array]:
    """`products` applied in turn, each input scaled by a zero-weighted element of the previous output (one
    elementwise kernel, the same for every variant) so that the calls run in sequence."""
    outputs = []
    for product in products:
        y = product(x)
        outputs.append(y)
        x = x * (1 + 0 * y[:1, :1])
    return outputs


def _projection_rows(name: str, k: int, n: int):
    calls = 4 if name == "lm_head" else CALLS
    layers = [_layers(k, n) for _ in range(calls)]
    splits = [s for s in (2, 4, 8) if name != "lm_head" and (k // s) % 64 == 0]
    sliced = {s: [_split_k(quant, s) for _, quant in layers] for s in splits}
    mx.eval(sliced)
    for m in (8, 16, 32, 64):
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        mx.eval(x)
        row = {
            "projection": name, "rows": m, "distinct_layers": calls,
            "bf16_ms": time_ms(lambda x=x: _chained(x, [dense for dense, _ in layers])) / calls,
            "q4_ms": time_ms(lambda x=x: _chained(x, [quant for _, quant in layers])) / calls,
        }  # fmt: skip
        for s in splits:
            products = [functools.partial(_split_k_product, sliced=parts, splits=s) for parts in sliced[s]]
            row[f"q4_split{s}_ms"] = time_ms(lambda x=x, products=products: _chained(x, products)) / calls
        yield row


def tiles(rows: tuple[int, ...], first: bool = True) -> None:
    """Each 8B projection over 36 distinct layers, chained, by rows: bf16, MLX's 4-bit GEMM whole and split over K
    in 8 slices (as the engine lays o_proj and down_proj), and the quantized-tiles kernel over both layouts (only
    the kernel's when not `first`), the dense product over the dequantize kernel's weights and that kernel alone
    (split layout), with the largest errors against dequantize-then-matmul."""
    for name, k, n in PROJECTIONS[:4]:
        layers = [_layers(k, n) for _ in range(CALLS)]
        sliced = [_split_k(quant, 8) for _, quant in layers]
        mx.eval(sliced)
        for m in rows:
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            mx.eval(x)
            kernel = [functools.partial(_tiles, quant=quant) for _, quant in layers]
            kernel_split = [functools.partial(_tiles_split, parts=parts) for parts in sliced]
            dense_split = [functools.partial(_dense_split, parts=parts) for parts in sliced]
            dequantized = [functools.partial(_dequantize_split, parts=parts) for parts in sliced]
            split = [functools.partial(_split_k_product, sliced=parts, splits=8) for parts in sliced]
            quant = layers[0][1]
            want = reference_matmul(x, quant.weight, quant.scales, quant.biases, quant.group_size, 4)
            row = {"projection": name, "rows": m, "distinct_layers": CALLS,
                   "tiles_max_rel_err": (mx.abs(kernel[0](x) - want).max() / mx.abs(want).max()).item(),
                   "tiles_split8_max_rel_err": (mx.abs(kernel_split[0](x) - want).max() / mx.abs(want).max()).item(),
                   "dense_split8_max_rel_err": (mx.abs(dense_split[0](x) - want).max() / mx.abs(want).max()).item()}  # fmt: skip
            peers = (("bf16", [dense for dense, _ in layers]), ("q4", [q for _, q in layers]), ("q4_split8", split))
            for variant, products in (peers if first else ()) + (
                ("tiles", kernel), ("tiles_split8", kernel_split), ("dense_split8", dense_split),
                ("dequantize_split8", dequantized),
            ):  # fmt: skip
                row[f"{variant}_ms"] = time_ms(lambda x=x, products=products: _chained(x, products)) / CALLS
            row["tiles_tflops"] = 2 * m * n * k / row["tiles_ms"] / 1e9
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def _tiles(x: mx.array, quant: nn.QuantizedLinear) -> mx.array:
    return quantized_tiles_matmul(x, quant.weight, quant.scales, quant.biases, quant.group_size)


def _tiles_split(x: mx.array, parts: tuple[mx.array, mx.array, mx.array]) -> mx.array:
    return quantized_tiles_matmul(x, *parts, 64)


def _dense_split(x: mx.array, parts: tuple[mx.array, mx.array, mx.array]) -> mx.array:
    return dense_matmul(x, *parts, 64)


def _dequantize_split(x: mx.array, parts: tuple[mx.array, mx.array, mx.array]) -> mx.array:
    return dequantize_4bit(*parts, 64)  # the dequantization alone (its input only orders the chain)


def gemv(rows: tuple[int, ...]) -> None:
    """Each 8B projection over distinct layers, chained, at decode's rows: the GEMV kernel against MLX's 4-bit
    matmul, over the whole weight and, where `k_splits_for` splits it, over its K slices (MLX's then as the engine
    runs it: one batched product, summed). Per call: ms, GB/s of packed weights, scales and biases, MLX's time over
    ours, and the largest difference from MLX's answer (MLX rounds each weight to bf16, the kernel does not)."""
    for name, k, n in PROJECTIONS:
        calls = 4 if name == "lm_head" else CALLS
        quants = [quant for _, quant in (_layers(k, n) for _ in range(calls))]
        layouts = {1: [(q.weight, q.scales, q.biases) for q in quants]}
        splits = k_splits_for(n, k, 64)
        if splits > 1:
            layouts[splits] = [_split_k(q, splits) for q in quants]
        mx.eval(list(layouts.values()))
        gigabytes = sum(a.nbytes for a in layouts[1][0]) / 1e9
        for m in rows:
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            mx.eval(x)
            for slices, parts in layouts.items():
                ours = [functools.partial(_gemv, parts=p) for p in parts]
                mlx = [functools.partial(_mlx_product, parts=p, splits=slices) for p in parts]
                row = {"projection": name, "rows": m, "splits": slices, "distinct_layers": calls,
                       "gemv_ms": time_ms(lambda x=x, f=ours: _chained(x, f)) / calls,
                       "mlx_ms": time_ms(lambda x=x, f=mlx: _chained(x, f)) / calls}  # fmt: skip
                for path in ("gemv", "mlx"):
                    row[f"{path}_gb_s"] = gigabytes / row[f"{path}_ms"] * 1e3
                row["mlx_over_gemv"] = row["mlx_ms"] / row["gemv_ms"]
                diff = ours[0](x).astype(mx.float32) - mlx[0](x).astype(mx.float32)
                row["max_abs_diff"] = mx.abs(diff).max().item()
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def _gemv(x: mx.array, parts: tuple[mx.array, mx.array, mx.array]) -> mx.array:
    return quantized_gemv(x, *parts, 64)


def _mlx_product(x: mx.array, parts: tuple[mx.array, mx.array, mx.array], splits: int) -> mx.array:
    if splits > 1:
        return _split_k_product(x, parts, splits)
    return mx.quantized_matmul(x, *parts, transpose=True, group_size=64, bits=4)


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
    parser.add_argument("--tiles", action="store_true", help="the quantized-tiles kernel against MLX's GEMM")
    parser.add_argument("--gemv", action="store_true", help="the GEMV kernel against MLX's 4-bit matmul, 1-8 rows")
    parser.add_argument("--rows", default=None, help="row counts for --tiles (8,...,2048) or --gemv (1,2,4,8)")
    parser.add_argument("--variants", default="", help="--tiles / --gemv: the kernel module's constants set in "
                        "turn, e.g. 'PIPE=2;PIPE=3,TARGET_BLOCKS=396' (default: as the module has them)")
    parser.add_argument("--no-peers", action="store_true", help="--tiles: leave out bf16 and MLX's 4-bit GEMM")
    args = parser.parse_args()
    if args.gemv:
        from mlx_serve.kernels import quantized_gemv as module

        for variant in variants(args.variants) or [{}]:
            for name, value in variant.items():
                setattr(module, name, value)
            print(json.dumps({"variant": variant}), flush=True)
            gemv(tuple(int(r) for r in (args.rows or "1,2,4,8").split(",")))
    elif args.tiles:
        from mlx_serve.kernels import quantized_tiles

        for number, variant in enumerate(variants(args.variants) or [{}]):
            for name, value in variant.items():
                setattr(quantized_tiles, name, value)
            print(json.dumps({"variant": variant}), flush=True)
            rows = args.rows or "8,16,32,33,64,128,256,512,2048"
            tiles(tuple(int(r) for r in rows.split(",")), first=number == 0 and not args.no_peers)
    else:
        projections() if args.projections else by_rows()


if __name__ == "__main__":
    main()
