"""Which LoRA adapters to serve, as settings: plain Python (the CLI and the engine's config read it without MLX)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mlx_serve.errors import InvalidRequest, ModelNotFound, UnsupportedModel

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/")


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """An adapter to serve: the name requests give in `model`, and the directory `mlx_lm.lora` wrote."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class AdapterSource:
    """An adapter's files read and checked without MLX (on a caller's thread, so the engine thread never waits on
    the disk): its scale and its weights file's bytes."""

    name: str
    scale: float
    weights: bytes  # adapters.safetensors as mlx_lm.lora wrote it


def read_adapter_source(spec: AdapterSpec) -> AdapterSource:
    """The adapter's scale and weights; UnsupportedModel for kinds served only merged (DoRA, full)."""
    config_path, weights_path = adapter_files(spec)
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"adapter {spec.name!r}: {config_path} is not JSON: {exc}", param="lora") from None
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise UnsupportedModel(f"adapter {spec.name!r} is a {kind!r} fine-tune; per-request adapters are LoRA only "
                               "(serve it merged into the base model with --adapter-path)", param="lora")  # fmt: skip
    scale = (config.get("lora_parameters") or {}).get("scale")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise InvalidRequest(f"adapter {spec.name!r}: lora_parameters.scale is missing or not a number",
                             param="lora")  # fmt: skip
    return AdapterSource(spec.name, float(scale), weights_path.read_bytes())


def parse_adapter_spec(text: str) -> AdapterSpec:
    """`NAME=DIR` (as `serve --lora` takes it); raises InvalidRequest for anything else."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise InvalidRequest(f"an adapter is given as NAME=DIR, not {text!r}", param="lora")
    return AdapterSpec(name, path)


def check_specs(specs: Sequence[AdapterSpec]) -> None:
    """Refuse, before the model loads, names that clash or could not be told apart, and missing directories."""
    taken = {"default"}  # the base model's name on every server
    for spec in specs:
        if not set(spec.name) <= _NAME_CHARS:
            raise InvalidRequest(f"adapter name {spec.name!r} may hold only letters, digits and -_.:/", param="lora")
        if spec.name in taken:
            raise InvalidRequest(f"adapter name {spec.name!r} is given twice or names the base model", param="lora")
        taken.add(spec.name)
        adapter_files(spec)


def adapter_files(spec: AdapterSpec) -> tuple[Path, Path]:
    """The adapter's config and weights files, as `mlx_lm.lora` names them; ModelNotFound if either is missing."""
    root = Path(spec.path).expanduser()
    config, weights = root / "adapter_config.json", root / "adapters.safetensors"
    for path in (config, weights):
        if not path.is_file():
            raise ModelNotFound(f"adapter {spec.name!r}: {path} not found (an mlx_lm.lora adapter directory has "
                                "adapter_config.json and adapters.safetensors)", param="lora")  # fmt: skip
    return config, weights
