"""Fast paths for the GPU (CUDA kernels through `mx.fast.cuda_kernel`), each checked against its pure-MLX reference."""

from mlx_serve.kernels.paged_attention import (
    batched_decode_attention,
    paged_decode_attention,
    select_decode_attention,
)

__all__ = ["batched_decode_attention", "paged_decode_attention", "select_decode_attention"]
