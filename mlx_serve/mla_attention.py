"""Multi-head latent attention (DeepSeek-V3 and the families built like it: Kimi K2, GLM-4.7-Flash) on ragged steps.

mlx-lm's MLA caches a latent (`kv_lora_rank` values) and a RoPE key (`qk_rope_head_dim`) a token, scores the RoPE part
itself over the whole history its cache returns (those scores are the mask it hands SDPA), and takes the absorbed form
for one-row sequences and the expanded form for longer ones. So the rows cannot reach it as `[T, 1]` with a cache that
returns only their own K/V. The module's own forward is called once per lane group instead, as mlx-lm's generation
calls it: the single-row lanes together as `[lanes, 1]`, each over its history padded to the widest and masked past its
length; each multi-row lane as `[1, rows]` behind its causal mask. Their caches (`_DecodeGroup`, `_Lane`) write the rows
into the pool (the latent as keys, the RoPE key as values: `KVLayout.value_dim`) and return the group's history.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_serve.kv_pool import take_rows
from mlx_serve.ragged import DecodeRows, LaneRows, RaggedLayerCache


def is_mla(module: Any) -> bool:
    """An attention module of mlx-lm's latent form: it caches the latent, and absorbs its up-projections."""
    return hasattr(module, "kv_lora_rank") and hasattr(module, "embed_q") and hasattr(module, "unembed_out")


@dataclass(frozen=True, slots=True)
class LatentDims:
    """What latent attention caches a token: the latent and the RoPE key."""

    latent: int
    rope_key: int


def mla_dims(model: Any) -> LatentDims | None:
    """The cached sizes where the model's attention is mlx-lm's latent MLA; None otherwise."""
    found = next((m for _, m in model.named_modules() if is_mla(m)), None)
    return LatentDims(int(found.kv_lora_rank), int(found.qk_rope_head_dim)) if found is not None else None


@dataclass(frozen=True, slots=True)
class HeadSizes:
    key: int
    value: int


def expanded_latent_heads(model: Any) -> HeadSizes | None:
    """DeepSeek-V2's and MiniCPM3's form, which up-projects the latent and caches every head's key (`q_head_dim`:
    the no-RoPE and RoPE parts) and value (`v_head_dim`): those sizes; None for any other attention. Such layers
    attend through the ragged dispatcher, over keys and values of two sizes."""
    found = next((m for _, m in model.named_modules()
                  if hasattr(m, "kv_b_proj") and hasattr(m, "q_head_dim") and not is_mla(m)), None)  # fmt: skip
    return HeadSizes(int(found.q_head_dim), int(found.v_head_dim)) if found is not None else None


class _DecodeGroup:
    """mlx-lm's cache protocol for the step's single-row lanes at once: each one's history, padded to the widest
    block table; `mask` keeps each lane's own positions."""

    def __init__(self, cache: RaggedLayerCache) -> None:
        rows = cache.step.decode
        self._cache, self._count = cache, rows.count
        self.offset = cache.step.positions[: rows.count]
        self._slots, self.mask = cache.step.once("latent decode", _decode_reads, rows)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        pool, layer = self._cache.pool, self._cache.layer
        pool.write(layer, self._cache.step.write_slots[: self._count], keys[:, :, 0, :], values[:, :, 0, :])
        return take_rows(pool.keys[layer], self._slots), take_rows(pool.values[layer], self._slots)


class _Lane:
    """mlx-lm's cache protocol for one multi-row lane: its history and its rows; `mask` is causal."""

    def __init__(self, cache: RaggedLayerCache, lane: LaneRows) -> None:
        self._cache, self._lane = cache, lane
        self.offset = cache.step.positions[lane.row_start : lane.row_start + 1]
        self.mask = cache.step.once(("latent lane", lane.row_start), _causal_mask, lane)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        pool, layer, lane = self._cache.pool, self._cache.layer, self._lane
        slots = self._cache.step.write_slots[lane.row_start : lane.row_start + lane.rows]
        pool.write(layer, slots, keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2))
        return pool.gather(layer, lane.kv_slots)


def _decode_reads(rows: DecodeRows) -> tuple[mx.array, mx.array]:
    """The single-row lanes' slots `[n, width]` through their block tables, padded to the widest, and the mask
    `[n, 1, 1, width]` that keeps each one's own positions."""
    size = rows.block_size
    width = rows.block_tables.shape[1] * size
    slots = (rows.block_tables[:, :, None] * size + mx.arange(size, dtype=mx.int32)).reshape(rows.count, width)
    return slots, (mx.arange(width, dtype=mx.int32)[None] < rows.lengths[:, None])[:, None, None, :]


def _causal_mask(lane: LaneRows) -> mx.array:
    """A multi-row lane's rows `[rows, kv_len]` over its exact history and themselves."""
    end = lane.kv_slots.shape[0]
    queries = mx.arange(end - lane.rows, end, dtype=mx.int32)
    return mx.arange(end, dtype=mx.int32)[None] <= queries[:, None]


def _ragged_forward(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    signature = inspect.signature(original)
    # Mistral 4 passes a query scale per row (Llama 4's position scaling) before the mask: `[T, 1, 1, 1]` here
    scaled = "attn_scale" in signature.parameters

    def __call__(self: Any, *args: Any, **kwargs: Any) -> mx.array:
        arguments = signature.bind(self, *args, **kwargs).arguments
        cache = arguments.get("cache")
        if not isinstance(cache, RaggedLayerCache):
            return original(self, *args, **kwargs)
        x, row_scale = arguments["x"], arguments.get("attn_scale")

        def attend(start: int, count: int, batch: int, layer_cache: Any) -> mx.array:
            rows = x[start : start + count].reshape(batch, count // batch, -1)
            if not scaled:
                return original(self, rows, layer_cache.mask, layer_cache)
            scale = row_scale[start : start + count].reshape(batch, 1, count // batch, 1)
            return original(self, rows, scale, layer_cache.mask, layer_cache)

        outputs = []
        if cache.step.decode is not None:
            outputs.append(attend(0, cache.step.decode.count, cache.step.decode.count, _DecodeGroup(cache)))
        for lane in cache.step.lanes:
            outputs.append(attend(lane.row_start, lane.rows, 1, _Lane(cache, lane)).reshape(lane.rows, 1, -1))
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)

    __call__.ragged_mla = True
    return __call__


def install_mla_forwards(model: Any) -> bool:
    """Give the model's latent-MLA attention classes the lane-grouped forward (idempotent, per class); whether it
    has any."""
    classes = {type(m) for _, m in model.named_modules() if is_mla(m)}
    for cls in classes:
        if not getattr(cls.__call__, "ragged_mla", False):
            cls.__call__ = _ragged_forward(cls.__call__)
    return bool(classes)
