"""Random weights of the real architecture, named as the Hugging Face checkpoint names them.

Shapes come from mlx-lm's own `Model` built from the config (its parameters stay lazy, so building even an
8B model costs no memory). Each tensor has its own RNG stream seeded by (seed, name): the bytes depend only
on the seed, never on the order tensors are made in.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from mlx_serve.checkpoints.shards import TensorSpec

_STACKED_EXPERTS = re.compile(r"^(.*)\.mlp\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Small embeddings (as trained models have) and fan-in-scaled projections let attention and the MLP dominate
# the residual stream; with larger embeddings a tied lm_head just repeats the last input token.
EMBED_STD = 0.02
PROJECTION_GAIN = 1.0


def build_mlx_model(config: dict):
    """mlx-lm's `Model` for this config (model_type remapped as mlx-lm does, e.g. mistral -> llama)."""
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return module.Model(module.ModelArgs.from_dict(config))


def hf_tensor_specs(config: dict, dtype: str) -> list[TensorSpec]:
    """Every tensor of the HF checkpoint: mlx-lm's names, with MoE experts unstacked as HF stores them."""
    from mlx.utils import tree_flatten

    itemsize = _MX_DTYPES[dtype].size
    specs: list[TensorSpec] = []
    for name, param in tree_flatten(build_mlx_model(config).parameters()):
        shape = tuple(param.shape)
        stacked = _STACKED_EXPERTS.match(name)
        if stacked:
            prefix, proj = stacked.groups()
            per_expert = shape[1:]
            specs.extend(
                TensorSpec(
                    f"{prefix}.mlp.experts.{e}.{proj}.weight", per_expert, _count(per_expert) * itemsize
                )
                for e in range(shape[0])
            )
        else:
            specs.append(TensorSpec(name, shape, _count(shape) * itemsize))
    return specs


def _count(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def init_std(name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of the init for one tensor (0 means: the norm's ones)."""
    if name.endswith("norm.weight"):
        return 0.0
    if "embed_tokens" in name:
        return EMBED_STD
    if name.endswith(".bias"):
        return 0.02
    return PROJECTION_GAIN / float(np.sqrt(shape[-1]))


def tensor_values(spec: TensorSpec, seed: int, dtype: str) -> np.ndarray:
    """The tensor for `spec` as numpy (bfloat16 as its raw uint16 bits): a pure function of its arguments.

    Uniform noise (what mlx's own Linear init draws) is cheaper than normal noise for billions of values.
    Pure numpy, so shards can be generated on several threads without touching MLX.
    """
    std = init_std(spec.name, spec.shape)
    if std == 0.0:
        values = np.ones(spec.shape, dtype=np.float32)
    else:
        rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
        values = rng.random(spec.shape, dtype=np.float32)
        values -= np.float32(0.5)
        values *= np.float32(std * np.sqrt(12.0))  # uniform on [-a, a] has std a / sqrt(3)
    if dtype == "bfloat16":
        return _bfloat16_bits(values)
    return values.astype(np.float16) if dtype == "float16" else values


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Truncate float32 to bfloat16, which is a float32's high 16 bits."""
    if sys.byteorder == "little":
        return np.ascontiguousarray(values.view(np.uint16)[..., 1::2])  # one copy, no temporaries
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def to_mlx(values: np.ndarray, dtype: str) -> mx.array:
    """Wrap `tensor_values` output as an MLX array of `dtype` (call on the thread that owns MLX)."""
    array = mx.array(values)
    return mx.view(array, mx.bfloat16) if dtype == "bfloat16" else array


def random_shard_maker(
    seed: int, dtype: str, workers: int | None = None
) -> Callable[[list[TensorSpec]], dict]:
    """A `write_shards` producer: numpy RNG on a thread pool, MLX wrapping on the caller's thread."""
    workers = workers or min(8, os.cpu_count() or 1)

    def make_shard(specs: list[TensorSpec]) -> dict[str, mx.array]:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            values = list(pool.map(lambda spec: tensor_values(spec, seed, dtype), specs))
        return {spec.name: to_mlx(v, dtype) for spec, v in zip(specs, values)}

    return make_shard
