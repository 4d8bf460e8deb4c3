"""A prefill lane's history, copied out of the paged pool by one CUDA kernel, in the layout SDPA takes.

A prefill chunk attends to its whole history (up to the context length) through MLX's fused SDPA, which wants
contiguous `[1, kv_heads, L, head_dim]` keys and values. `KVPool.gather` builds them with a fancy-index gather
over every slot and a transpose; this kernel reads each history token once through the block table with
16-byte loads, writes the SDPA layout directly, and zero-fills the padding past the lane's length (the lane's
mask hides it; zeros keep a masked product from meeting garbage).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from mlx_serve.ragged import LaneRows

# Template: T (pool dtype), D (head dim), BS (block size). Inputs: k_pool/v_pool [slots, KVH, D], table [blocks]
# int32, length [2] int32 = (tokens, padded length L). Outputs: k_out/v_out [1, KVH, L, D] (MLX passes no output
# shapes to CUDA sources, hence L in `length`). One thread per 16-byte vector of the output.
GATHER_SOURCE = r"""
  constexpr int VEC = 16 / sizeof(T);
  constexpr int VPR = D / VEC;
  const int KVH = k_pool_shape[1];
  const int L = length[1];
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)KVH * L * VPR) return;
  const int v = idx % VPR;
  const int t = (idx / VPR) % L;
  const int h = idx / ((size_t)VPR * L);
  uint4 k = make_uint4(0, 0, 0, 0);
  uint4 val = k;
  if (t < length[0]) {
    const size_t slot = (size_t)table[t / BS] * BS + t % BS;
    const size_t off = (slot * KVH + h) * D + v * VEC;
    k = *reinterpret_cast<const uint4*>(k_pool + off);
    val = *reinterpret_cast<const uint4*>(v_pool + off);
  }
  *reinterpret_cast<uint4*>(k_out + idx * VEC) = k;
  *reinterpret_cast<uint4*>(v_out + idx * VEC) = val;
"""

THREADS = 256


@functools.cache
def _kernel(ordered: bool) -> object:
    # `after` is never read: it is an input only so MLX's CUDA graph orders this kernel after the one that made it
    inputs = ["k_pool", "v_pool", "table", "length"] + (["after"] if ordered else [])
    name = "mlx_serve_paged_gather_after" if ordered else "mlx_serve_paged_gather"
    return mx.fast.cuda_kernel(name, inputs, ["k_out", "v_out"], GATHER_SOURCE)


def gather_supports(pool_keys: mx.array) -> bool:
    head_dim, itemsize = pool_keys.shape[-1], pool_keys.dtype.size
    return (head_dim * itemsize) % 16 == 0


def paged_gather(
    pool_keys: mx.array, pool_values: mx.array, lane: LaneRows, block_size: int, after: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Keys and values of positions [0, lane.kv_len) as `[1, kv_heads, kv_len, head_dim]` each.

    MLX's CUDA graph orders kernels by the arrays they output, so a kernel that wrote the pool in place (an input to
    it) is not seen as the pool's writer: pass its output as `after` to read the pool only once it has run."""
    _, kv_heads, head_dim = pool_keys.shape
    shape = (1, kv_heads, lane.kv_len, head_dim)
    vectors = kv_heads * lane.kv_len * head_dim * pool_keys.dtype.size // 16
    keys, values = _kernel(after is not None)(
        inputs=[pool_keys, pool_values, lane.table, lane.length] + ([after] if after is not None else []),
        template=[("T", pool_keys.dtype), ("D", head_dim), ("BS", block_size)],
        grid=(-(-vectors // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[shape, shape],
        output_dtypes=[pool_keys.dtype, pool_keys.dtype],
    )
    return keys, values


paged_gather.orders_after = True  # takes `after`: may read a pool written in place (see FusedDecode.mixed)


def table_gather(pool_keys: mx.array, pool_values: mx.array, lane: LaneRows, block_size: int) -> tuple[mx.array, mx.array]:
    """The same result in plain MLX ops: the yardstick the kernel is tested against, and the CPU path."""
    slots = (lane.table[:, None] * block_size + mx.arange(block_size, dtype=mx.int32)).reshape(-1)
    valid = (mx.arange(slots.shape[0]) < lane.length[0])[:, None, None]
    pad = [(0, lane.kv_len - slots.shape[0]), (0, 0), (0, 0)]
    keys = mx.pad(mx.where(valid, pool_keys[slots], 0), pad).transpose(1, 0, 2)[None]
    values = mx.pad(mx.where(valid, pool_values[slots], 0), pad).transpose(1, 0, 2)[None]
    return keys, values


def select_prefill_gather(pool_keys: mx.array) -> object | None:
    """The kernel on MLX's CUDA backend when the head fits 16-byte loads; None (slot gather) elsewhere."""
    on_cuda = mx.cuda.is_available() and mx.default_device().type == mx.gpu
    return paged_gather if on_cuda and gather_supports(pool_keys) else None
