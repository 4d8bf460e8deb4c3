"""Decode steps with half the ops per layer of mlx-lm's module forward, for the pre-norm families we know.

On MLX's CUDA backend a decode step of mlx-lm's ~20 ops a Qwen3 layer was bound by the host's cost per op (~8 us
to build, encode and add a graph node); with this forward's 11 the 8B step is bound by the device (H200, RESULTS
"Sixteenth run"): q/k/v in one matmul, the attention prologue (q/k norms, two RoPEs, two KV scatters) in one
kernel (`kernels.decode_qkv`), the paged attention, o_proj, and gate/up in one matmul. The weights stay mlx-lm's:
each projection becomes a slice (a view) of the concatenated matrix, so the eager path and memory are unchanged.

Used for steps whose lanes are all single rows (`compiled_step`); with `--fuse-mixed` (auto = on with CUDA), for
steps with prefill chunks too (`FusedDecode.mixed`: eagerly, or as a compiled trace with `--compile-mixed`, auto =
on with CUDA).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from mlx_serve.adapters import unadapted
from mlx_serve.kernels.add_norm import AddNorm, select_add_norm
from mlx_serve.kernels.decode_qkv import HeadSpec, QKVRows, plain_qkv_rows, select_qkv_rows
from mlx_serve.kv_pool import KVPool
from mlx_serve.quantized_rows import split_where_worth_it
from mlx_serve.ragged import DecodeAttention, DecodeRows, PagedChunkAttention, RaggedLayerCache, StepLayout

# mlx-lm model modules whose blocks are `h + attn(norm(h))`, then `h + mlp(norm(h))`, with the attention and MLP
# written as below (checked against mlx-lm 0.32)
FAMILIES = ("mlx_lm.models.qwen3", "mlx_lm.models.qwen3_moe", "mlx_lm.models.llama")


@dataclass(frozen=True, slots=True)
class FusedLayer:
    block: Any  # mlx-lm's decoder block: its norms, attention module (o_proj, norms, rope) and MLP
    spec: HeadSpec
    qkv: nn.Module  # q, k and v projections as one
    gate_up: nn.Module | None  # gate and up projections as one; None: the block's own MLP (mixture of experts)


def unsupported_reason(model: Any) -> str | None:
    """Why this model cannot take the fused forward, or None when it can."""
    module = type(model).__module__
    if module not in FAMILIES:
        return f"{module} is not one of the fused families ({', '.join(FAMILIES)})"
    for block in model.model.layers:
        attn = block.self_attn
        if getattr(block, "use_sliding", False):
            return "sliding-window layers"
        if not all(isinstance(m, (nn.Linear, nn.QuantizedLinear)) for m in _linear_leaves(block)):
            return "linears of another kind"
        if type(attn.rope) is not nn.RoPE or attn.rope.dims != _head_dim(attn):
            return f"RoPE {type(attn.rope).__name__} over {attn.rope.dims} dims"
        projections = _projections(attn)
        if len({type(p) for p in projections}) != 1 or len({_quantization(p) for p in projections}) != 1:
            return "q/k/v projections of different kinds"
    return None


def _linear_leaves(block: nn.Module) -> list[nn.Module]:
    """The block's projections: attention's q/k/v/o, and a dense MLP's gate/up/down (under any LoRA adapters: the
    fused forward runs steps without adapter rows, where an adapted linear is its base)."""
    attn, mlp = block.self_attn, block.mlp
    names = ("gate_proj", "up_proj", "down_proj") if type(mlp).__name__ == "MLP" else ()
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *(getattr(mlp, name) for name in names)]
    return [unadapted(linear) for linear in linears]


def _projections(attn: Any) -> list[nn.Module]:
    return [unadapted(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]


def _gate_up(mlp: Any) -> list[nn.Module]:
    return [unadapted(mlp.gate_proj), unadapted(mlp.up_proj)]


def fuse_layers(model: Any) -> list[FusedLayer]:
    """Concatenate each block's q/k/v (and dense gate/up) weights; the original projections become views."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"fused decode does not support this model: {reason}")
    layers = []
    for block in model.model.layers:
        attn = block.self_attn
        qkv = _concatenate(_projections(attn))
        mlp = block.mlp
        dense = type(mlp).__name__ == "MLP" and len({_quantization(p) for p in _gate_up(mlp)}) == 1
        gate_up = _concatenate(_gate_up(mlp)) if dense else None
        layers.append(FusedLayer(block, _spec(attn), qkv, gate_up))
    return layers


def viewed_projections(layers: list[FusedLayer]) -> set[int]:
    """Ids of the block projections that are views of the fused layers' arrays (`_concatenate`)."""
    ids = set()
    for layer in layers:
        ids.update(id(p) for p in _projections(layer.block.self_attn))
        if layer.gate_up is not None:
            ids.update(id(p) for p in _gate_up(layer.block.mlp))
    return ids


