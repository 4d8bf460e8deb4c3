"""Affine 4-bit weights to bf16 at memory speed, and the dense product of many rows over them.

Why: a 4-bit product of a prefill chunk's rows costs more through a quantized GEMM than dequantizing the weights
once and running the bf16 GEMM (cuBLAS) over them, from 129 rows (`quantized_tiles.DENSE_FROM_ROWS`): this kernel
writes the dense weights of an 8B layer in ~0.25 ms on the H200 (~2.5 TB/s), while the quantized GEMM, which
dequantizes each weight fragment once per 64-row tile, runs at 120-220 TFLOP/s. MLX's own `mx.dequantize` is the
same arithmetic at about half this speed, and for weights split over K (`quantized_rows.split_k`) needs one more
copy to put the slices back in order.

One thread turns one packed word (8 weights, lowest nibble first) into 16 bytes of bf16, as MLX dequantizes:
`w = bf16(q * scale + bias)`, one rounding (`fma.rn.bf16x2`), so the result equals `mx.dequantize`'s bit for bit.
Whole `[N, K/8]` or split `[S, N, K/S/8]` weights come out as one `[N, K]` matrix.
"""

from __future__ import annotations

import functools

import mlx.core as mx

WORD_THREADS = 64  # threads of a block along a row's packed words
ROW_THREADS = 4  # rows of a block
GROUP_SIZES = (32, 64, 128)

# Template: GS (group size). Inputs: w [S, N, Ks/8] uint32, scales and biases [S, N, Ks/GS] bf16. Output: y [N,
# S * Ks] bf16. Grid: (words of a row, rounded up to WORD_THREADS) x N x S threads, blocks of WORD_THREADS x
# ROW_THREADS: a thread's word, row and slice come from its block and thread index (a first form that divided one
# flat index by the shapes measured the same)
SOURCE = r"""
  const int S = w_shape[0], N = w_shape[1], words = w_shape[2];  // words of one slice row: Ks / 8
  const int word = blockIdx.x * blockDim.x + threadIdx.x;
  const int n = blockIdx.y * blockDim.y + threadIdx.y;
  const int s = blockIdx.z;
  if (word >= words || n >= N) return;
  const size_t row = (size_t)s * N + n;
  const size_t group = row * (words * 8 / GS) + word * 8 / GS;
  const __nv_bfloat162 scale = __bfloat162bfloat162(scales[group]);
  const __nv_bfloat162 bias = __bfloat162bfloat162(biases[group]);
  const __nv_bfloat162 magic = __floats2bfloat162_rn(128.f, 128.f);
  const uint32_t packed = w[row * words + word];
  uint4 out;
  uint32_t* pairs = reinterpret_cast<uint32_t*>(&out);
  #pragma unroll
  for (int h = 0; h < 4; ++h) {
    // nibbles 2h and 2h + 1 over bf16 128's bits: 128 + q exactly, then q * scale + bias rounded once
    const uint32_t bits = ((packed >> (8 * h)) & 0xFu) | (((packed >> (8 * h + 4)) & 0xFu) << 16) | 0x43004300u;
    const __nv_bfloat162 q = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&bits), magic);
    const __nv_bfloat162 v = __hfma2(q, scale, bias);
    pairs[h] = *reinterpret_cast<const uint32_t*>(&v);
  }
  const size_t K = (size_t)S * words * 8;
  *reinterpret_cast<uint4*>(y + n * K + ((size_t)s * words + word) * 8) = out;
"""


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel("mlx_serve_dequantize", ["w", "scales", "biases"], ["y"], SOURCE)


def supports(weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
             mode: str = "affine") -> bool:  # fmt: skip
    """Affine 4-bit weights (`[N, K/8]` or split `[S, N, Ks/8]` uint32) with bf16 scales and biases."""
    if bits != 4 or mode != "affine" or biases is None or group_size not in GROUP_SIZES:
        return False
    if weight.dtype != mx.uint32 or scales.dtype != mx.bfloat16 or biases.dtype != mx.bfloat16:
        return False
    rows_fit = weight.shape[-2] <= 65535 * ROW_THREADS  # the grid's y dimension
    return weight.ndim in (2, 3) and (weight.shape[-1] * 8) % group_size == 0 and rows_fit


def dequantize_4bit(weight: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> mx.array:
    """The dense `[N, K]` bf16 weight of 4-bit `weight` `[N, K/8]` or `[S, N, K/S/8]` (K in slices, put back in
    order), equal to `mx.dequantize`'s."""
    if weight.ndim == 2:
        weight, scales, biases = weight[None], scales[None], biases[None]
    slices, n, words = weight.shape
    (y,) = _kernel()(
        inputs=[weight, scales, biases],
        template=[("GS", group_size)],
        grid=(-(-words // WORD_THREADS) * WORD_THREADS, -(-n // ROW_THREADS) * ROW_THREADS, slices),
        threadgroup=(WORD_THREADS, ROW_THREADS, 1),
        output_shapes=[(n, slices * words * 8)],
        output_dtypes=[mx.bfloat16],
    )
    return y


def dense_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                 bits: int = 4) -> mx.array:  # fmt: skip
    """`x @ dequantize(weight).T` as the bf16 GEMM over weights dequantized by `dequantize_4bit`."""
    if bits != 4:
        raise ValueError(f"the dequantize kernel takes 4-bit weights, not {bits}-bit")
    return x @ dequantize_4bit(weight, scales, biases, group_size).T
