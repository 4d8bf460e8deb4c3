"""What exactly was measured: model bytes, code revision, library versions, machine."""

from __future__ import annotations

import hashlib
import platform
import subprocess
from importlib import metadata
from pathlib import Path

FULL_HASH_LIMIT = 64 * 1024 * 1024
EDGE_BYTES = 1024 * 1024


def file_digest(path: Path) -> str:
    """sha256 of small files; of size + first and last MiB for large weights (fast, still changes with them)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as handle:
        if size <= FULL_HASH_LIMIT:
            digest.update(handle.read())
        else:
            digest.update(str(size).encode())
            digest.update(handle.read(EDGE_BYTES))
            handle.seek(size - EDGE_BYTES)
            digest.update(handle.read(EDGE_BYTES))
    return digest.hexdigest()


def model_fingerprint(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".model"))
    combined = hashlib.sha256()
    for path in files:
        combined.update(path.name.encode())
        combined.update(file_digest(path).encode())
    return {"path": str(model_dir), "sha256": combined.hexdigest()[:16], "files": len(files),
            "bytes": sum(p.stat().st_size for p in files)}


def git(*args: str, cwd: Path) -> str:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def code_fingerprint(repo: str | Path) -> dict:
    repo = Path(repo)
    diff = git("diff", "HEAD", cwd=repo)
    return {
        "commit": git("rev-parse", "HEAD", cwd=repo) or "unknown",
        "dirty": bool(diff),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None,
        "versions": {name: package_version(name) for name in ("mlx", "mlx-lm", "mlx-serve-runtime")},
        "python": platform.python_version(),
    }


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    return {"system": platform.system(), "machine": platform.machine(), "processor": platform.processor(),
            "cpus": _cpu_count(), "node": platform.node()}


def _cpu_count() -> int | None:
    import os

    return os.cpu_count()
