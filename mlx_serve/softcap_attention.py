"""Gemma 2's attention on ragged steps: mlx-lm's gemma2 writes its attention out by hand (scores soft-capped by
`tanh(s / cap) * cap` before the mask and softmax) instead of calling `scaled_dot_product_attention`, so the
dispatcher in `ragged` never sees it.

For the model's Attention class only, `__call__` becomes a forward that, given a `RaggedLayerCache`, does mlx-lm's
projections, RoPE and cache update and then the cache's per-lane attention with the cap
(`ragged.softcapped_attention`, mlx-lm's op order); any other cache gets mlx-lm's own forward. The paged kernels and
the fused forward have no cap: the cache's `_masked` path never takes the former, and `fused_decode` refuses gemma2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_serve.ragged import RaggedLayerCache, project_heads

# mlx-lm modules whose Attention class computes soft-capped scores itself (checked against mlx-lm 0.32.2)
SOFTCAPPED_MODULES = ("mlx_lm.models.gemma2",)
_ATTRIBUTES = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "scale", "n_heads", "n_kv_heads",
               "attn_logit_softcapping")  # fmt: skip


def _ragged_forward(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def __call__(self: Any, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if not isinstance(cache, RaggedLayerCache):
            return original(self, x, mask, cache)
        batch, length, _ = x.shape  # [T, 1, hidden]: every row its own batch element
        queries, keys, values = project_heads(self, x)
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        cache.update_and_fetch(keys, values)
        output = cache.attention(queries, self.scale, softcap=self.attn_logit_softcapping)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    __call__.ragged_softcap = True
    return __call__


def install_softcapped_forwards(model: Any) -> bool:
    """Give the soft-capped Attention classes among the model's modules the ragged forward (idempotent, per class);
    whether the model has any. Raises RuntimeError where such a class lacks what the forward reads (a changed
    mlx-lm)."""
    classes = {type(m) for _, m in model.named_modules()
               if type(m).__module__ in SOFTCAPPED_MODULES and type(m).__name__ == "Attention"}  # fmt: skip
    for module in (m for _, m in model.named_modules() if type(m) in classes):
        missing = [name for name in _ATTRIBUTES if not hasattr(module, name)]
        if missing:
            raise RuntimeError(f"{type(module).__module__}.Attention has no {', '.join(missing)}: not the one we route")
    for cls in classes:
        if not getattr(cls.__call__, "ragged_softcap", False):
            cls.__call__ = _ragged_forward(cls.__call__)
    return bool(classes)
