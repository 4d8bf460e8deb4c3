"""Sharded safetensors writing: `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`.

Tensors are produced one shard at a time, so a big model never sits in memory whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

MAX_SHARD_BYTES = 2 << 30


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    nbytes: int


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[TensorSpec]]:
    """Group tensors in order into shards; at least two whenever there are two tensors.

    Forcing two shards even for tiny models means every checkpoint exercises sharded loading.
    """
    total = sum(spec.nbytes for spec in specs)
    limit = min(max_shard_bytes, -(-total // 2))
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not shards or (size + spec.nbytes > limit and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_shards(
    out_dir: Path,
    shards: list[list[TensorSpec]],
    make_shard: Callable[[list[TensorSpec]], dict[str, mx.array]],
    metadata: dict | None = None,
) -> None:
    """Write each shard's tensors (made by `make_shard` from its specs) and the index of names to files."""
    weight_map: dict[str, str] = {}
    total_size = 0
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = make_shard(shard)
        mx.save_safetensors(str(out_dir / file_name), tensors, metadata={"format": "mlx"})
        for name, tensor in tensors.items():
            weight_map[name] = file_name
            total_size += tensor.nbytes
        del tensors
    index = {
        "metadata": {"total_size": total_size, **(metadata or {})},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(out_dir / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=2)
