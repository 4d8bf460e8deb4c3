"""Running one prefill chunk of any length through a package of fixed chunk sizes (NumPy only).

A chunk longer than the largest function is cut into pieces; each piece sees the request's past plus the
earlier pieces' new K/V; the last piece uses the smallest function that holds it (padded at the end).
The caller supplies `predict(rows, inputs) -> outputs`: Core ML's on macOS, the interpreter on Linux, so
the same host path is tested everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mlx_serve.ane import contract, host

Predict = Callable[[int, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass(frozen=True, slots=True)
class ChunkArrays:
    hidden: np.ndarray  # (n, C) after the final norm
    keys: tuple[np.ndarray, ...]  # per layer (1, KVH, n, D): the chunk's new keys
    values: tuple[np.ndarray, ...]


def pick_rows(geometries: Mapping[int, contract.ChunkGeometry], remaining: int) -> int:
    """The smallest function that holds the rest, else the largest."""
    return min((rows for rows in geometries if rows >= remaining), default=max(geometries))


def run_pieces(
    geometries: Mapping[int, contract.ChunkGeometry],
    predict: Predict,
    embeddings: np.ndarray,
    start: int,
    past_keys: Sequence[np.ndarray],
    past_values: Sequence[np.ndarray],
    tables: tuple[np.ndarray, np.ndarray],
) -> ChunkArrays:
    """tables: RoPE cos/sin for positions [start, start + len(embeddings) + largest rows)."""
    cos, sin = tables
    keys, values = list(past_keys), list(past_values)
    hidden_parts = []
    done = 0
    while done < len(embeddings):
        rows = pick_rows(geometries, len(embeddings) - done)
        piece = embeddings[done : done + rows]
        position = start + done
        piece_tables = (cos[..., done : done + rows], sin[..., done : done + rows])
        inputs = host.chunk_inputs(geometries[rows], piece, position, keys, values, piece_tables)
        out = predict(rows, inputs)
        n = len(piece)
        hidden_parts.append(contract.rows_last(np.asarray(out["hidden_out"]), n))
        for layer in range(len(keys)):
            keys[layer] = np.concatenate(
                [keys[layer], np.asarray(out[contract.new_key_name(layer)])[:, :, :n]], 2
            )
            values[layer] = np.concatenate(
                [values[layer], np.asarray(out[contract.new_value_name(layer)])[:, :, :n]], 2
            )
        done += n
    return ChunkArrays(
        hidden=np.concatenate(hidden_parts),
        keys=tuple(k[:, :, start:] for k in keys),
        values=tuple(v[:, :, start:] for v in values),
    )
