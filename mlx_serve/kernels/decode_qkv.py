"""From a decode step's fused q/k/v projection to roped queries, with the keys and values stored in the pool.

Both functions have the `QKVRows` signature: the projection `[T, (H + 2 KVH) * D]`, the layer's `HeadSpec` and
attention module, positions and pool slots `[T]`, the pool and the layer index; they return the queries
`[T, H, 1, D]` and leave the rows' keys and values in the pool. `plain_qkv_rows` is mlx-lm's own sequence of ops
(the CPU path and the reference); `kernel_qkv_rows` is one CUDA launch tested against it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_serve.kernels.decode_qkv_cuda import QKV_SOURCE
from mlx_serve.kernels.paged_attention import as_int32
from mlx_serve.kernels.paged_attention_cuda import HEADER
from mlx_serve.kv_pool import KVPool

WARPS = 4


@dataclass(frozen=True, slots=True)
class HeadSpec:
    """What the fused paths need to know of one attention module."""

    heads: int
    kv_heads: int
    head_dim: int
    norm_eps: float | None  # q_norm/k_norm epsilon; None when the model has no per-head norm
    rope_base: float
    rope_scale: float
    rope_traditional: bool


QKVRows = Callable[[mx.array, HeadSpec, Any, mx.array, mx.array, KVPool, int], mx.array]


def plain_qkv_rows(
    qkv: mx.array, spec: HeadSpec, attn: Any, positions: mx.array, slots: mx.array, pool: KVPool, layer: int
) -> mx.array:
    """mlx-lm's attention prologue on rows `[T, 1]`, op for op (so its output is bit-identical)."""
    rows = qkv.shape[0]
    q_end = spec.heads * spec.head_dim
    k_end = q_end + spec.kv_heads * spec.head_dim
    queries = qkv[:, :q_end].reshape(rows, 1, spec.heads, spec.head_dim)
    keys = qkv[:, q_end:k_end].reshape(rows, 1, spec.kv_heads, spec.head_dim)
    values = qkv[:, k_end:].reshape(rows, spec.kv_heads, spec.head_dim)
    if spec.norm_eps is not None:
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries = attn.rope(queries.transpose(0, 2, 1, 3), offset=positions)
    keys = attn.rope(keys.transpose(0, 2, 1, 3), offset=positions)
    pool.write(layer, slots, keys[:, :, 0, :], values)
    return queries


@functools.cache
def _kernel() -> object:
    inputs = ["qkv", "q_weight", "k_weight", "positions", "slots", "k_pool", "v_pool", "params"]
    return mx.fast.cuda_kernel("mlx_serve_decode_qkv", inputs, ["q_out"], QKV_SOURCE, header=HEADER)


@functools.lru_cache(maxsize=64)
def _params(eps: float, base: float, scale: float) -> mx.array:
    params = mx.array([eps, math.log2(base), scale], dtype=mx.float32)
    mx.eval(params)
    return params


def kernel_supports(spec: HeadSpec) -> bool:
    # a warp holds a head as pairs of 32 lanes; activations and pool are MLX's float dtypes (checked at load)
    return spec.head_dim % 64 == 0


def kernel_qkv_rows(
    qkv: mx.array, spec: HeadSpec, attn: Any, positions: mx.array, slots: mx.array, pool: KVPool, layer: int
) -> mx.array:
    """The CUDA kernel; writes the keys and values into the pool's arrays in place."""
    rows = qkv.shape[0]
    keys, values = pool.keys[layer], pool.values[layer]
    if spec.norm_eps is not None:
        q_weight, k_weight = attn.q_norm.weight, attn.k_norm.weight
    else:
        q_weight = k_weight = keys  # unread
    items = rows * (spec.heads + spec.kv_heads)
    return _kernel()(
        inputs=[
            qkv, q_weight, k_weight, as_int32(positions), as_int32(slots), keys, values,
            _params(float(spec.norm_eps or 0.0), float(spec.rope_base), float(spec.rope_scale)),
        ],  # fmt: skip
        template=[
            ("T", qkv.dtype),
            ("TK", keys.dtype),
            ("D", spec.head_dim),
            ("H", spec.heads),
            ("KVH", spec.kv_heads),
            ("NORM", spec.norm_eps is not None),
            ("TRAD", spec.rope_traditional),
            ("WARPS", WARPS),
        ],
        grid=(-(-items // WARPS) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, spec.heads, 1, spec.head_dim)],
        output_dtypes=[qkv.dtype],
    )[0]


kernel_qkv_rows.in_place = True  # its pool writes are invisible to MLX's graph (see FusedDecode.mixed)


def select_qkv_rows(spec: HeadSpec) -> QKVRows:
    """The kernel on MLX's CUDA backend when the head fits, else mlx-lm's ops."""
    from mlx_serve.kernels.paged_attention import cuda_available

    if cuda_available() and kernel_supports(spec):
        return kernel_qkv_rows
    return plain_qkv_rows
