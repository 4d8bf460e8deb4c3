"""Where a model comes from: a local directory, the local Hugging Face cache, or (when online) the Hub.

Also which architectures we serve, and how many bytes a loaded model's weights take.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mlx_serve.errors import ModelNotFound, UnsupportedModel

# model_type values whose mlx-lm model classes the engine drives (mistral loads through mlx-lm's llama), each proven
# token- and log-probability-identical to mlx-lm on a dummy checkpoint (tests/engine/test_families.py). The CUDA
# fast paths (fused forwards, dense and tiled experts) apply to the first four only; the others run mlx-lm's layers
SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "qwen3_moe", "mistral",
    "phi3", "phimoe", "granite", "granitemoe", "starcoder2", "glm", "glm4", "stablelm", "mixtral", "qwen2_moe",
    "olmoe", "olmo2", "internlm2", "internlm3", "minicpm", "helium", "seed_oss", "nemotron", "gemma", "cohere",
    "smollm3", "hunyuan_v1_dense", "ernie4_5", "ernie4_5_moe", "deepseek", "mimo", "telechat3", "apertus",
    "glm4_moe", "dots1", "minimax", "afmoe", "solar_open", "exaone_moe", "Klear", "nanbeige", "phi", "laguna", "hunyuan",
    "bailing_moe", "deepseek_v3", "kimi_k2", "glm4_moe_lite", "qwen3_vl",
    "qwen3_vl_moe", "gemma3_text", "gemma3", "olmo3", "cohere2", "ministral3", "mistral3",
    "gpt_oss", "gemma2", "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe",
    "granitemoehybrid", "olmo_hybrid", "nemotron_h", "falcon_h1", "mamba", "mamba2", "rwkv7", "jamba", "llama4", "deepseek_v2",
    "minicpm3", "mistral4", "gemma4_text", "gemma4", "step3p5", "mimo_v2_flash", "mellum", "exaone", "gpt2", "nanochat",
    "kimi_k25", "qwen2_vl", "pixtral", "gemma3n", "exaone4", "gpt_neox",
)  # fmt: skip

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUE = {"1", "true", "yes", "on"}


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (HF_HUB_CACHE, else HF_HOME/hub)."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache).expanduser()
    hf_home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(hf_home).expanduser() / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def is_hub_id(spec: str) -> bool:
    """`org/name` that is not a local path spelling (no leading `.`, `/` or `~`)."""
    return bool(_HUB_ID.match(spec)) and not spec.startswith((".", "/", "~"))


def resolve_model(spec: str) -> Path:
    """The local directory holding the model named by `spec`.

    `spec` is a directory, or a Hub id found in the local Hugging Face cache, or (unless HF_HUB_OFFLINE
    is set) a Hub id downloaded with mlx-lm's file patterns. Raises ModelNotFound naming what was tried.
    """
    local = Path(spec).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelNotFound(f"model directory {local} has no config.json", param="model")
        return local
    if not is_hub_id(spec):
        raise ModelNotFound(f"model {spec!r} not found: {local.resolve()} is not a directory", param="model")
    cached = _from_hub_cache(spec)
    if cached is not None:
        return cached
    where = f"no directory {local.resolve()} and no snapshot of {spec} in the Hugging Face cache {hub_cache_dir()}"
    if hub_offline():
        raise ModelNotFound(f"model {spec!r} not found: {where} (HF_HUB_OFFLINE is set)", param="model")
    return _download(spec, where)


def _from_hub_cache(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None
    return path if (path / "config.json").is_file() else None


def _download(repo_id: str, where: str) -> Path:
    """Fetch the files mlx-lm itself fetches (its DEFAULT_ALLOW_PATTERNS) into the hub cache."""
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(
            snapshot_download(repo_id, cache_dir=hub_cache_dir(), allow_patterns=DEFAULT_ALLOW_PATTERNS)
        )
    except Exception as exc:  # the Hub raises many kinds (network, auth, missing repo); all mean "not found"
        message = f"model {repo_id!r} not found: {where}, and downloading it failed: {exc}"
        raise ModelNotFound(message, param="model") from exc


# families whose cache list skips layers: which layers take one (the rest, MLP or MoE blocks, get None)
_CACHED_LAYERS: dict[str, Any] = {
    "nemotron_h": lambda layer: layer.block_type in ("M", "*"),
    "gemma4_text": lambda layer: layer.self_attn.has_kv,  # the last layers read an earlier layer's K/V (`gemma4`)
    "gemma3n_text": lambda layer: not layer.self_attn.is_kv_shared_layer,  # as Gemma 4's (`gemma3n`)
}


def cache_layers(model: Any) -> tuple[int, ...]:
    """The layer each of the model's caches serves, in cache order (the pool and every per-layer list of the engine
    are indexed by cache, as the model's forward hands them out): every layer, but for `_CACHED_LAYERS`."""
    layers = model.model.layers
    model_type = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
    takes = _CACHED_LAYERS.get(model_type)
    return tuple(i for i, layer in enumerate(layers) if takes is None or takes(layer))


def layer_windows(model: Any) -> tuple[int | None, ...]:
    """Each layer's attention window as mlx-lm's caches for the model say (a `RotatingKVCache` of `max_size` tokens
    keeping none: a sliding window of that many; a `ChunkedKVCache`: its chunk, `chunked_layers`; a `KVCache`, or an
    `ArraysCache` of a recurrent layer: None); () when no layer is windowed. Raises UnsupportedModel for any other
    cache (kept sink tokens, a layer with two caches)."""
    from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

    from mlx_serve.recurrent import is_state_and_kv

    caches = model.make_cache() if hasattr(model, "make_cache") else []
    served = (KVCache, RotatingKVCache, ArraysCache, ChunkedKVCache)
    other = sorted({type(c).__name__ for c in caches if type(c) not in served and not is_state_and_kv(c)})
    kept = [c for c in caches if type(c) is RotatingKVCache and c.keep]
    if other or kept:
        raise UnsupportedModel(
            f"this checkpoint has layers with {', '.join(other) or 'RotatingKVCache keeping sink tokens'}, which the "
            "engine does not serve: every layer must attend to every earlier token or to a plain sliding window, or "
            "keep a recurrent state",
            param="model",
        )
    sizes = {RotatingKVCache: lambda c: c.max_size, ChunkedKVCache: lambda c: c.chunk_size}
    windows = tuple(sizes[type(c)](c) if type(c) in sizes else None for c in caches)
    return windows if any(w is not None for w in windows) else ()


def chunked_layers(model: Any) -> tuple[int, ...]:
    """The layers whose window is a fixed chunk (mlx-lm gives them a `ChunkedKVCache`: Llama 4)."""
    from mlx_lm.models.cache import ChunkedKVCache

    caches = model.make_cache() if hasattr(model, "make_cache") else []
    return tuple(i for i, c in enumerate(caches) if type(c) is ChunkedKVCache)


def check_supported(config: dict) -> None:
    """Raise UnsupportedModel unless config.json names an architecture we serve."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}",
            param="model",
        )


def weight_bytes(model: Any) -> int:
    """Bytes held by the model's parameters as loaded (packed weights, scales and biases when quantized)."""
    from mlx.utils import tree_flatten

    return sum(value.nbytes for _, value in tree_flatten(model.parameters()))
