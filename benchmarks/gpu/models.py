"""Dummy-weight models built in memory: mlx-lm's own model class, random weights, never written to disk.

Random weights of a real shape cost exactly what trained ones cost to run. The 30B-A3B bf16 shape is 61 GB, more
than the device machine's disk, so nothing but the tokenizer (a few MB) touches the disk.
"""

from __future__ import annotations

import copy
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_serve.checkpoints.builder import checkpoint_config, generation_config
from mlx_serve.checkpoints.tokenizer import write_tokenizer
from mlx_serve.checkpoints.weights import build_mlx_model, init_std
from mlx_serve.kv_pool import KVLayout


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    arch: str
    preset: str
    bits: int | None  # None: unquantized


SHAPES = {
    "0.6b": ShapeSpec("qwen3", "0.6b", None),
    "8b": ShapeSpec("qwen3", "8b", None),
    "30b-a3b": ShapeSpec("qwen3_moe", "30b-a3b", None),
    "8b-4bit": ShapeSpec("qwen3", "8b", 4),
    # small models of the same architectures, for running the script on a CPU
    "tiny": ShapeSpec("qwen3", "tiny", None),
    "tiny-moe": ShapeSpec("qwen3_moe", "tiny", None),
    "tiny-4bit": ShapeSpec("qwen3", "tiny", 4),
}


@dataclass(frozen=True, slots=True)
class DummyModel:
    name: str
    model: Any  # mlx-lm Model
    tokenizer: Any  # mlx-lm TokenizerWrapper
    config: dict  # config.json contents
    weight_bytes: int
    expert_bytes: int = 0  # of weight_bytes, the mixture-of-experts blocks' experts (a step reads only the chosen)
    peer_model: Any = None  # `model` as mlx-lm built it, for mlx-lm's side (`pristine_copy`)


def pristine_copy(module: nn.Module) -> nn.Module:
    """The module tree anew (new module objects of the classes mlx-lm built) sharing every array. Our engine makes
    its changes on its model's modules (rows folded into one matrix, dense experts, projections re-laid over K
    slices); mlx-lm's side of a comparison runs on this copy, which keeps none of them."""
    clone = copy.copy(module)
    for key, value in module.items():
        if isinstance(value, nn.Module):
            clone[key] = pristine_copy(value)
        elif isinstance(value, list):
            clone[key] = [pristine_copy(v) if isinstance(v, nn.Module) else v for v in value]
    return clone


def _random_weights(model: Any, dtype: mx.Dtype, seed: int) -> None:
    """Replace every (still lazy) parameter by uniform noise of the init's std, evaluating a layer at a time."""
    keys = mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters())))
    pending: list[tuple[str, mx.array]] = []
    for index, (name, param) in enumerate(tree_flatten(model.parameters())):
        std = init_std(name, tuple(param.shape))
        if std == 0.0:
            value = mx.ones(param.shape, dtype=dtype)
        else:
            bound = std * 3**0.5
            value = mx.random.uniform(-bound, bound, param.shape, dtype=dtype, key=keys[index])
        pending.append((name, value))
        if sum(v.nbytes for _, v in pending) > 2**30:
            _apply(model, pending)
    _apply(model, pending)


def _apply(model: Any, pending: list[tuple[str, mx.array]]) -> None:
    mx.eval([v for _, v in pending])
    model.update(tree_unflatten(pending), strict=False)
    pending.clear()


def _tokenizer(config: dict) -> Any:
    from mlx_lm.utils import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tokenizer(path, config["vocab_size"])
        (path / "config.json").write_text(json.dumps(config))
        return load_tokenizer(path, eos_token_ids=generation_config(config)["eos_token_id"])


def build_dummy_model(name: str, dtype: str = "bfloat16", seed: int = 0) -> DummyModel:
    spec = SHAPES[name]
    return dummy_of_config(name, checkpoint_config(spec.arch, spec.preset, dtype), dtype, seed, spec.bits)


def dummy_of_config(name: str, config: dict, dtype: str, seed: int = 0, bits: int | None = None) -> DummyModel:
    """A dummy-weight model of any config.json mlx-lm reads (a preset's, with fields changed)."""
    config = dict(config)
    model = build_mlx_model(config)
    _random_weights(model, getattr(mx, dtype), seed)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
    mx.eval(model.parameters())
    weights = tree_flatten(model.parameters())
    weight_bytes = sum(v.nbytes for _, v in weights)
    expert_bytes = sum(v.nbytes for key, v in weights if ".switch_mlp." in key)
    return DummyModel(name, model, _tokenizer(config), config, weight_bytes, expert_bytes, pristine_copy(model))


def dummy_and_layout(shape: str) -> tuple[DummyModel, KVLayout]:
    """A dummy-weight model of `shape` and the bf16 KV layout of its pool."""
    dummy = build_dummy_model(shape)
    args = dummy.model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    return dummy, KVLayout(args.num_hidden_layers, args.num_key_value_heads, head_dim, mx.bfloat16)
