"""A mixture-of-experts MLP for decode batches: every expert computed densely, then each row's top-k picked.

mlx-lm's SwitchGLU runs `gather_mm`, one product per (row, chosen expert) pair. On MLX's CUDA backend that reads
expert weights far below bandwidth: 8 rows of Qwen3-30B-A3B (64 pairs) took 47 ms a step in both engines, where
reading all 128 experts once is ~14 ms at 4.3 TB/s. Once a step has enough pairs, three batched matmuls over all
experts (each weight read once, rows padded into one GEMM per expert) are cheaper, and the result is mlx-lm's:
the same router, the same top-k, the same weighted sum over the chosen experts in the same order.

Used by the fused decode forward (`fused_decode`) for unquantized SwitchGLU blocks when `--dense-experts on`;
prefill keeps `gather_mm`. Off by default: the estimate above is arithmetic, not yet a measurement.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU, SwitchLinear

# dense once rows x top_k reaches this fraction of the experts: gather_mm's cost grows per pair (~0.6 ms a step
# per pair on the H200 at 30B-A3B), the dense cost is one read of every expert
PAIRS_PER_EXPERT = 0.25


def supports(mlp: Any) -> bool:
    """A softmax-routed block over an unquantized, bias-free SwitchGLU (Qwen3-MoE's shape)."""
    glu = getattr(mlp, "switch_mlp", None)
    if not isinstance(glu, SwitchGLU) or not isinstance(glu.activation, SwiGLU):
        return False
    projections = (glu.gate_proj, glu.up_proj, glu.down_proj)
    return (
        all(type(p) is SwitchLinear and "bias" not in p for p in projections)
        and hasattr(mlp, "gate")
        and hasattr(mlp, "top_k")
        and getattr(mlp, "sharding_group", None) is None
    )


def worth_it(mlp: Any, rows: int) -> bool:
    """Whether `rows` rows make the dense form cheaper than one product per (row, expert) pair."""
    return rows * mlp.top_k >= PAIRS_PER_EXPERT * mlp.switch_mlp.gate_proj.num_experts


def dense_moe(mlp: Any, x: mx.array) -> mx.array:
    """`mlp(x)` for `x` `[T, hidden]`, computing every expert for every row (`[E, T, ...]` intermediates)."""
    gates = mx.softmax(mlp.gate(x), axis=-1, precise=True)
    k = mlp.top_k
    chosen = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, chosen, axis=-1)
    if getattr(mlp, "norm_topk_prob", False):
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    glu = mlp.switch_mlp
    up = x @ glu.up_proj.weight.swapaxes(-1, -2)  # [E, T, intermediate]
    gate = x @ glu.gate_proj.weight.swapaxes(-1, -2)
    out = glu.activation(up, gate) @ glu.down_proj.weight.swapaxes(-1, -2)  # [E, T, hidden]
    picked = mx.take_along_axis(out.swapaxes(0, 1), chosen[..., None], axis=1)  # [T, k, hidden]
    return (picked * scores[..., None]).sum(axis=-2).astype(picked.dtype)
