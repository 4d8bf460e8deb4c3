"""Llama 4 on ragged steps. Two things in mlx-lm's llama4 read a single offset for the whole batch:

- the text model builds its chunked mask from `cache.offset` and `start_position` (a row's own chunk is kept by the
  chunked layers' window masks here, `KVLayout.chunked`, and the full layers' by the lanes' causal masks), so its
  forward becomes embed, layers, norm for a ragged step;
- the layers without RoPE scale their queries by a temperature that grows with the position
  (`attn_temperature_tuning`), from `arange(offset + 1, ...)`: here each row's scale comes from its own position.

Any other cache (mlx-lm's own generation) gets mlx-lm's forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_serve.ragged import RaggedLayerCache, project_heads

LLAMA4_MODULE = "mlx_lm.models.llama4"  # checked against mlx-lm 0.32.2
_ATTENTION_ATTRIBUTES = ("q_proj", "k_proj", "v_proj", "o_proj", "use_rope", "use_qk_norm", "n_heads", "n_kv_heads",
                         "scale", "attn_temperature_tuning", "floor_scale", "attn_scale")  # fmt: skip


def _model_forward(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def __call__(self: Any, inputs: mx.array, cache: Any = None) -> mx.array:
        if cache is None or not isinstance(cache[0], RaggedLayerCache):
            return original(self, inputs, cache)
        h = self.embed_tokens(inputs)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, None, cache=layer_cache)  # masks come from each layer's cache (window, chunk, lanes)
        return self.norm(h)

    __call__.ragged_llama4 = True
    return __call__


def temperature_scales(positions: mx.array, floor_scale: int, attn_scale: float) -> mx.array:
    """mlx-lm's query scale for a row at each position `[T]`, as float32 `[T]` (its order of operations)."""
    return mx.log(mx.floor((positions + 1) / floor_scale) + 1.0) * attn_scale + 1.0


def _attention_forward(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def __call__(self: Any, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if not isinstance(cache, RaggedLayerCache):
            return original(self, x, mask, cache)
        batch, length, _ = x.shape  # [T, 1, hidden]: every row its own batch element
        queries, keys, values = project_heads(self, x)
        if self.use_rope:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
        if self.use_qk_norm:
            queries = mx.fast.rms_norm(queries, weight=None, eps=1e-6)
            keys = mx.fast.rms_norm(keys, weight=None, eps=1e-6)
        if self.attn_temperature_tuning and not self.use_rope:
            scales = temperature_scales(cache.offset, self.floor_scale, self.attn_scale)
            queries = (queries * scales.reshape(batch, 1, 1, 1)).astype(queries.dtype)
        cache.update_and_fetch(keys, values)
        output = cache.attention(queries, self.scale)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    __call__.ragged_llama4 = True
    return __call__


def install_llama4_forwards(model: Any) -> bool:
    """Give mlx-lm's Llama 4 text model and attention classes among the model's modules the ragged forwards
    (idempotent, per class); whether the model has them. Raises RuntimeError where the attention lacks what the
    forward reads (a changed mlx-lm)."""
    modules = [m for _, m in model.named_modules() if type(m).__module__ == LLAMA4_MODULE]
    attention = [m for m in modules if type(m).__name__ == "Attention"]
    text_models = [m for m in modules if type(m).__name__ == "LlamaModel"]
    for module in attention:
        missing = [name for name in _ATTENTION_ATTRIBUTES if not hasattr(module, name)]
        if missing:
            raise RuntimeError(f"{LLAMA4_MODULE}.Attention has no {', '.join(missing)}: not the one we route")
    for cls, forward in [(type(m), _attention_forward) for m in attention[:1]] + [
        (type(m), _model_forward) for m in text_models[:1]
    ]:
        if not getattr(cls.__call__, "ragged_llama4", False):
            cls.__call__ = forward(cls.__call__)
    return bool(attention)
