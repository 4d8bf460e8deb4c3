"""Helpers for the ANE tests: tiny packages, and what chunks are checked against (mlx-lm's own forward)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

CHUNK_SIZES = (16, 32)
MAX_CONTEXT = 128


def load(model_dir: Path):
    import mlx_lm

    model, _ = mlx_lm.load(str(model_dir))
    return model


def build(model, out: Path, **options) -> Path:
    from mlx_serve.ane.builder import build_package

    options.setdefault("chunk_sizes", CHUNK_SIZES)
    options.setdefault("max_context", MAX_CONTEXT)
    return build_package(model, out, **options)


@dataclass(frozen=True, slots=True)
class Reference:
    hidden: np.ndarray  # (n, C) after the final norm
    keys: list[np.ndarray]  # per layer (1, KVH, n, D)
    values: list[np.ndarray]
    logits: np.ndarray  # (n, vocab)


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def mlx_forward(model, tokens: list[int]) -> Reference:
    from mlx_lm.models.cache import KVCache

    caches = [KVCache() for _ in model.layers]
    hidden = model.model(mx.array([tokens]), cache=caches)
    logits = model(mx.array([tokens]))
    n = len(tokens)
    return Reference(
        hidden=np.array(hidden[0].astype(mx.float32)),
        keys=[np.array(c.keys[:, :, :n].astype(mx.float32)) for c in caches],
        values=[np.array(c.values[:, :, :n].astype(mx.float32)) for c in caches],
        logits=np.array(logits[0].astype(mx.float32)),
    )


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|: the error as a fraction of the tensor's peak."""
    return float(np.abs(actual.astype(np.float32) - expected).max() / np.abs(expected).max())
