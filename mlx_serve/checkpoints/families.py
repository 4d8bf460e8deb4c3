"""Tiny checkpoints of the `presets.MLX_FAMILIES`, in mlx-lm's own layout (as mlx-community publishes them).

The five families with real-size presets are written in Hugging Face's layout. These are written at one tiny size
for tests and trials: mlx-lm's model class is built from the config and its freshly initialised parameters are
saved under their mlx-lm names, so `mlx_lm.load` reads them the way it reads a converted checkpoint.
"""

from __future__ import annotations

import importlib
from pathlib import Path


def write_family_weights(out_dir: Path, config: dict, seed: int, dtype: str) -> None:
    """The weights of mlx-lm's model of `config`, initialised under `seed`, saved in `dtype` (one file: tiny)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {name: value.astype(getattr(mx, dtype)) for name, value in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
