"""Check that MLX has exactly one usable backend installed."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys

HELP = "check that MLX has exactly one backend (cpu, cuda13, or Metal on macOS) and print the device"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def installed_backends() -> list[str]:
    found = []
    for dist in ("mlx-cpu", "mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
        try:
            md.version(dist)
            found.append(dist)
        except md.PackageNotFoundError:
            pass
    return found


def run(args: argparse.Namespace) -> int:
    backends = installed_backends()
    if sys.platform.startswith("linux") and len(backends) != 1:
        what = "none" if not backends else " and ".join(backends)
        print(
            f"error: MLX on Linux needs exactly one backend package, found {what}. "
            "Install with the `cpu` extra (pip install -e '.[cpu]') or the `cuda13` extra, not both.",
            file=sys.stderr,
        )
        return 1
    import mlx.core as mx

    print(f"mlx {mx.__version__} on {mx.default_device()} ({', '.join(backends) or 'metal'})")
    return 0
