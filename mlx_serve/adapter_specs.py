"""Which LoRA adapters to serve, as settings: plain Python (the CLI and the engine's config read it without MLX)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mlx_serve.errors import InvalidRequest, ModelNotFound

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/")


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """An adapter to serve: the name requests give in `model`, and the directory `mlx_lm.lora` wrote."""

    name: str
    path: str


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
