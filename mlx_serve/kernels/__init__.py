"""Fast paths for the GPU: paged decode attention as a CUDA kernel, checked against the pure-MLX reference."""

from mlx_serve.kernels.paged_attention import (
    batched_decode_attention,
    paged_decode_attention,
    select_decode_attention,
)

__all__ = ["batched_decode_attention", "paged_decode_attention", "select_decode_attention"]
