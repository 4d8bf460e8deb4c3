"""Decode attention over the paged KV pool: a CUDA kernel, a batched pure-MLX path, and the choice between them.

Every function here has the `mlx_serve.ragged.DecodeAttention` signature: queries `[n, heads, 1, head_dim]`,
pool keys/values `[num_blocks * block_size, kv_heads, head_dim]`, the step's `DecodeRows`, the softmax scale;
it returns `[n, heads, 1, head_dim]` in the queries' dtype. `reference_decode_attention` (one gather and one
SDPA per lane) stays the yardstick; `tests/kernels/` checks both paths here against it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from mlx_serve.kernels.paged_attention_cuda import HEADER, PARTIAL_SOURCE, REDUCE_SOURCE
from mlx_serve.ragged import DecodeAttention, DecodeRows, reference_decode_attention

WARPS = 4
# history tokens a thread block of a split history reads. Smaller partitions (more blocks) measured slower at
# every lane count, each block being bound by its chain of loads (H200, 36 chained layers, `bench_decode_attention`:
# 1 lane x 1,100 tokens 34 us a layer at 256 against 47 at 64; 8 lanes x 4,096 92 against 137)
PARTITION = 256
# histories up to this many tokens take one pass (one launch, more warps a block): splitting them measured slower
# at one lane (8B step 5.8-5.9 against 5.3-5.6 ms, fifteenth H200 run)
SINGLE_PASS_TOKENS = 1024
# with this many (lane, kv head) blocks the GPU is full without a split: one pass up to `ONE_PASS_MOST_TOKENS`
# (32 lanes x 1,100 tokens 76 us a layer against 97 split; x 4,096 220 against 240)
ONE_PASS_BLOCKS = 256
ONE_PASS_MOST_TOKENS = 4096
# warps of a one-pass block, at most (`one_pass_warps`). 16 measured ~3% faster on 8B decode (5.32 against 5.49 ms a
# step at one stream, H200), but that kernel then needs exactly 128 registers a thread, the most 512 threads can
# have, and its blockwise form (168) failed to launch: a compiler's choice away from a crash, so 8 stays
SINGLE_PASS_WARPS = 8
MERGE_SHARED_BYTES = 40 * 1024  # of the 48 KB of static shared memory a block may have
BLOCKWISE = False  # load order of the kernel's warps (see paged_attention_cuda); picked by measurement
KINDS = ("auto", "kernel", "batched", "reference")


def batched_decode_attention(
    queries: mx.array, pool_keys: mx.array, pool_values: mx.array, rows: DecodeRows, scale: float
) -> mx.array:
    """Gather every lane's blocks padded to the widest table, then one masked SDPA for all lanes."""
    n, width = rows.block_tables.shape
    offsets = mx.arange(rows.block_size, dtype=mx.int32)
    slots = (rows.block_tables[:, :, None] * rows.block_size + offsets).reshape(n, width * rows.block_size)
    keys = pool_keys[slots].transpose(0, 2, 1, 3)  # [n, kv_heads, L, D]
    values = pool_values[slots].transpose(0, 2, 1, 3)
    positions = mx.arange(width * rows.block_size, dtype=mx.int32)
    mask = (positions[None, :] < rows.lengths[:, None])[:, None, None, :]  # [n, 1, 1, L]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


@dataclass(frozen=True, slots=True)
class _Kernels:
    single: object  # writes the normalised output when one partition covers the history
    partial: object  # writes per-partition (output, max, sum)
    reduce: object  # merges the partitions


@functools.cache
def _kernels() -> _Kernels:
    inputs = ["queries", "k_pool", "v_pool", "tables", "lengths", "part_size", "scale"]
    return _Kernels(
        single=mx.fast.cuda_kernel(
            "mlx_serve_paged_decode", inputs, ["out"], PARTIAL_SOURCE, header=HEADER + "#define PA_SPLIT 0\n"
        ),
        partial=mx.fast.cuda_kernel(
            "mlx_serve_paged_decode_partial",
            inputs,
            ["o_part", "ml_part"],
            PARTIAL_SOURCE,
            header=HEADER + "#define PA_SPLIT 1\n",
        ),
        reduce=mx.fast.cuda_kernel(
            "mlx_serve_paged_decode_reduce", ["o_part", "ml_part"], ["out"], REDUCE_SOURCE, header=HEADER
        ),
    )


@functools.lru_cache(maxsize=64)
def _scalar(value: float | int, dtype: mx.Dtype) -> mx.array:
    # kernel scalars arrive as pointers: one cached device array per value, not a new upload per layer and step
    scalar = mx.array([value], dtype=dtype)
    mx.eval(scalar)
    return scalar


def as_int32(values: mx.array) -> mx.array:
    return values if values.dtype == mx.int32 else values.astype(mx.int32)


