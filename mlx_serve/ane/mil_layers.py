"""The decoder block as MIL ops, in Core ML's channels-first layout, all fp16.

Activations are `(1, C, 1, S)`: channels on axis 1, the chunk's S rows on the last axis, so every linear is a
1x1 conv (the layout and op the Neural Engine runs best). Attention works per KV-head group:
queries `(KVH, G*S, D)` against keys `(KVH, T, D)` with `T = max_context + S` (the request's padded past
plus the chunk), masked by a host-supplied additive mask.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb

from mlx_serve.ane.spec import DenseSpec, LayerWeights, Linear

FP16 = np.float16


def linear(x, lin: Linear, name: str):
    """A linear layer as a 1x1 conv over `(1, in, 1, S)` -> `(1, out, 1, S)`."""
    weight = lin.weight.astype(FP16)[:, :, None, None]
    bias = None if lin.bias is None else lin.bias.astype(FP16)
    if bias is None:
        return mb.conv(x=x, weight=weight, name=name)
    return mb.conv(x=x, weight=weight, bias=bias, name=name)


def rms_norm(x, weight: np.ndarray, eps: float, axis: int, name: str):
    """RMSNorm over `axis`, safe in fp16.

    x * x overflows fp16 once |x| > ~256 (x^2 -> inf, rsqrt(inf) -> 0, a silently zeroed row). So each row is
    first divided by max(1, max|x|): the squares stay <= 1 and the row's peak keeps the mean above 1/C.
    rms(x/s) = rms(x)/s, so with eps scaled by 1/s^2 the result is exactly RMSNorm(x).
    """
    peak = mb.reduce_max(x=mb.abs(x=x), axes=[axis], keep_dims=True)
    inv_scale = mb.real_div(x=FP16(1.0), y=mb.maximum(x=peak, y=FP16(1.0)))
    scaled = mb.mul(x=x, y=inv_scale)
    mean_square = mb.reduce_mean(x=mb.mul(x=scaled, y=scaled), axes=[axis], keep_dims=True)
    scaled_eps = mb.mul(x=mb.mul(x=inv_scale, y=inv_scale), y=FP16(eps))
    inv_rms = mb.rsqrt(x=mb.add(x=mean_square, y=scaled_eps), epsilon=FP16(0.0))
    shape = [1] * 4
    shape[axis] = weight.shape[0]
    return mb.mul(x=mb.mul(x=scaled, y=inv_rms), y=weight.astype(FP16).reshape(shape), name=name)


def rope(x, cos, sin, head_dim: int):
    """Rotate-half RoPE on `(1, N, D, S)` with host tables `(1, 1, D, S)` (cos/sin repeated over both halves)."""
    first, second = mb.split(x=x, num_splits=2, axis=2)
    rotated = mb.concat(values=[mb.mul(x=second, y=FP16(-1.0)), first], axis=2)
    return mb.add(x=mb.mul(x=x, y=cos), y=mb.mul(x=rotated, y=sin))


def _heads(x, num_heads: int, head_dim: int, rows: int):
    """`(1, N*D, 1, S)` -> `(1, N, D, S)`."""
    return mb.reshape(x=x, shape=[1, num_heads, head_dim, rows])


def _keys_values(h, weights: LayerWeights, spec: DenseSpec, rope_tables, rows: int, prefix: str):
    """The chunk's new K (normed, rotated) and V, both `(1, KVH, S, D)`: the layout mlx-lm's KV caches use."""
    cos, sin = rope_tables
    keys = _heads(linear(h, weights.k, f"{prefix}_k_proj"), spec.num_kv_heads, spec.head_dim, rows)
    if weights.k_norm is not None:
        keys = rms_norm(keys, weights.k_norm, spec.rms_norm_eps, axis=2, name=f"{prefix}_k_norm")
    keys = rope(keys, cos, sin, spec.head_dim)
    values = _heads(linear(h, weights.v, f"{prefix}_v_proj"), spec.num_kv_heads, spec.head_dim, rows)
    perm = [0, 1, 3, 2]
    return mb.transpose(x=keys, perm=perm, name=f"{prefix}_k_new"), mb.transpose(
        x=values, perm=perm, name=f"{prefix}_v_new"
    )


def _queries(h, weights: LayerWeights, spec: DenseSpec, rope_tables, rows: int, prefix: str):
    """Queries grouped by KV head, pre-scaled by 1/sqrt(D): `(KVH, G*S, D)`."""
    cos, sin = rope_tables
    queries = _heads(linear(h, weights.q, f"{prefix}_q_proj"), spec.num_heads, spec.head_dim, rows)
    if weights.q_norm is not None:
        queries = rms_norm(queries, weights.q_norm, spec.rms_norm_eps, axis=2, name=f"{prefix}_q_norm")
    queries = mb.mul(x=rope(queries, cos, sin, spec.head_dim), y=FP16(spec.head_dim**-0.5))
    group = spec.num_heads // spec.num_kv_heads
    queries = mb.reshape(x=queries, shape=[spec.num_kv_heads, group, spec.head_dim, rows])
    queries = mb.transpose(x=queries, perm=[0, 1, 3, 2])
    return mb.reshape(x=queries, shape=[spec.num_kv_heads, group * rows, spec.head_dim])


def attention(h, weights: LayerWeights, spec: DenseSpec, layer_io, rope_tables, mask, rows: int, prefix: str):
    """Causal GQA attention of the chunk over the request's past KV plus its own. Returns (out, k_new, v_new)."""
    past_keys, past_values = layer_io
    k_new, v_new = _keys_values(h, weights, spec, rope_tables, rows, prefix)
    total = past_keys.shape[2] + rows
    kv_shape = [spec.num_kv_heads, total, spec.head_dim]
    keys = mb.reshape(x=mb.concat(values=[past_keys, k_new], axis=2), shape=kv_shape)
    values = mb.reshape(x=mb.concat(values=[past_values, v_new], axis=2), shape=kv_shape)
    queries = _queries(h, weights, spec, rope_tables, rows, prefix)
    group = spec.num_heads // spec.num_kv_heads
    scores = mb.matmul(x=queries, y=keys, transpose_y=True)
    scores = mb.add(x=mb.reshape(x=scores, shape=[spec.num_kv_heads, group, rows, total]), y=mask)
    probs = mb.reshape(x=mb.softmax(x=scores, axis=-1), shape=[spec.num_kv_heads, group * rows, total])
    out = mb.reshape(x=mb.matmul(x=probs, y=values), shape=[spec.num_kv_heads, group, rows, spec.head_dim])
    out = mb.transpose(x=out, perm=[0, 1, 3, 2])
    out = mb.reshape(x=out, shape=[1, spec.num_heads * spec.head_dim, 1, rows])
    return linear(out, weights.o, f"{prefix}_o_proj"), k_new, v_new


def mlp(h, weights: LayerWeights, prefix: str):
    gate = linear(h, weights.gate, f"{prefix}_gate_proj")
    up = linear(h, weights.up, f"{prefix}_up_proj")
    return linear(mb.mul(x=mb.silu(x=gate), y=up), weights.down, f"{prefix}_down_proj")


def decoder_layer(
    x, weights: LayerWeights, spec: DenseSpec, layer_io, rope_tables, mask, rows: int, index: int
):
    """One pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Returns (x, k_new, v_new)."""
    prefix = f"layer{index}"
    normed = rms_norm(x, weights.input_norm, spec.rms_norm_eps, axis=1, name=f"{prefix}_input_norm")
    attn_out, k_new, v_new = attention(normed, weights, spec, layer_io, rope_tables, mask, rows, prefix)
    h = mb.add(x=x, y=attn_out)
    normed = rms_norm(h, weights.post_attention_norm, spec.rms_norm_eps, axis=1, name=f"{prefix}_post_norm")
    return mb.add(x=h, y=mlp(normed, weights, prefix)), k_new, v_new
