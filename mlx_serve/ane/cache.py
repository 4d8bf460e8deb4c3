"""Built packages cached by model fingerprint: a hash of config.json and of every weight file's bytes,
plus the build options and the builder's version, so a changed model or option never reuses a stale build.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

BUILDER_VERSION = 1  # bump when the program the builder emits changes
PACKAGE_NAME = "prefill.mlpackage"
RECORD_NAME = "build.json"


@dataclass(frozen=True, slots=True)
class BuildOptions:
    chunk_sizes: tuple[int, ...]
    max_context: int
    compression: str | None

    def key(self) -> str:
        sizes = "-".join(str(rows) for rows in sorted(self.chunk_sizes))
        return f"c{sizes}_m{self.max_context}_{self.compression or 'fp16'}_v{BUILDER_VERSION}"


def default_cache_dir() -> Path:
    root = os.environ.get("MLX_SERVE_CACHE_DIR") or Path.home() / ".cache" / "mlx_serve"
    return Path(root) / "ane"


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and (name, sha256) of each weight file, in name order."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in weight_files(model_dir):
        digest.update(f"{path.name}:{_file_digest(path)}".encode())
    return digest.hexdigest()


def cache_entry(fingerprint: str, options: BuildOptions, cache_dir: Path | None = None) -> Path:
    """The folder holding this build's package and its record."""
    return (cache_dir or default_cache_dir()) / f"{fingerprint[:24]}_{options.key()}"


def cached_package(fingerprint: str, options: BuildOptions, cache_dir: Path | None = None) -> Path | None:
    """The package if a complete build is cached (its record is written last), else None."""
    entry = cache_entry(fingerprint, options, cache_dir)
    if (entry / RECORD_NAME).is_file() and (entry / PACKAGE_NAME).is_dir():
        return entry / PACKAGE_NAME
    return None


def write_record(entry: Path, fingerprint: str, options: BuildOptions, model_dir: Path) -> None:
    import coremltools

    record = {
        "fingerprint": fingerprint,
        "model_dir": str(model_dir),
        "options": asdict(options),
        "builder_version": BUILDER_VERSION,
        "coremltools": coremltools.__version__,
    }
    (entry / RECORD_NAME).write_text(json.dumps(record, indent=2))


def parse_chunk_sizes(text: str | Sequence[int]) -> tuple[int, ...]:
    if isinstance(text, str):
        return tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    return tuple(sorted(set(text)))