def split_fused_projections(layers: list[FusedLayer]) -> int:
    """Re-lay each layer's quantized fused q/k/v and gate/up over K slices (`quantized_rows.split_k`), as the
    standalone projections are; the block's own q/k/v/gate/up become slices of the new arrays (correct on any
    backend, but a slice is not a contiguous weight: only the fused forward reads them at speed). Returns how
    many fused projections it split."""
    changed = 0
    for layer in layers:
        attn, mlp = layer.block.self_attn, layer.block.mlp
        groups = [(layer.qkv, _projections(attn))]
        if layer.gate_up is not None:
            groups.append((layer.gate_up, _gate_up(mlp)))
        for fused, parts in groups:
            widths = [part.weight.shape[-2] for part in parts]
            splits = split_where_worth_it(fused)
            if splits == 1:
                continue
            start = 0
            for part, width in zip(parts, widths):
                for name in ("weight", "scales", "biases"):
                    setattr(part, name, fused[name][:, start : start + width])
                part.k_splits = splits
                start += width
            changed += 1
    return changed


@dataclass(frozen=True, slots=True)
class TransposedWeight:
    """A dense linear's weight and its transpose, evaluated once. An evaluated view is a leaf of every later graph,
    where the linear's own `x @ weight.T` adds a Transpose node a call (112 a 0.6B step, each one host work on
    CUDA); the product reads the same memory with the same strides either way."""

    linear: nn.Linear
    weight: mx.array
    transposed: mx.array

    def applies_to(self, linear: nn.Module) -> bool:
        """Whether `linear` is still this one over this weight (not an adapter put in its place, nor re-pointed)."""
        return linear is self.linear and linear.get("weight") is self.weight


def transposed_weights(linears: Sequence[nn.Module]) -> dict[int, TransposedWeight]:
    """The dense (`nn.Linear`) ones of `linears`, by id, with their transposes evaluated."""
    entries = {id(m): TransposedWeight(m, m["weight"], m["weight"].T) for m in linears if type(m) is nn.Linear}
    mx.eval([entry.transposed for entry in entries.values()])
    return entries


class FusedDecode:
    """The hidden states `[T, hidden]` of a single-row step, with its KV written to the pool."""

    def __init__(
        self,
        model: Any,
        attention: DecodeAttention,
        qkv_rows: QKVRows | None = None,
        add_norm: AddNorm | None = None,
    ) -> None:
        self.model = model
        self.layers = fuse_layers(model)
        self.attention = attention
        # kernels on CUDA, mlx-lm's ops elsewhere
        self.qkv_rows = qkv_rows or select_qkv_rows(self.layers[0].spec)
        self.add_norm = add_norm or select_add_norm()
        self._transposed = transposed_weights([m for layer in self.layers for m in _dense_projections(layer)])

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding: every id a step may read."""
        return self.model.model.embed_tokens.weight.shape[0]

    def __call__(
        self, tokens: mx.array, positions: mx.array, slots: mx.array, rows: DecodeRows, pool: KVPool
    ) -> mx.array:
        """Hidden states after the final norm `[T, hidden]` of a step whose lanes are all single rows."""

        def attend(index: int, queries: mx.array, scale: float) -> mx.array:
            return self.attention(queries, pool.keys[index], pool.values[index], rows, scale)

        return self._forward(tokens, positions, slots, pool, attend, self.qkv_rows)

    @property
    def writes_in_place(self) -> bool:
        """Whether decode steps write their K/V through the CUDA prologue (in place) rather than MLX's scatter."""
        return getattr(self.qkv_rows, "in_place", False)

    def mixed_writes_in_place(self, gather: Any, lanes: Sequence[Any]) -> bool:
        """Whether `mixed` writes in place for lanes read through `gather`: only where every read of the history
        is ordered after the writes (a paged gather that takes `after`, every lane with a block table)."""
        ordered_reads = getattr(gather, "orders_after", False) and all(lane.table is not None for lane in lanes)
        return self.writes_in_place and ordered_reads

    def mixed(self, tokens: mx.array, layout: StepLayout, pool: KVPool) -> mx.array:
        """The same forward for any step (`--fuse-mixed`): decode rows and prefill chunks, attention per lane as in
        `RaggedLayerCache`.

        The CUDA prologue writes the rows' K/V into the pool in place, a write MLX does not see: its graph orders
        kernels by the arrays they output. Its queries order the decode attention (which reads them); the pool's
        arrays are re-pointed through `mx.depends` on them so that a step evaluating only the pool (prefill without
        sampling) still runs the writes; and the history gather takes them as an input so it reads the pool after
        the writes. A step whose history is read any other way takes mlx-lm's prologue (a functional scatter)."""
        gather, chunk = layout.prefill_gather, layout.chunk_attention
        in_place = self.mixed_writes_in_place(gather, layout.lanes)
        qkv_rows = self.qkv_rows if in_place or not self.writes_in_place else plain_qkv_rows

        def attend(index: int, queries: mx.array, scale: float) -> mx.array:
            step = layout
            if in_place:
                pool.keys[index], pool.values[index] = mx.depends([pool.keys[index], pool.values[index]], [queries])
                ordered = chunk.ordered_after(queries) if isinstance(chunk, PagedChunkAttention) else chunk
                step = replace(layout, prefill_gather=functools.partial(gather, after=queries), chunk_attention=ordered)
            return RaggedLayerCache(pool, index, step).attention(queries, scale)

        return self._forward(tokens, layout.positions, layout.write_slots, pool, attend, qkv_rows)

    def _forward(
        self, tokens: mx.array, positions: mx.array, slots: mx.array, pool: KVPool,
        attend: Callable[[int, mx.array, float], mx.array], qkv_rows: QKVRows,
    ) -> mx.array:  # fmt: skip
        inner = self.model.model
        h = inner.embed_tokens(tokens)
        x = self.layers[0].block.input_layernorm(h)
        # each residual add is fused with the norm that reads its sum: the next block's, or the final one
        next_norms = [layer.block.input_layernorm for layer in self.layers[1:]] + [inner.norm]
        for index, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            block, attn = layer.block, layer.block.self_attn
            # quantized projections of many rows run dense where the runner folded them so (`--dequantize-rows`)
            queries = qkv_rows(self._project(layer.qkv, x), layer.spec, attn, positions, slots, pool, index)
            out = attend(index, queries, attn.scale)
            attended = self._project(attn.o_proj, out.reshape(h.shape[0], -1))
            h, x = self.add_norm(h, attended, block.post_attention_layernorm)
            h, x = self.add_norm(h, self._mlp(layer, x), next_norm)
        return x

    def _project(self, linear: nn.Module, x: mx.array) -> mx.array:
        """`linear(x)`, through its evaluated transpose where it is a dense linear met at start-up."""
        entry = self._transposed.get(id(linear))
        if entry is None or not entry.applies_to(linear):
            return linear(x)
        return mx.addmm(linear["bias"], x, entry.transposed) if "bias" in linear else x @ entry.transposed

    def _mlp(self, layer: FusedLayer, x: mx.array) -> mx.array:
        if layer.gate_up is None:  # an experts block (dense for enough rows where `dense_experts` is installed)
            return layer.block.mlp(x)
        gate_up = self._project(layer.gate_up, x)
        hidden = gate_up.shape[-1] // 2
        return self._project(layer.block.mlp.down_proj, swiglu(gate_up[:, :hidden], gate_up[:, hidden:]))


