"""Dummy LoRA adapters: random `lora_a` / `lora_b` over a checkpoint, in the directory layout `mlx_lm.lora` writes
(`adapter_config.json` and `adapters.safetensors`), so `mlx_lm.load(model, adapter_path=...)` loads them unchanged."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_serve.errors import InvalidRequest

DEFAULT_KEYS = ("self_attn.q_proj", "self_attn.v_proj")  # mlx-lm's LoRA examples adapt these


def make_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    rank: int = 8,
    scale: float = 20.0,
    num_layers: int = -1,
    keys: Sequence[str] = DEFAULT_KEYS,
    seed: int = 0,
    std: float = 0.02,
    dtype: str = "float32",
) -> Path:
    """Write an adapter of `rank` over `keys` of the last `num_layers` layers (-1: all) of the model in `model_dir`;
    `lora_b` is drawn too (training starts it at zero), so the adapter changes the model's answers."""
    import mlx_lm
    from mlx_lm.tuner.utils import linear_to_lora_layers

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise InvalidRequest(f"{out} already exists and is not empty")
    model, _ = mlx_lm.load(str(model_dir))
    layers = len(model.layers)
    count = layers if num_layers < 0 else min(num_layers, layers)
    parameters = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}
    mx.random.seed(seed)
    linear_to_lora_layers(model, count, parameters)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(".lora_a"):
            weights[name] = value.astype(getattr(mx, dtype))
        elif name.endswith(".lora_b"):
            weights[name] = (std * mx.random.normal(value.shape)).astype(getattr(mx, dtype))
    if not weights:
        raise InvalidRequest(f"no linear of the model matches keys {list(keys)}")
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": count, "lora_parameters": parameters}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
