"""Decode attention over the paged KV pool: CUDA kernels (tensor-core for bf16, scalar otherwise), a batched pure-MLX
path, and the choice between them.

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

from mlx_serve.kernels.mma import MMA_HEADER
from mlx_serve.kernels.paged_attention_cuda import (
    BLOCK_SOURCE,
    HEADER,
    MERGE_SOURCE,
    MMA_SOURCE,
    PARTIAL_SOURCE,
    REDUCE_SOURCE,
)
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
# the tensor-core kernel (`MMA_SOURCE`) where it fits (`mma_fits`), and its 16-token tiles a warp loads at once:
# faster than the scalar kernel at every shape measured (1 lane x 560 tokens 13.0 against 19.7 us a layer, cuDNN
# 12.5; 32 x 4,096 166 against 212), two tiles 5-10% better than one past 1k tokens (seventeenth H200 run)
MMA = True
MMA_TILES = 2
# its partitions: one pass up to `MMA_SINGLE_PASS_TOKENS` (1 x 1,100: 20 us one pass, 24 split; 1 x 2,048: 30
# against 26), or up to `MMA_ONE_PASS_MOST_TOKENS` from `MMA_ONE_PASS_BLOCKS` (lane, kv head) blocks (8 x 8,192: 114
# against 123 split); else `MMA_PARTITION`-token pieces (1 x 4,096: 32 against 53-61 one pass and 49 at 256)
MMA_SINGLE_PASS_TOKENS = 1536
MMA_ONE_PASS_BLOCKS = 64
MMA_ONE_PASS_MOST_TOKENS = 8192
MMA_PARTITION = 512
# a warp of it holds ~180 registers: 8 warps a block at most (16 would ask for 92K of the 64K a block may have)
MMA_MOST_WARPS = 8
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
    mma_single: object  # the tensor-core forms of the first two
    mma_partial: object


@functools.cache
def _kernels() -> _Kernels:
    inputs = ["queries", "k_pool", "v_pool", "tables", "lengths", "part_size", "scale"]
    final, split = ["out"], ["o_part", "ml_part"]

    def kernel(name: str, outputs: list[str], body: str, header: str) -> object:
        return mx.fast.cuda_kernel(name, inputs, outputs, BLOCK_SOURCE + body + MERGE_SOURCE, header=header)

    whole, partial = HEADER + "#define PA_SPLIT 0\n", HEADER + "#define PA_SPLIT 1\n"
    return _Kernels(
        single=kernel("mlx_serve_paged_decode", final, PARTIAL_SOURCE, whole),
        partial=kernel("mlx_serve_paged_decode_partial", split, PARTIAL_SOURCE, partial),
        reduce=mx.fast.cuda_kernel(
            "mlx_serve_paged_decode_reduce", ["o_part", "ml_part"], ["out"], REDUCE_SOURCE, header=HEADER
        ),
        mma_single=kernel("mlx_serve_paged_decode_mma", final, MMA_SOURCE, MMA_HEADER + whole),
        mma_partial=kernel("mlx_serve_paged_decode_mma_partial", split, MMA_SOURCE, MMA_HEADER + partial),
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


def partition_size(lanes: int, kv_heads: int, max_len: int, mma: bool = False) -> int:
    """History tokens per thread block: short histories whole, and longer ones while the lanes alone fill the GPU;
    else pieces merged by a second launch (`PARTITION` tokens, `MMA_PARTITION` for the tensor-core kernel)."""
    if mma:
        single, blocks, most = MMA_SINGLE_PASS_TOKENS, MMA_ONE_PASS_BLOCKS, MMA_ONE_PASS_MOST_TOKENS
        piece = MMA_PARTITION
    else:
        single, blocks, most, piece = SINGLE_PASS_TOKENS, ONE_PASS_BLOCKS, ONE_PASS_MOST_TOKENS, PARTITION
    if max_len <= single:
        return max_len
    if lanes * kv_heads >= blocks and max_len <= most:
        return max_len
    return piece


def one_pass_warps(group: int, head_dim: int) -> int:
    """Warps of a one-pass block: `SINGLE_PASS_WARPS`, halved until their fp32 partial sums (`[warps, group,
    head_dim + 2]`) fit `MERGE_SHARED_BYTES` (30B-A3B's group of 8 at 128-wide heads: 8 warps), at least `WARPS`."""
    warps = SINGLE_PASS_WARPS
    while warps > WARPS and warps * group * (head_dim + 2) * 4 > MERGE_SHARED_BYTES:
        warps //= 2
    return warps


def mma_fits(queries: mx.array, pool_keys: mx.array, block_size: int) -> bool:
    """Whether the tensor-core kernel takes this: bf16, heads of 64 or 128 dims, at most 8 query heads a kv head
    (one m16 tile's real rows), and 16-token tiles that no KV block boundary cuts."""
    group = queries.shape[1] // pool_keys.shape[1]
    return (
        queries.dtype == mx.bfloat16
        and pool_keys.dtype == mx.bfloat16
        and pool_keys.shape[-1] in (64, 128)
        and queries.shape[1] % pool_keys.shape[1] == 0
        and group <= 8
        and block_size % 16 == 0
    )


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
    mma: bool | None = None,
    tiles: int | None = None,
) -> mx.array:
    """The CUDA kernel: reads K/V straight from the pool through the block tables, fp32 online softmax.
    `partition` (history tokens a block), `mma` (the tensor-core kernel where it fits) and `tiles` (its tiles a
    warp loads at once) override the module's choices, for benchmarks and tests."""
    if not kernel_supports(queries, pool_keys):
        return batched_decode_attention(queries, pool_keys, pool_values, rows, scale)
    n, heads, _, head_dim = queries.shape
    kv_heads = pool_keys.shape[1]
    max_len = rows.block_tables.shape[1] * rows.block_size
    mma = (MMA if mma is None else mma) and mma_fits(queries, pool_keys, rows.block_size)
    size = min(partition, max_len) if partition else partition_size(n, kv_heads, max_len, mma)
    mma = mma and size % 16 == 0  # nor may a partition (an override) cut a tile
    parts = math.ceil(max_len / size)
    blockwise = BLOCKWISE if blockwise is None else blockwise
    blockwise = blockwise and blockwise_fits(head_dim, pool_keys.dtype.size, rows.block_size, size)
    kernels = _kernels()
    warps = one_pass_warps(heads // kv_heads, head_dim) if parts == 1 else WARPS
    warps = min(warps, MMA_MOST_WARPS) if mma else warps
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
        ("TILES", tiles or MMA_TILES) if mma else ("BLOCKWISE", blockwise),
    ]
    single, partial = (kernels.mma_single, kernels.mma_partial) if mma else (kernels.single, kernels.partial)
    if parts == 1:
        return single(
            inputs=inputs,
            template=template,
            grid=(warps * 32, kv_heads, n),
            threadgroup=(warps * 32, 1, 1),
            output_shapes=[queries.shape],
            output_dtypes=[queries.dtype],
        )[0]
    o_part, ml_part = partial(
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
