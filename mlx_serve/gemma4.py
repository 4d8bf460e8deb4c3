"""Gemma 4 on ragged steps: its last `num_kv_shared_layers` layers compute no K/V of their own but attend over the
K/V of the last earlier layer of their kind (sliding or full), which mlx-lm passes along as that layer's output.

mlx-lm's text model pads the cache list with None for those layers; on a ragged step each gets a `SharedKVCache` of
its owner instead, so its attention reads the owner's pool (and window) as the owner's does. The pool keeps the
owners' K/V only (`model_source.cache_layers`), each layer with its own head count and size (`KVLayout.layer_heads`:
full-attention layers have wider heads). Any other cache (mlx-lm's own generation) gets mlx-lm's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_serve.ragged import RaggedLayerCache, SharedKVCache

GEMMA4_MODULE = "mlx_lm.models.gemma4_text"  # checked against mlx-lm 0.32.2


def _model_forward(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def __call__(self: Any, inputs: mx.array | None = None, cache: Any = None, **kwargs: Any) -> mx.array:
        if cache and isinstance(cache[0], RaggedLayerCache) and len(cache) < len(self.layers):
            owners = self.previous_kvs  # each layer's K/V source: itself, or for a shared layer its owner
            cache = [*cache, *(SharedKVCache(cache[owners[i]]) for i in range(len(cache), len(self.layers)))]
        return original(self, inputs, cache=cache, **kwargs)

    __call__.ragged_gemma4 = True
    return __call__


def install_gemma4_forwards(model: Any) -> bool:
    """Give mlx-lm's Gemma 4 text model class the forward that hands KV-shared layers their owners' caches
    (idempotent); whether the model has one. Raises RuntimeError where it lacks `previous_kvs` (a changed mlx-lm)."""
    text_models = [m for _, m in model.named_modules()
                   if type(m).__module__ == GEMMA4_MODULE and type(m).__name__ == "Gemma4TextModel"]  # fmt: skip
    for module in text_models:
        if not hasattr(module, "previous_kvs"):
            raise RuntimeError(f"{GEMMA4_MODULE}.Gemma4TextModel has no previous_kvs: not the one we route")
        if not getattr(type(module).__call__, "ragged_gemma4", False):
            type(module).__call__ = _model_forward(type(module).__call__)
    return bool(text_models)
