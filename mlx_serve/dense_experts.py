"""How a Qwen3-MoE block computes a step, chosen by its rows: decode steps every expert densely, then each row's
top-k picked; steps with prefill rows through expert tiles (`grouped_experts`) where installed, else densely up to
`MAX_ROWS` rows; beyond, mlx-lm's own gathered experts.

mlx-lm's SwitchGLU runs `gather_mm`, one product per (row, chosen expert) pair. On MLX's CUDA backend that reads
expert weights far below bandwidth: 8 rows of Qwen3-30B-A3B (64 pairs) took 47 ms a step in both engines, where
reading all 128 experts once is ~14 ms at 4.3 TB/s. Once a step has enough pairs, three batched matmuls over all
experts (each weight read once, rows padded into one GEMM per expert) are cheaper, and the result is mlx-lm's:
the same router, the same top-k, the same weighted sum over the chosen experts in the same order.

Measured on the H200 (fifth run, 30B-A3B): decode at 8 / 32 / 64 streams 2.3x / 4.1x / 4.3x mlx-lm against
1.0x / 1.05x / 1.14x with gather_mm. Mixed steps (a prefill chunk with the decode lanes) met the same wall: a
64-row chunk with 8 decode rows cost 79 ms through gather_mm, so `install` routes every step of up to `MAX_ROWS`
rows, not only fused decode steps. Larger steps (uncontended 2k-row chunks) keep gather_mm, whose cost there is
per row, where the dense form's compute grows with rows x experts.

Twelfth run: the expert tiles' CUDA kernel does only the chosen pairs' FLOPs; from 65 rows it replaces both (30B-A3B
prefill 1.48x -> 2.36x mlx-lm at 2k tokens, contended 16k TTFT 2.19x -> 1.63x solo).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU, SwitchLinear

from mlx_serve.grouped_experts import (
    LARGE_TILES_FROM_ROWS,
    TileMatmul,
    grouped_moe,
    route,
    tile_rows,
    tiles_fit,
)

# dense once rows x top_k reaches this fraction of the experts: gather_mm's cost grows per pair (~0.6 ms a step
# per pair on the H200 at 30B-A3B), the dense cost is one read of every expert
PAIRS_PER_EXPERT = 0.25
# and up to this many rows: beyond, the dense form's FLOPs (rows x every expert) outgrow gather_mm's per-row cost
MAX_ROWS = 1024
# steps of more rows than a full decode batch (64 lanes) take the expert tiles where installed (`grouped_experts`, the
# CUDA kernel), so decode steps stay dense and every step with a prefill chunk takes one form. Per block dense is
# cheaper up to ~256 rows (H200, 30B-A3B's 48 blocks: 128 rows 25 against 39 ms, 384 rows 49 against 41), but a
# switch at 384 rows left the step time discontinuous in rows: the affine model then over-predicted small chunks
# 1.5x and cut them to 96-128 rows (contended 16k TTFT 4.51x solo, against 1.63x with one form throughout)
TILES_FROM_ROWS = 65


MOE_FAMILIES = ("mlx_lm.models.qwen3_moe",)  # whose blocks `route` routes exactly as mlx-lm does


def warm_up_rows() -> tuple[int, ...]:
    """A row count in each form's range and each expert-tile size: a decode batch, the tiles' first step, the
    first step of the large tiles."""
    return 8, TILES_FROM_ROWS, LARGE_TILES_FROM_ROWS


def supports(mlp: Any) -> bool:
    """Qwen3-MoE's block over an unquantized, bias-free SwitchGLU. Other families route otherwise (Mixtral's
    top-k before the softmax, Qwen2-MoE's shared expert, PhiMoE's sparsemixer): they keep mlx-lm's block."""
    if type(mlp).__module__ not in MOE_FAMILIES:
        return False
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
    chosen, scores = route(mlp, x)
    glu = mlp.switch_mlp
    up = x @ glu.up_proj.weight.swapaxes(-1, -2)  # [E, T, intermediate]
    gate = x @ glu.gate_proj.weight.swapaxes(-1, -2)
    out = glu.activation(up, gate) @ glu.down_proj.weight.swapaxes(-1, -2)  # [E, T, hidden]
    picked = mx.take_along_axis(out.swapaxes(0, 1), chosen[..., None], axis=1)  # [T, k, hidden]
    return (picked * scores[..., None]).sum(axis=-2).astype(picked.dtype)


def install(model: Any, max_rows: int = MAX_ROWS, dense: bool = True, tiles: TileMatmul | None = None) -> int:
    """Make every supported MoE block of `model` choose its form by the step's rows (its class becomes a subclass
    whose `__call__` chooses; parameters and weights are untouched): expert tiles through `tiles` from
    `TILES_FROM_ROWS` rows where given and the block's weights fit it, else with `dense` every expert for steps of
    enough rows up to `max_rows`, else mlx-lm's gathered experts. Returns how many blocks (0 when run again)."""
    changed = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and supports(mlp) and not getattr(type(mlp), "forms_installed", False):
            fitting = tiles if tiles is not None and tiles_fit(tiles, mlp) else None
            mlp.__class__ = _dense_class(type(mlp), max_rows if dense else 0, fitting)
            changed += 1
    return changed


def _dense_class(base: type, max_rows: int, tiles: TileMatmul | None) -> type:
    key = (base, max_rows, tiles)
    if key not in _CLASSES:

        def __call__(self: Any, x: mx.array) -> mx.array:
            rows = x.size // x.shape[-1]
            if tiles is not None and rows >= TILES_FROM_ROWS:
                return grouped_moe(self, x.reshape(rows, x.shape[-1]), tile_rows(rows), tiles).reshape(x.shape)
            if rows <= max_rows and worth_it(self, rows):
                return dense_moe(self, x.reshape(rows, x.shape[-1])).reshape(x.shape)
            return base.__call__(self, x)

        attributes = {"__call__": __call__, "forms_installed": True, "dense_max_rows": max_rows, "expert_tiles": tiles}
        _CLASSES[key] = type(f"Dense{base.__name__}", (base,), attributes)
    return _CLASSES[key]


_CLASSES: dict[tuple[type, int, TileMatmul | None], type] = {}
