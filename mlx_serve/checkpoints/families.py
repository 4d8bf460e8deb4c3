"""Tiny checkpoints of the `presets.MLX_FAMILIES`, in mlx-lm's own layout (as mlx-community publishes them).

The five families with real-size presets are written in Hugging Face's layout. These are written at one tiny size
for tests and trials: mlx-lm's model class is built from the config and its freshly initialised parameters are
saved under their mlx-lm names, so `mlx_lm.load` reads them the way it reads a converted checkpoint.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# parameters set where mlx-lm's initial values make a recurrent state forget within a token or two (Mamba-2's
# A = 1..heads with dt ~ 1.3: decay <= 0.27 a step); these keep most of it for tens of tokens
SLOW_STATE = {family: {"A_log": -3.0, "dt_bias": -3.0} for family in ("granitemoehybrid", "nemotron_h", "falcon_h1", "mamba",
                                                                "mamba2")}


def write_family_weights(out_dir: Path, config: dict, seed: int, dtype: str) -> None:
    """The weights of mlx-lm's model of `config`, initialised under `seed`, saved in `dtype` (one file: tiny)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = config["model_type"]  # some run with another's class (kimi_k2: deepseek_v3)
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {name: value.astype(getattr(mx, dtype)) for name, value in tree_flatten(model.parameters())}
    for name in weights:  # a state that remembers: a test of the state kept across steps can see it
        leaf = name.rsplit(".", 1)[-1]
        if leaf in SLOW_STATE.get(config["model_type"], {}):
            weights[name] = mx.full(weights[name].shape, SLOW_STATE[config["model_type"]][leaf], weights[name].dtype)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
