"""Dummy checkpoints: random weights of real architectures, in the layout Hugging Face and mlx-lm use.

`make_checkpoint` writes a directory that `mlx_lm.load` loads unchanged; `default_model_path` is the
built-in tiny model, made on first use in a cache directory.
"""

from __future__ import annotations

from pathlib import Path

from mlx_serve.checkpoints.builder import checkpoint_config
from mlx_serve.checkpoints.cache import default_model_path
from mlx_serve.checkpoints.presets import ARCHS, DTYPES, PRESETS, check_combo
from mlx_serve.errors import InvalidRequest

__all__ = ["ARCHS", "DTYPES", "PRESETS", "checkpoint_config", "default_model_path", "make_checkpoint"]


def make_checkpoint(
    out_dir: str | Path,
    arch: str = "qwen3",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    quantize_bits: int | None = None,
    group_size: int = 64,
    quant_predicate: str | None = None,
) -> Path:
    """Write a checkpoint of `arch` at `preset` size to `out_dir` (which must be absent or empty).

    `quantize_bits` (4 or 8) and/or `quant_predicate` (one of mlx-lm's mixed recipes, e.g. "mixed_3_6")
    quantize it the way `mlx_lm.convert` does. The same arguments always give the same bytes.
    """
    out_dir = Path(out_dir)
    check_combo(arch, preset, dtype)
    if out_dir.exists() and not out_dir.is_dir():
        raise InvalidRequest(f"{out_dir} exists and is not a directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InvalidRequest(f"{out_dir} already exists and is not empty")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only place, a parent that is a file: say so before any weight is made
        raise InvalidRequest(f"cannot create {out_dir}: {exc.strerror or exc}") from None
    if quantize_bits is None and quant_predicate is None:
        from mlx_serve.checkpoints.builder import write_float_checkpoint

        return write_float_checkpoint(out_dir, arch, preset, seed, dtype)
    from mlx_serve.checkpoints.quantize import write_quantized_checkpoint

    return write_quantized_checkpoint(
        out_dir, arch, preset, seed, dtype, bits=quantize_bits, group_size=group_size, recipe=quant_predicate
    )