def kernel_supports(queries: mx.array, pool_keys: mx.array) -> bool:
    """Whether the kernel's load layout fits: a head is whole 16-byte vectors shared by a power of two threads."""
    head_dim = pool_keys.shape[-1]
    per_load = 16 // pool_keys.dtype.size
    threads = head_dim // per_load
    return (
        head_dim % per_load == 0
        and threads <= 32
        and 32 % threads == 0
        and queries.shape[1] % pool_keys.shape[1] == 0
        and queries.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and pool_keys.dtype in (mx.float16, mx.bfloat16, mx.float32)
    )


def partition_size(lanes: int, kv_heads: int, max_len: int) -> int:
    """History tokens per thread block: short histories whole, and longer ones while the lanes alone fill the GPU;
    else `PARTITION`-token pieces merged by a second launch."""
    if max_len <= SINGLE_PASS_TOKENS:
        return max_len
    if lanes * kv_heads >= ONE_PASS_BLOCKS and max_len <= ONE_PASS_MOST_TOKENS:
        return max_len
    return PARTITION


def one_pass_warps(group: int, head_dim: int) -> int:
    """Warps of a one-pass block: `SINGLE_PASS_WARPS`, halved until their fp32 partial sums (`[warps, group,
    head_dim + 2]`) fit `MERGE_SHARED_BYTES` (30B-A3B's group of 8 at 128-wide heads: 8 warps), at least `WARPS`."""
    warps = SINGLE_PASS_WARPS
    while warps > WARPS and warps * group * (head_dim + 2) * 4 > MERGE_SHARED_BYTES:
        warps //= 2
    return warps


def blockwise_fits(head_dim: int, itemsize: int, block_size: int, size: int) -> bool:
    """Whether a warp's chunk of unrolled tokens tiles both the KV blocks and the partitions."""
    tokens_per_iter = 32 // (head_dim // (16 // itemsize))
    chunk = min(block_size, 8 * tokens_per_iter)
    return block_size % tokens_per_iter == 0 and block_size % chunk == 0 and size % chunk == 0


def paged_decode_attention(
    queries: mx.array,
    pool_keys: mx.array,
    pool_values: mx.array,
    rows: DecodeRows,
    scale: float,
    *,
    blockwise: bool | None = None,
    partition: int | None = None,
) -> mx.array:
    """The CUDA kernel: reads K/V straight from the pool through the block tables, fp32 online softmax.
    `partition` (history tokens a block) overrides `partition_size`, for benchmarks and tests."""
    if not kernel_supports(queries, pool_keys):
        return batched_decode_attention(queries, pool_keys, pool_values, rows, scale)
    n, heads, _, head_dim = queries.shape
    kv_heads = pool_keys.shape[1]
    max_len = rows.block_tables.shape[1] * rows.block_size
    size = min(partition, max_len) if partition else partition_size(n, kv_heads, max_len)
    parts = math.ceil(max_len / size)
    blockwise = BLOCKWISE if blockwise is None else blockwise
    blockwise = blockwise and blockwise_fits(head_dim, pool_keys.dtype.size, rows.block_size, size)
    kernels = _kernels()
    warps = one_pass_warps(heads // kv_heads, head_dim) if parts == 1 else WARPS
    inputs = [
        queries,
        pool_keys,
        pool_values,
        as_int32(rows.block_tables),
        as_int32(rows.lengths),
        _scalar(size, mx.int32),
        _scalar(float(scale), mx.float32),
    ]
    template = [
        ("TQ", queries.dtype),
        ("TK", pool_keys.dtype),
        ("D", head_dim),
        ("G", heads // kv_heads),
        ("BS", rows.block_size),
        ("WARPS", warps),
        ("BLOCKWISE", blockwise),
    ]
    if parts == 1:
        return kernels.single(
            inputs=inputs,
            template=template,
            grid=(warps * 32, kv_heads, n),
            threadgroup=(warps * 32, 1, 1),
            output_shapes=[queries.shape],
            output_dtypes=[queries.dtype],
        )[0]
    o_part, ml_part = kernels.partial(
        inputs=inputs,
        template=template,
        grid=(parts * warps * 32, kv_heads, n),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(n, heads, parts, head_dim), (n, heads, parts, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return kernels.reduce(
        inputs=[o_part, ml_part],
        template=[("TQ", queries.dtype), ("D", head_dim)],
        grid=(32, heads, n),
        threadgroup=(32, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )[0]


def cuda_available() -> bool:
    return mx.cuda.is_available() and mx.default_device().type == mx.gpu


def select_decode_attention(kind: str = "auto") -> DecodeAttention:
    """Pick by kind: "auto" is the kernel on a CUDA GPU, the batched path on the CPU backend and the reference
    elsewhere; the others force one."""
    if kind not in KINDS:
        raise ValueError(f"decode attention must be one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "kernel" and not cuda_available():
        raise ValueError("the paged decode-attention kernel needs MLX's CUDA backend on a GPU")
    if kind == "kernel" or (kind == "auto" and cuda_available()):
        return paged_decode_attention
    # on MLX's CPU backend one masked SDPA beats a gather and SDPA per lane, and gives the same bits
    # (engine parity tests); Metal keeps the reference until a kernel has run there
    if kind == "batched" or (kind == "auto" and mx.default_device() == mx.cpu):
        return batched_decode_attention
    return reference_decode_attention