def _dense_projections(layer: FusedLayer) -> list[nn.Module]:
    """The projections the fused forward calls itself: q/k/v as one, o_proj, and a dense MLP's gate/up and down."""
    projections = [layer.qkv, layer.block.self_attn.o_proj]
    if layer.gate_up is not None:
        projections += [layer.gate_up, layer.block.mlp.down_proj]
    return projections


def _head_dim(attn: Any) -> int:
    # the weight's rows: [out, in], or [k_splits, out, in / k_splits] once split over K (`quantized_rows.split_k`)
    return unadapted(attn.q_proj).weight.shape[-2] // attn.n_heads if not hasattr(attn, "head_dim") else attn.head_dim


def _spec(attn: Any) -> HeadSpec:
    norm = getattr(attn, "q_norm", None)
    return HeadSpec(
        heads=attn.n_heads,
        kv_heads=attn.n_kv_heads,
        head_dim=_head_dim(attn),
        norm_eps=None if norm is None else float(norm.eps),
        rope_base=float(attn.rope.base),
        rope_scale=float(attn.rope.scale),
        rope_traditional=bool(attn.rope.traditional),
    )


def _quantization(linear: nn.Module) -> tuple:
    return (type(linear), getattr(linear, "group_size", None), getattr(linear, "bits", None),
            getattr(linear, "mode", None), "bias" in linear)  # fmt: skip


def _concatenate(linears: list[nn.Module]) -> nn.Module:
    """One linear over the rows of all `linears` (weights, quantization scales and biases, biases); each of
    `linears` is re-pointed at its slice of the new arrays, so no weight is held twice."""
    names = [name for name in ("weight", "scales", "biases", "bias") if name in linears[0]]
    fused = copy.copy(linears[0])
    for name in names:  # along the output rows, which split weights hold in their second-to-last axis
        parts = [linear[name] for linear in linears]
        setattr(fused, name, mx.concatenate(parts, axis=-2 if parts[0].ndim > 1 else 0))
    mx.eval(fused.parameters())
    start = 0
    for linear in linears:
        rows = linear[names[0]].shape[-2]
        for name in names:
            array = fused[name]
            setattr(linear, name, array[..., start : start + rows, :] if array.ndim > 1 else array[start : start + rows])
        start += rows
    mx.eval([linear.parameters() for linear in linears])
    return fused

