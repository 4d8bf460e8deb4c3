"""The paged KV pool: MLX arrays per layer, addressed by slot = block_id * block_size + offset.

Block *accounting* (which blocks are free, shared, cached) lives in `scheduler.kv_blocks`; this module only
holds the arrays and moves rows in and out of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    # each layer's attention window in tokens (None: every earlier token); empty: none windowed. A windowed layer's KV
    # lives in the pool's window space where it has one (only the blocks its window reaches), else it is kept whole
    windows: tuple[int | None, ...] = ()
    # windowed layers whose window is a fixed chunk instead (Llama 4): a row sees the earlier positions of its own
    # `window`-token chunk only, never more than a window of `window` tokens reaches, so the window space serves both
    chunked: tuple[int, ...] = ()
    # full-attention layers' KV stored quantized (mlx-lm's QuantizedKVCache: `mx.quantize` along head_dim, `group_size`
    # values a scale and a bias); None: in `dtype`. Windowed layers stay in `dtype`, as mlx-lm keeps its rotating caches
    bits: int | None = None
    group_size: int = 64
    # layers that keep a recurrent state instead of K/V (`mlx_serve.recurrent`): they hold nothing here
    recurrent: tuple[int, ...] = ()
    # a value's size where it differs from a key's (0: `head_dim`): multi-head latent attention keeps a latent as its
    # "key" and the RoPE key as its "value" (`mla_attention`, `latent`), DeepSeek-V2's expanded heads a shorter value
    value_dim: int = 0
    latent: bool = False
    # each layer's (kv heads, key size, value size) where the layers differ (Gemma 4's full-attention layers: wider
    # heads, fewer of them; MiMo-V2's sliding layers: heads of other sizes); empty: `num_kv_heads`, `head_dim` and
    # `value_size` in every layer
    layer_heads: tuple[tuple[int, int, int], ...] = ()

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_heads[layer][0] if self.layer_heads else self.num_kv_heads

    def key_size_of(self, layer: int) -> int:
        return self.layer_heads[layer][1] if self.layer_heads else self.head_dim

    def value_size_of(self, layer: int) -> int:
        return self.layer_heads[layer][2] if self.layer_heads else self.value_size

    def values_differ(self, layer: int) -> bool:
        """Whether the layer's values are of another size than its keys (the paged kernels read one size)."""
        return self.value_size_of(layer) != self.key_size_of(layer)

    @property
    def any_values_differ(self) -> bool:
        """Whether some layer's values differ in size from its keys (latent attention, expanded latent heads, MiMo)."""
        return any(self.values_differ(layer) for layer in range(self.num_layers))

    @property
    def key_sizes(self) -> set[int]:
        """Every layer's head size (one, but for `layer_heads`)."""
        return {self.key_size_of(layer) for layer in range(self.num_layers)}

    @property
    def value_size(self) -> int:
        return self.value_dim or self.head_dim

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def quantizes(self, layer: int) -> bool:
        return self.bits is not None and self.window(layer) is None and self.attends(layer)

    def attends(self, layer: int) -> bool:
        """Whether the layer keeps K/V (not a recurrent state)."""
        return layer not in self.recurrent

    @property
    def first_attention_layer(self) -> int:
        return next(layer for layer in range(self.num_layers) if self.attends(layer))

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def is_chunked(self, layer: int) -> bool:
        return layer in self.chunked

    @property
    def widest_window(self) -> int:
        """The longest window of any layer (0: no layer is windowed)."""
        return max((w for w in self.windows if w is not None), default=0)

    @property
    def num_windowed(self) -> int:
        return sum(w is not None for w in self.windows)

    def bytes_per_token(self) -> int:
        return sum(self._layer_bytes_per_token(layer) for layer in range(self.num_layers))

    def windowed_bytes_per_token(self) -> int:
        """What a token of the windowed layers alone holds."""
        return sum(self._layer_bytes_per_token(layer) for layer in range(self.num_layers) if self.window(layer))

    def _layer_bytes_per_token(self, layer: int) -> int:
        if not self.attends(layer):
            return 0
        size = self.key_size_of(layer)
        head = (size + self.value_size_of(layer)) * self.dtype.size
        if self.quantizes(layer):  # packed values, then a scale and a bias per group
            head = 2 * (size * self.bits // 8 + 2 * (size // self.group_size) * self.dtype.size)
        return self.kv_heads_of(layer) * head


class KVPool:
    """Keys and values of every layer, `[(num_blocks + 1) * block_size, kv_heads, head_dim]` each.

    Blocks [0, num_blocks) belong to the scheduler's block manager. One more, `scratch_block`, is never handed
    out: padding rows of a bucketed step write and read there (see `compiled_step`). With a window space
    (`window_blocks` > 0) the sliding-window layers' arrays hold `window_blocks + 1` blocks instead, addressed by the
    scheduler's window-space block ids (`Lane.window_block_ids`), the last one their scratch block.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, window_blocks: int = 0) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window_blocks = window_blocks if layout.num_windowed else 0
        self.owner = self  # the pool whose `functional_writes` a view's writes count toward
        self.functional_writes = 0  # writes through MLX's scatter so far (see `write`)
        # each layer's array, or with quantized KV its (packed values, scales, biases) as mlx-lm's quantized caches hold
        self.keys = [self._zeros(layer, layout.key_size_of(layer)) for layer in range(layout.num_layers)]
        self.values = [self._zeros(layer, layout.value_size_of(layer)) for layer in range(layout.num_layers)]
        mx.eval(self.state())

    def _zeros(self, layer: int, dim: int) -> mx.array | tuple[mx.array, mx.array, mx.array]:
        layout = self.layout
        blocks = self.window_blocks if self.in_window_space(layer) else self.num_blocks
        if not layout.attends(layer):  # a recurrent layer's state lives in `recurrent.StatePool`
            return mx.zeros((0, layout.num_kv_heads, dim), layout.dtype)
        rows = ((blocks + 1) * self.block_size, layout.kv_heads_of(layer))
        if not layout.quantizes(layer):
            return mx.zeros((*rows, dim), layout.dtype)
        groups = dim // layout.group_size
        packed = mx.zeros((*rows, dim * layout.bits // 32), mx.uint32)
        return packed, mx.zeros((*rows, groups), layout.dtype), mx.zeros((*rows, groups), layout.dtype)

    def in_window_space(self, layer: int) -> bool:
        return self.window_blocks > 0 and self.layout.window(layer) is not None

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def window_scratch_block(self) -> int:
        return self.window_blocks

    @property
    def nbytes(self) -> int:
        """What the pool's arrays hold (both spaces, quantized parts included, scratch blocks too)."""
        return sum(array.nbytes for array in self.state())

    def window_table(self, block_ids: Sequence[int]) -> np.ndarray:
        """A window-space table as int32, blocks behind the window (`NO_BLOCK`) read as the scratch block."""
        table = np.asarray(block_ids, dtype=np.int32)
        return np.where(table < 0, np.int32(self.window_scratch_block), table)

    def view(self, keys: list[mx.array], values: list[mx.array]) -> KVPool:
        """The same pool over other arrays (a compiled step's traced inputs); writes go to the view's lists."""
        view = object.__new__(KVPool)
        view.layout, view.num_blocks, view.block_size = self.layout, self.num_blocks, self.block_size
        view.window_blocks = self.window_blocks
        view.owner, view.functional_writes = self.owner, 0
        view.keys, view.values = list(keys), list(values)
        return view

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store rows `[T, kv_heads, head_dim]` at `slots` `[T]` (quantized first where the pool is).

        A scatter writes in place only where MLX may donate the layer's array to it, which it may not while a queued
        step still holds that array: the runner waits for such a step first (counted here, `ModelRunner._queue`)."""
        self.owner.functional_writes += 1
        layout = self.layout
        if not layout.quantizes(layer):
            self.keys[layer][slots] = keys
            self.values[layer][slots] = values
            return
        for stored, rows in ((self.keys[layer], keys), (self.values[layer], values)):
            for part, quantized in zip(stored, mx.quantize(rows, group_size=layout.group_size, bits=layout.bits)):
                part[slots] = quantized

    def gather(self, layer: int, slots: mx.array) -> tuple[Any, Any]:
        """Rows at `slots` as `[1, kv_heads, len(slots), head_dim]` (quantized: each part so), ready for SDPA."""
        return take_rows(self.keys[layer], slots[None]), take_rows(self.values[layer], slots[None])

    def state(self) -> list[mx.array]:
        """Every array the pool holds."""
        if self.layout.bits is None:
            return self.keys + self.values
        return [part for stored in (*self.keys, *self.values) for part in (stored if isinstance(stored, tuple | list)
                                                                           else (stored,))]  # fmt: skip


def take_rows(stored: Any, slots: mx.array) -> Any:
    """A layer's keys or values at `slots` `[n, S]` as `[n, kv_heads, S, ...]`: an array, or the parts of quantized
    ones (as `quantized_scaled_dot_product_attention` takes them)."""
    if isinstance(stored, tuple | list):
        return tuple(part[slots].transpose(0, 2, 1, 3) for part in stored)
    return stored[slots].transpose(0, 2, 1, 3)


def slot_array(block_ids: Sequence[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Pool slots of positions [start, end) for a request with these blocks, as int32 (vectorised: a 16k history
    costs microseconds, not milliseconds)."""
    blocks = np.asarray(block_ids[: -(-end // block_size)], dtype=np.int32)
    return (blocks[:, None] * block_size + np.arange(block_size, dtype=np.int32)).reshape(-1)[start:end]
