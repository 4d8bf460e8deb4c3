"""Host-side (MLX) halves of an ANE chunk: the arrays that go in, and what comes out, per `contract.py`.

The embedding and the LM head stay in MLX; RoPE tables come from the model's own RoPE module, so every RoPE
variant mlx-lm implements as a rotation (default, linear, llama3, yarn, dynamic) is carried exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlx_serve.ane import contract


def rope_tables(model, start: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin for positions [start, start+rows), each (1, 1, D, rows) fp16.

    Rotating the unit vector (1...1, 0...0) through the model's RoPE yields (cos, sin) in its two halves.
    """
    rope = model.layers[0].self_attn.rope
    head_dim = round(model.layers[0].self_attn.scale ** -2)
    half = head_dim // 2
    unit = mx.concatenate([mx.ones((1, 1, rows, half)), mx.zeros((1, 1, rows, half))], axis=-1)
    rotated = np.array(rope(unit, offset=start).astype(mx.float32))[0, 0]  # (rows, D)
    cos, sin = rotated[:, :half], rotated[:, half:]
    as_table = lambda t: np.concatenate([t, t], axis=1).T[None, None].astype(np.float16)  # noqa: E731
    return as_table(cos), as_table(sin)


def chunk_inputs(
    geometry: contract.ChunkGeometry,
    embeddings: np.ndarray,
    start: int,
    past_keys: Sequence[np.ndarray],
    past_values: Sequence[np.ndarray],
    tables: tuple[np.ndarray, np.ndarray],
) -> dict[str, np.ndarray]:
    """The named inputs of one call (NumPy only: safe off the engine thread).

    embeddings: (n, C) for n <= rows real tokens; past_keys/values[i]: (1, KVH, start, D);
    tables: `rope_tables(model, start, >= rows)`, cut here to the call's rows.
    """
    n = embeddings.shape[0]
    if n > geometry.rows:
        raise ValueError(f"{n} tokens do not fit a {geometry.rows}-row chunk")
    cos, sin = tables
    inputs = {
        "hidden": contract.channels_first(embeddings, geometry.rows),
        "rope_cos": cos[..., : geometry.rows],
        "rope_sin": sin[..., : geometry.rows],
        "attn_mask": contract.attention_mask(start, geometry.rows, geometry.max_context),
    }
    for layer in range(geometry.num_layers):
        inputs[contract.past_key_name(layer)] = contract.pad_past(past_keys[layer], geometry.max_context)
        inputs[contract.past_value_name(layer)] = contract.pad_past(past_values[layer], geometry.max_context)
    return inputs


def embed(model, token_ids: Sequence[int]) -> mx.array:
    """(n, C) embeddings through the model's own embedding (kept in MLX)."""
    return model.model.embed_tokens(mx.array(list(token_ids)))


def lm_head(model, hidden: mx.array) -> mx.array:
    """Logits for rows of final-normed hidden states (the program already applied the final norm)."""
    if getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)
