"""Does MLX's CUDA backend hold the host when it submits a graph shaped like the one still running?

    python -m benchmarks.gpu.bench_graph_reuse [--size 8192 --layers 12 --repeats 10]
    MLX_USE_CUDA_GRAPHS=0 python -m benchmarks.gpu.bench_graph_reuse

MLX keys its cache of executable CUDA graphs by node types and edges, not by shapes or buffers, so two steps of
one form share one `cudaGraphExec`, updated and relaunched while its last launch may still run (NVIDIA/cccl#11041
saw CUDA serialise exactly that). The engine submits step n+1 while step n runs, so this times the host's
`mx.async_eval` of a second step while the first still runs: of the same form, of a form with one extra node
(another key), and of the first step's form again once the first step was read back (the engine's pattern with
two forms taken in turn). Prints one JSON object (milliseconds, medians over the repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx


def layers(x: mx.array, weight: mx.array, count: int, extra_node: bool) -> mx.array:
    if extra_node:  # one more kernel node: another key in MLX's graph cache
        x = x * 1.0
    for _ in range(count):
        x = mx.maximum(x @ weight, 0.0) * 0.01
    return x


def submit_ms(x: mx.array) -> float:
    start = time.perf_counter()
    mx.async_eval(x)
    return 1e3 * (time.perf_counter() - start)


def measure(size: int, count: int, repeats: int) -> dict:
    weight = mx.random.normal((size, size)).astype(mx.bfloat16) * 0.01
    inputs = [mx.random.normal((size, size)).astype(mx.bfloat16) for _ in range(3)]
    mx.eval(weight, *inputs)

    def step(index: int, extra_node: bool = False) -> mx.array:
        return layers(inputs[index], weight, count, extra_node)

    for extra_node in (False, True):  # instantiate each form's graph on its own, as the measured steps run
        mx.eval(step(0, extra_node))
    alone, first, same, other, again, device = [], [], [], [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(step(0))
        device.append(1e3 * (time.perf_counter() - start))
        alone.append(submit_ms(y := step(0)))
        mx.eval(y)
        first.append(submit_ms(a := step(0)))
        same.append(submit_ms(b := step(1)))  # a still runs
        mx.eval(a, b)
        submit_ms(a := step(0))
        other.append(submit_ms(c := step(1, extra_node=True)))  # a still runs; another key
        mx.eval(a)
        again.append(submit_ms(d := step(2)))  # c runs; a's exec is idle
        mx.eval(c, d)
    med = lambda v: round(statistics.median(v), 3)  # noqa: E731
    return {
        "size": size,
        "layers": count,
        "repeats": repeats,
        "use_cuda_graphs": os.environ.get("MLX_USE_CUDA_GRAPHS", "1"),
        "device": str(mx.default_device()),
        "step_eval_ms": med(device),
        "submit_alone_ms": med(alone),
        "submit_first_ms": med(first),
        "submit_same_form_while_running_ms": med(same),
        "submit_other_form_while_running_ms": med(other),
        "submit_first_form_after_its_read_back_ms": med(again),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(json.dumps(measure(args.size, args.layers, args.repeats)))


if __name__ == "__main__":
    main()
