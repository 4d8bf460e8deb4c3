"""Does a kernel input that the host made (MLX's CUDA backend keeps such arrays in managed memory, and arrays of
8 bytes or less in one shared managed pool) slow the kernels that read it, against the same values copied to
device memory by a GPU op?

Two chains as a decode step runs them, timed end to end (ms a call): 72 residual-add + RMSNorm kernels over a
`[rows, 4096]` bf16 activation whose `eps` is a cached host scalar or a device copy; and 36 kernels that each read
a fresh per-step index array (as the paged attention reads block tables and lengths) made on the host, or copied
to the device once per step. With `--churn`, the host makes and reads back small arrays while each chain runs,
as the engine does when it builds the next step and reads the previous step's tokens.

    python -m benchmarks.gpu.bench_managed
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time

import mlx.core as mx
import mlx.nn as nn

from mlx_serve.kernels.add_norm import ADD_NORM_SOURCE, THREADS
from mlx_serve.kernels.paged_attention_cuda import HEADER

READ_INDEX_SOURCE = r"""
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) y[i] = x[i] + (T)(idx[i % M]);
"""


def device_copy(values: mx.array) -> mx.array:
    """The values in device memory: a GPU op's output of more than 8 bytes, sliced back to its length."""
    n = values.size
    padded = mx.concatenate([values, mx.zeros((max(4 - n, 0),), values.dtype)]) if n < 4 else values
    return (padded + 0)[:n]


def _time(fn, repeats: int = 30) -> float:
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


def add_norm_chain(rows: int, eps: mx.array, calls: int = 72) -> float:
    kernel = mx.fast.cuda_kernel("bench_add_norm", ["x", "r", "weight", "eps"], ["h", "y"], ADD_NORM_SOURCE,
                                 header=HEADER)  # fmt: skip
    norm = nn.RMSNorm(4096)
    norm.weight = mx.ones((4096,), mx.bfloat16)
    x = mx.random.normal((rows, 4096)).astype(mx.bfloat16)
    mx.eval(x, norm.weight)

    def run() -> None:
        h, y = x, x
        for _ in range(calls):
            h, y = kernel(
                inputs=[h, y, norm.weight, eps], template=[("T", mx.bfloat16), ("N", 4096), ("THREADS", THREADS)],
                grid=(rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=[(rows, 4096)] * 2,
                output_dtypes=[mx.bfloat16] * 2,
            )  # fmt: skip
        mx.eval(h, y)

    return _time(run) / calls


def index_chain(device: bool, lanes: int, calls: int = 36) -> float:
    kernel = mx.fast.cuda_kernel("bench_read_index", ["x", "idx"], ["y"], READ_INDEX_SOURCE, header=HEADER)
    x = mx.zeros((lanes * 4096,), mx.float32)
    mx.eval(x)
    step = [0]

    def run() -> None:
        step[0] += 1
        idx = mx.array([step[0] + i for i in range(lanes * 2)], dtype=mx.int32)  # new host values every step
        if device:
            idx = device_copy(idx)
        y = x
        for _ in range(calls):
            (y,) = kernel(
                inputs=[y, idx], template=[("T", mx.float32), ("N", y.size), ("M", idx.size)],
                grid=(y.size, 1, 1), threadgroup=(256, 1, 1), output_shapes=[y.shape], output_dtypes=[mx.float32],
            )  # fmt: skip
        mx.eval(y)

    return _time(run) / calls


class Churn:
    """A host thread that makes small arrays and reads them back, as the engine's next step and token reads do."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            mx.array([i], dtype=mx.int32).item()
            time.sleep(0.0002)

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


COPY_SOURCE = r"""
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) y[i] = x[i];
"""


def custom_against_builtin(rows: int, calls: int = 72) -> dict:
    """ms a call of chains of: a one-line custom copy kernel against MLX's own elementwise op, and our add+norm
    kernel against MLX's add and fast.rms_norm, over `[rows, 4096]` bf16."""
    copy = mx.fast.cuda_kernel("bench_copy", ["x"], ["y"], COPY_SOURCE, header=HEADER)
    x = mx.random.normal((rows, 4096)).astype(mx.bfloat16)
    weight = mx.ones((4096,), mx.bfloat16)
    eps = device_copy(mx.array([1e-6], dtype=mx.float32))
    mx.eval(x, weight, eps)

    def custom_copy() -> None:
        y = x
        for _ in range(calls):
            (y,) = copy(inputs=[y], template=[("N", y.size)], grid=(y.size, 1, 1), threadgroup=(256, 1, 1),
                        output_shapes=[y.shape], output_dtypes=[y.dtype])  # fmt: skip
        mx.eval(y)

    def builtin_copy() -> None:
        y = x
        for _ in range(calls):
            y = y * 1
        mx.eval(y)

    def builtin_add_norm() -> None:
        h, y = x, x
        for _ in range(calls):
            h = h + y
            y = mx.fast.rms_norm(h, weight, 1e-6)
        mx.eval(h, y)

    row = {"rows": rows, "custom_copy_ms": _time(custom_copy) / calls, "builtin_multiply_ms": _time(builtin_copy) / calls,
           "builtin_add_then_rms_norm_ms": _time(builtin_add_norm) / calls, "our_add_norm_ms": add_norm_chain(rows, eps)}  # fmt: skip
    return row


def main() -> None:
    for rows in (1, 8, 64):
        row = custom_against_builtin(rows)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    host_eps = mx.array([1e-6], dtype=mx.float32)
    mx.eval(host_eps)
    device_eps = device_copy(host_eps)
    mx.eval(device_eps)
    for churn in (False, True):
        with Churn() if churn else contextlib.nullcontext():
            for rows in (1, 8):
                row = {"churn": churn, "rows": rows, "add_norm_host_eps_ms": add_norm_chain(rows, host_eps),
                       "add_norm_device_eps_ms": add_norm_chain(rows, device_eps)}  # fmt: skip
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            for lanes in (1, 8):
                row = {"churn": churn, "lanes": lanes, "read_host_index_ms": index_chain(False, lanes),
                       "read_device_index_ms": index_chain(True, lanes)}  # fmt: skip
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
