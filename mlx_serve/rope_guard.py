"""`mx.fast.rope` kept inside CUDA's thread-block limits for the ragged rows layout (MLX 0.32's CUDA backend).

MLX's CUDA RoPE kernel sizes its thread block from (rotated dims / 2, sequence, batch x ceil(heads / 4)) under a
1,024-thread total only (`get_block_dims_common`), so with fewer than 32 rotated dims the block's z size grows past
CUDA's 64 once batch x ceil(heads / 4) reaches 128, and the launch fails ("cudaGraphAddKernelNode ... invalid
argument"). The ragged rows layout `[T, heads, 1, D]` makes the batch the step's rows: a 128-row step of a model with
a small rotary part (16-dim partial rotary, dummy shapes) failed on the device (session 41). Such calls run here in
pieces along the batch axis, each with its rows' offsets; every other call goes to MLX unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import mlx.core as mx

CUDA_MAX_BLOCK_Z = 64
MAX_BLOCK_THREADS_LOG2 = 10  # MLX's 1,024-thread block
# from 32 rotated dims the block's x size (16 or more) leaves z at most 64 in the 1,024 threads
SAFE_ROTATED_DIMS = 32


def block_dims(dim0: int, dim1: int, dim2: int) -> tuple[int, int, int]:
    """The thread block MLX's CUDA backend picks for a 3-D launch (`get_block_dims_common`): each axis doubles in
    turn while it fits its extent, until the block holds 1,024 threads or no axis can grow."""
    pows, total = [0, 0, 0], 0
    while True:
        before = total
        for axis, extent in enumerate((dim0, dim1, dim2)):
            if extent >= 1 << (pows[axis] + 1):
                pows[axis] += 1
                total += 1
            if total == MAX_BLOCK_THREADS_LOG2:
                return (1 << pows[0], 1 << pows[1], 1 << pows[2])
        if total == before:
            return (1 << pows[0], 1 << pows[1], 1 << pows[2])


def rope_block(shape: tuple[int, ...], rotated_dims: int) -> tuple[int, int, int] | None:
    """The block MLX's CUDA RoPE launches over an input of `shape` (None: its one-row kernel, a 2-D launch)."""
    batch, sequence = shape[0], shape[-2]
    heads = math.prod(shape[1:-2])
    if batch == 1 and sequence == 1:
        return None
    return block_dims(rotated_dims // 2, sequence, batch * -(-heads // 4))


@functools.lru_cache(maxsize=1024)
def piece_rows(shape: tuple[int, ...], rotated_dims: int) -> int | None:
    """Batch rows a piece of this call may hold for its launch to fit CUDA (None: the whole call fits). Cached: it
    runs on every RoPE call, and a step's shapes repeat."""
    if rotated_dims >= SAFE_ROTATED_DIMS:
        return None
    block = rope_block(shape, rotated_dims)
    if block is None or block[2] <= CUDA_MAX_BLOCK_Z:
        return None
    # a z extent under 2 x 64 keeps the block's z at most 64
    return max(1, (2 * CUDA_MAX_BLOCK_Z - 1) // -(-math.prod(shape[1:-2]) // 4))


def guarded(rope: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """`rope` (mx.fast.rope's signature), run in batch pieces where one launch would not fit."""

    def guarded_rope(a: mx.array, dims: int, *args, **kwargs) -> mx.array:
        rows = piece_rows(tuple(a.shape), dims)
        if rows is None:
            return rope(a, dims, *args, **kwargs)
        offset = kwargs.get("offset", 0)
        pieces = []
        for start in range(0, a.shape[0], rows):
            # one offset a batch row (the ragged rows' positions), or one for all (a scalar, or one broadcast)
            if isinstance(offset, mx.array) and offset.ndim > 0 and offset.shape[0] == a.shape[0] > 1:
                kwargs["offset"] = offset[start : start + rows]
            pieces.append(rope(a[start : start + rows], dims, *args, **kwargs))
        return mx.concatenate(pieces, axis=0)

    guarded_rope.rope_guard = True
    return guarded_rope


def install_rope_guard() -> bool:
    """Route `mx.fast.rope` through `guarded` on MLX's CUDA backend (idempotent; process-wide, as the limit is
    MLX's: mlx-lm's modules call it directly). Returns whether the guard is in place."""
    if not (mx.cuda.is_available() and mx.default_device().type == mx.gpu):
        return False
    if not getattr(mx.fast.rope, "rope_guard", False):
        mx.fast.rope = guarded(mx.fast.rope)
    return True
