"""Write a float checkpoint directory: config, sharded random weights, tokenizer, generation config."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_serve.checkpoints.presets import MLX_FAMILIES, model_config
from mlx_serve.checkpoints.shards import plan_shards, write_shards
from mlx_serve.checkpoints.tokenizer import EOS_TOKENS, PAD_TOKEN, token_ids, write_tokenizer
from mlx_serve.checkpoints.weights import hf_tensor_specs, random_shard_maker


def checkpoint_config(arch: str, preset: str, dtype: str = "float32") -> dict:
    """The full config.json for (arch, preset, dtype), tokenizer ids included; writes nothing."""
    config = model_config(arch, preset, dtype)
    ids = token_ids(config["vocab_size"])
    config["bos_token_id"] = ids[PAD_TOKEN]
    config["eos_token_id"] = ids[EOS_TOKENS[0]]
    return dict(sorted(config.items()))


def generation_config(config: dict) -> dict:
    ids = token_ids(config["vocab_size"])
    return {
        "bos_token_id": ids[PAD_TOKEN],
        "eos_token_id": [ids[token] for token in EOS_TOKENS],
        "pad_token_id": ids[PAD_TOKEN],
    }


def write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def write_float_checkpoint(out_dir: Path, arch: str, preset: str, seed: int, dtype: str) -> Path:
    """A complete, loadable checkpoint with random weights in `dtype`."""
    config = checkpoint_config(arch, preset, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", generation_config(config))
    write_tokenizer(out_dir, config["vocab_size"])
    if arch in MLX_FAMILIES:  # mlx-lm's own layout, from its model class
        from mlx_serve.checkpoints.families import write_family_weights

        write_family_weights(out_dir, config, seed, dtype)
        return out_dir
    shards = plan_shards(hf_tensor_specs(config, dtype))
    write_shards(out_dir, shards, random_shard_maker(seed, dtype))
    return out_dir
