"""What does the host pay to queue one graph node, by kind? (Is a cuBLAS matmul dearer to encode than a kernel?)

    python -m benchmarks.gpu.bench_node_cost [--nodes 100 --repeats 10 --width 1024]

A warm 0.6B step is ~460 nodes (a mixed one ~690), 113 of them matmuls, and on the H100 its submission (6.5 ms
decode, 10 ms mixed) is mostly MLX's host work. MLX 0.32 runs every matmul of more than one row through cuBLASLt:
per call it builds the matmul's descriptors, asks cuBLASLt's heuristic for an algorithm and captures the launch into
a child graph (thirty-eighth run); a `mx.fast.cuda_kernel` node is one kernel node. This queues a chain of `--nodes`
nodes of one kind at a time and times `mx.async_eval` (the host's encode) with nothing in flight, then the chain
on the device, and prints one JSON object: each kind's host microseconds a node and device microseconds a node.

Kinds: `matmul_rows{1,8,1024}` (`x @ W.T`, 1 row: MLX's GEMV; more: cuBLASLt), `tiles_rows1024` (the same product
through this project's tiled tensor-core GEMM, `expert_tiles` with one expert: CUDA only), `elementwise` (`x * c`,
one MLX kernel), `custom` (a one-line `mx.fast.cuda_kernel`: CUDA only), `view` (a transpose: no kernel).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from mlx_serve.kernels.paged_attention import cuda_available

SCALE_SOURCE = """
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) y[i] = x[i] * static_cast<T>(0.5f);
"""


def _scale_kernel() -> Callable[[mx.array], mx.array]:
    kernel = mx.fast.cuda_kernel("mlx_serve_bench_scale", ["x"], ["y"], SCALE_SOURCE)

    def scale(x: mx.array) -> mx.array:
        threads = 256
        (y,) = kernel(inputs=[x], template=[("T", x.dtype), ("N", x.size)], grid=(-(-x.size // threads) * threads, 1, 1),
                      threadgroup=(threads, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype])  # fmt: skip
        return y

    return scale


def _tiles(weight: mx.array) -> Callable[[mx.array], mx.array]:
    from mlx_serve.kernels.expert_tiles import expert_tiles_matmul

    tile_rows, rows = 64, 1024
    # one expert [1, N, K] and its tile table, made once: each step is then the kernel's node alone
    stacked, tile_expert = weight[None], mx.zeros((rows // tile_rows,), mx.uint32)
    used = mx.array([rows // tile_rows], dtype=mx.int32)
    mx.eval(stacked, tile_expert, used)

    def product(x: mx.array) -> mx.array:
        return expert_tiles_matmul(x, stacked, tile_expert, used, tile_rows)

    return product


def kinds(width: int, on_cuda: bool) -> dict[str, tuple[int, Callable[[mx.array], mx.array]]]:
    """Each kind's rows and the one-node step it chains (`x -> x'` of the same shape)."""
    weight = (mx.random.normal((width, width), key=mx.random.key(0)) * width**-0.5).astype(mx.bfloat16)
    transposed = weight.T
    mx.eval(weight, transposed)  # an evaluated view is a leaf: each product is then one Matmul node, no Transpose
    chosen = {
        "matmul_rows1": (1, lambda x: x @ transposed),
        "matmul_rows8": (8, lambda x: x @ transposed),
        "matmul_rows1024": (1024, lambda x: x @ transposed),
        "elementwise": (8, lambda x: x * 0.5),
        "view": (8, lambda x: x.T),  # [8, width] and [width, 8] in turn
    }
    if on_cuda:
        chosen["custom"] = (8, _scale_kernel())
        chosen["tiles_rows1024"] = (1024, _tiles(weight))
    return chosen


def measure(width: int, nodes: int, repeats: int, on_cuda: bool | None = None) -> dict:
    on_cuda = cuda_available() if on_cuda is None else on_cuda
    result: dict = {"width": width, "nodes": nodes, "repeats": repeats, "cuda": on_cuda}
    for name, (rows, step) in kinds(width, on_cuda).items():
        x0 = mx.random.normal((rows, width), key=mx.random.key(1)).astype(mx.bfloat16)
        mx.eval(x0)
        host, device = [], []
        for _ in range(repeats + 1):  # the first builds kernels and graphs: not counted
            x = x0
            for _ in range(nodes):
                x = step(x)
            mx.synchronize()
            start = time.perf_counter()
            mx.async_eval(x)
            queued = time.perf_counter()
            mx.eval(x)
            done = time.perf_counter()
            host.append(1e6 * (queued - start) / nodes)
            device.append(1e6 * (done - start) / nodes)
        result[name] = {"rows": rows, "host_us_a_node": round(statistics.median(host[1:]), 2),
                        "step_us_a_node": round(statistics.median(device[1:]), 2)}  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="the square weight's side (0.6B's hidden size)")
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(json.dumps(measure(args.width, args.nodes, args.repeats)))


if __name__ == "__main__":
    main()
