"""Check a saved package against the model's own MLX layers on Linux: the interpreter plays Core ML.

The prompt goes in scheduler-sized chunks (each may span several package calls), K/V carried across chunks;
every tensor's error is reported as max |err| / max |ref|. fp16 programs land near 0.2-0.4% on the tiny
test models; 1% is the stated tolerance (int8 weights: ~3%).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_serve.ane import host
from mlx_serve.ane.builder import package_geometries
from mlx_serve.ane.interpreter import Interpreter
from mlx_serve.ane.pieces import run_pieces

TOLERANCE = 0.01


@dataclass(frozen=True, slots=True)
class PromptArrays:
    hidden: np.ndarray  # (n, C) after the final norm
    keys: list[np.ndarray]  # per layer (1, KVH, n, D)
    values: list[np.ndarray]


def interpret_prompt(model, package: Path, tokens: Sequence[int], chunk: int) -> PromptArrays:
    geometries = package_geometries(package)
    interpreter = Interpreter.from_package(package)
    predict = lambda rows, inputs: interpreter.run(geometries[rows].function_name, inputs)  # noqa: E731
    first = next(iter(geometries.values()))
    empty = np.zeros((1, first.num_kv_heads, 0, first.head_dim), np.float16)
    keys, values = [empty] * first.num_layers, [empty] * first.num_layers
    hidden = []
    for start in range(0, len(tokens), chunk):
        piece = list(tokens[start : start + chunk])
        embeddings = np.array(host.embed(model, piece).astype(mx.float32))
        tables = host.rope_tables(model, start, len(piece) + max(geometries))
        out = run_pieces(geometries, predict, embeddings, start, keys, values, tables)
        hidden.append(out.hidden)
        keys = [np.concatenate([k, new], axis=2) for k, new in zip(keys, out.keys)]
        values = [np.concatenate([v, new], axis=2) for v, new in zip(values, out.values)]
    return PromptArrays(np.concatenate(hidden), keys, values)


def mlx_prompt(model, tokens: Sequence[int]) -> PromptArrays:
    """mlx-lm's own forward over the whole prompt: normed hidden states and the cache's K/V."""
    from mlx_lm.models.cache import KVCache

    caches = [KVCache() for _ in model.layers]
    hidden = model.model(mx.array([list(tokens)]), cache=caches)[0]
    n = len(tokens)
    as_np = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    return PromptArrays(
        as_np(hidden), [as_np(c.keys[:, :, :n]) for c in caches], [as_np(c.values[:, :, :n]) for c in caches]
    )


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|: the error as a fraction of the tensor's peak."""
    return float(np.abs(actual.astype(np.float32) - expected).max() / np.abs(expected).max())


def worst_errors(actual: PromptArrays, expected: PromptArrays) -> dict[str, float]:
    """The worst relative error of the hidden states, of any layer's keys and of any layer's values."""
    return {
        "hidden": relative_error(actual.hidden, expected.hidden),
        "keys": max(relative_error(a, e) for a, e in zip(actual.keys, expected.keys)),
        "values": max(relative_error(a, e) for a, e in zip(actual.values, expected.values)),
    }
