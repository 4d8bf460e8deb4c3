"""The Core ML prefill program's inputs and outputs, and the host-side arrays that feed it.

One function per chunk size, named `prefill_<rows>`, all in one multifunction `.mlpackage`. Every tensor is
fp16. With C = hidden size, S = chunk rows, M = max context (the past KV a chunk may see), KVH = KV heads,
D = head dim, and T = M + S:

inputs
  `hidden`        (1, C, 1, S)     the chunk's token embeddings (the embedding stays in MLX), rows padded
  `rope_cos/sin`  (1, 1, D, S)     RoPE tables for the chunk's positions, both halves repeated
  `attn_mask`     (1, 1, S, T)     additive: 0 where a row may attend, `MASKED` elsewhere
  `past_k_<i>`, `past_v_<i>`  (1, KVH, M, D)  layer i's keys/values of positions [0, start), zero past it
outputs
  `hidden_out`    (1, C, 1, S)     hidden states AFTER the model's final RMSNorm: the host applies only
                                   the LM head (lm_head or tied embedding) to the rows it samples
  `k_<i>`, `v_<i>` (1, KVH, S, D)  the chunk's new keys (after k_norm and RoPE) and values, layer i:
                                   exactly what mlx-lm's KV cache stores for those positions
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MASKED = -30000.0  # fp16-safe "minus infinity": exp() underflows to 0, no inf - inf = NaN on any device


@dataclass(frozen=True, slots=True)
class ChunkGeometry:
    rows: int  # S: rows per call (a shorter last chunk is padded at the end)
    max_context: int  # M: how many past positions a chunk may attend to
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int

    @property
    def function_name(self) -> str:
        return function_name(self.rows)

    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {
            "hidden": (1, self.hidden_size, 1, self.rows),
            "rope_cos": (1, 1, self.head_dim, self.rows),
            "rope_sin": (1, 1, self.head_dim, self.rows),
            "attn_mask": (1, 1, self.rows, self.max_context + self.rows),
        }
        past = (1, self.num_kv_heads, self.max_context, self.head_dim)
        for layer in range(self.num_layers):
            shapes[past_key_name(layer)] = past
            shapes[past_value_name(layer)] = past
        return shapes


def function_name(rows: int) -> str:
    return f"prefill_{rows}"


def past_key_name(layer: int) -> str:
    return f"past_k_{layer}"


def past_value_name(layer: int) -> str:
    return f"past_v_{layer}"


def new_key_name(layer: int) -> str:
    return f"k_{layer}"


def new_value_name(layer: int) -> str:
    return f"v_{layer}"


def attention_mask(start: int, rows: int, max_context: int) -> np.ndarray:
    """Row i (position start+i) sees past slots [0, start) and chunk rows [0, i]; padding rows are harmless."""
    mask = np.full((rows, max_context + rows), MASKED, dtype=np.float16)
    mask[:, :start] = 0.0
    chunk = mask[:, max_context:]
    chunk[np.tril_indices(rows)] = 0.0
    return mask[None, None]


def pad_past(past: np.ndarray, max_context: int) -> np.ndarray:
    """(1, KVH, start, D) -> (1, KVH, M, D) fp16, zeros after start."""
    _, heads, start, dim = past.shape
    if start > max_context:
        raise ValueError(f"past of {start} positions exceeds the package's max context {max_context}")
    padded = np.zeros((1, heads, max_context, dim), dtype=np.float16)
    padded[:, :, :start] = past
    return padded


def channels_first(rows_by_channel: np.ndarray, rows: int) -> np.ndarray:
    """(n, C) host rows -> (1, C, 1, S) fp16, zero-padded to S rows."""
    n, channels = rows_by_channel.shape
    out = np.zeros((1, channels, 1, rows), dtype=np.float16)
    out[0, :, 0, :n] = rows_by_channel.T
    return out


def rows_last(channels_first_array: np.ndarray, n: int) -> np.ndarray:
    """(1, C, 1, S) -> (n, C): the first n (real) rows."""
    return channels_first_array[0, :, 0, :n].T
