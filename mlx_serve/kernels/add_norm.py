"""A residual add and the RMSNorm after it, in one launch: `h = x + r`, `y = rms_norm(h) * weight`.

Both functions return `(h, y)`. `plain_add_norm` is mlx-lm's two ops (the CPU path and the reference);
`kernel_add_norm` is one CUDA block per row that rounds where MLX rounds: the sum to the activation dtype, then
`h * rsqrt(mean(h^2) + eps)` to the dtype before the weight multiply.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_serve.kernels.paged_attention_cuda import HEADER

AddNorm = Callable[[mx.array, mx.array, Any], tuple[mx.array, mx.array]]
THREADS = 256
MAX_WIDTH = 32 * THREADS  # a thread keeps its share of the row (three values an element) in registers

# Template: T (dtype of x, r, weight and the outputs), N (row width), THREADS. Inputs: x, r [rows, N],
# weight [N], eps [1] float32. Outputs: h, y [rows, N]. Grid: one block of THREADS per row.
ADD_NORM_SOURCE = r"""
  constexpr int PER = (N + THREADS - 1) / THREADS;
  constexpr int WARPS = THREADS / 32;
  const size_t row = blockIdx.x;
  const int tid = threadIdx.x;
  // every load is issued before the first store: the compiler may not move a load of x, r or weight past a store
  // to h or y (the pointers may alias), so interleaving them would wait out one memory latency per element
  float xs[PER], rs[PER], ws[PER];
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = tid + i * THREADS;
    xs[i] = e < N ? pa_to_float(x[row * N + e]) : 0.f;
    rs[i] = e < N ? pa_to_float(r[row * N + e]) : 0.f;
    ws[i] = e < N ? pa_to_float(weight[e]) : 0.f;
  }
  const float epsilon = eps[0];
  float ss = 0.f;
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    xs[i] = pa_to_float(pa_from_float<T>(xs[i] + rs[i]));  // the sum rounds to T, as MLX's add does
    ss += xs[i] * xs[i];
  }
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = tid + i * THREADS;
    if (e < N) h[row * N + e] = pa_from_float<T>(xs[i]);
  }
  #pragma unroll
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  __shared__ float partial[WARPS];
  if (tid % 32 == 0) partial[tid / 32] = ss;
  __syncthreads();
  float total = 0.f;
  #pragma unroll
  for (int w = 0; w < WARPS; ++w) total += partial[w];
  const float inv = rsqrtf(total / N + epsilon);
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = tid + i * THREADS;
    if (e < N) y[row * N + e] = pa_from_float<T>(ws[i] * pa_to_float(pa_from_float<T>(xs[i] * inv)));
  }
"""


def plain_add_norm(x: mx.array, r: mx.array, norm: Any) -> tuple[mx.array, mx.array]:
    h = x + r
    return h, norm(h)


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(
        "mlx_serve_add_rms_norm", ["x", "r", "weight", "eps"], ["h", "y"], ADD_NORM_SOURCE, header=HEADER
    )


@functools.lru_cache(maxsize=16)
def _eps(value: float) -> mx.array:
    eps = mx.array([value], dtype=mx.float32)
    mx.eval(eps)
    return eps


def kernel_add_norm(x: mx.array, r: mx.array, norm: Any) -> tuple[mx.array, mx.array]:
    """The CUDA kernel over rows `[T, N]` (`norm` is an `nn.RMSNorm`). Mixed dtypes (which MLX would promote)
    and rows too wide for one block's registers take the plain ops."""
    dtype = x.dtype
    rows, width = x.shape
    floats = (mx.float16, mx.bfloat16, mx.float32)
    if r.dtype != dtype or norm.weight.dtype != dtype or dtype not in floats or width > MAX_WIDTH:
        return plain_add_norm(x, r, norm)
    h, y = _kernel()(
        inputs=[x, r, norm.weight, _eps(float(norm.eps))],
        template=[("T", dtype), ("N", width), ("THREADS", THREADS)],
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, width), (rows, width)],
        output_dtypes=[dtype, dtype],
    )
    return h, y


def select_add_norm() -> AddNorm:
    """The kernel on MLX's CUDA backend, mlx-lm's two ops elsewhere."""
    from mlx_serve.kernels.paged_attention import cuda_available

    return kernel_add_norm if cuda_available() else plain_add_norm
