"""Quantized checkpoints, made the way `mlx_lm.convert` makes them, with mlx-lm's own functions.

A float checkpoint is written to a staging directory, loaded lazily by `mlx_lm.utils.load_model` (which
stacks MoE experts through the model's `sanitize`), quantized by `quantize_model` (optionally with one of
mlx-lm's mixed-precision recipes) and saved with mlx-lm's tensor names and `quantization` config keys.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path

from mlx_serve.checkpoints.builder import write_float_checkpoint
from mlx_serve.checkpoints.shards import TensorSpec, plan_shards, write_shards
from mlx_serve.errors import InvalidRequest

QUANT_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def quant_recipes() -> list[str]:
    from mlx_lm.convert import QUANT_RECIPES

    return list(QUANT_RECIPES)


def _check_quant_args(bits: int | None, group_size: int, recipe: str | None) -> None:
    if bits is not None and bits not in QUANT_BITS:
        raise InvalidRequest(f"cannot quantize to {bits} bits; choose one of {QUANT_BITS}")
    if group_size not in GROUP_SIZES:
        raise InvalidRequest(f"group size {group_size} is not supported; choose one of {GROUP_SIZES}")
    if recipe is not None and recipe not in quant_recipes():
        raise InvalidRequest(f"unknown quantization recipe {recipe!r}; choose one of {quant_recipes()}")


def write_quantized_checkpoint(
    out_dir: Path,
    arch: str,
    preset: str,
    seed: int,
    dtype: str,
    *,
    bits: int | None,
    group_size: int,
    recipe: str | None = None,
) -> Path:
    """Quantize a fresh float checkpoint of (arch, preset, seed, dtype) into `out_dir`."""
    _check_quant_args(bits, group_size, recipe)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.float.", dir=out_dir.parent))
    try:
        write_float_checkpoint(staging, arch, preset, seed, dtype)
        _quantize_dir(staging, out_dir, bits=bits, group_size=group_size, recipe=recipe)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _quantize_dir(src: Path, out_dir: Path, *, bits: int | None, group_size: int, recipe: str | None) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import load_model, quantize_model, save_config

    model, config = load_model(src, lazy=True)
    predicate = mixed_quant_predicate_builder(recipe, model, group_size) if recipe else None
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits-per-weight
        model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    weights = dict(tree_flatten(model.parameters()))
    del model  # the weights dict is now the only owner: each tensor is freed once its shard is written
    specs = [TensorSpec(name, tuple(w.shape), w.nbytes) for name, w in weights.items()]
    out_dir.mkdir(parents=True, exist_ok=True)

    def materialize(specs: list[TensorSpec]) -> dict[str, mx.array]:
        tensors = {spec.name: weights.pop(spec.name) for spec in specs}
        mx.eval(tensors)
        return tensors

    write_shards(out_dir, plan_shards(specs), materialize)
    # load_config replaced eos_token_id with generation_config's list; keep config.json's own value
    config["eos_token_id"] = json.loads((src / "config.json").read_text())["eos_token_id"]
    save_config(config, out_dir / "config.json")
    for name in _COPIED_FILES:
        shutil.copy(src / name, out_dir / name)
