"""`python -m mlx_serve ane build|check`: compile a model's decoder stack into the ANE prefill package, and
check a package's numerics against the model's MLX layers (NumPy interpreter; works on Linux)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

HELP = "build the Core ML (Neural Engine) prefill package for a dense llama/qwen2/qwen3 model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ane_command", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="build (or reuse from the cache) a multifunction .mlpackage")
    build.add_argument("--model", required=True, help="model directory (an mlx-lm checkpoint)")
    build.add_argument("--out", help="where to copy the .mlpackage (default: print the cached path only)")
    build.add_argument("--chunk-sizes", default="64", help="comma-separated chunk rows, one function each")
    build.add_argument("--max-context", type=int, default=2048, help="past positions a chunk can attend to")
    build.add_argument("--compress", choices=("int8", "int4"), default=None, help="weight compression")
    build.add_argument(
        "--cache-dir", default=None, help="cache root (default: $MLX_SERVE_CACHE_DIR or ~/.cache)"
    )
    build.add_argument("--force", action="store_true", help="rebuild even if the cache has this build")
    check = sub.add_parser("check", help="interpret a package on NumPy and compare it with the MLX layers")
    check.add_argument("--model", required=True, help="model directory the package was built from")
    check.add_argument("--package", required=True, help="the .mlpackage")
    check.add_argument("--tokens", type=int, default=48, help="random prompt length")
    check.add_argument("--chunk", type=int, default=20, help="prefill chunk size fed to the package")
    check.add_argument("--tolerance", type=float, default=None, help="max |err| / max |ref| (default 0.01)")


def run(args: argparse.Namespace) -> int:
    if args.ane_command == "check":
        return run_check(args)
    return run_build(args)


def run_check(args: argparse.Namespace) -> int:
    import mlx_lm
    import numpy as np

    from mlx_serve.ane import check

    model, _ = mlx_lm.load(args.model)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, model.args.vocab_size, args.tokens)]
    actual = check.interpret_prompt(model, Path(args.package), tokens, args.chunk)
    errors = check.worst_errors(actual, check.mlx_prompt(model, tokens))
    tolerance = args.tolerance if args.tolerance is not None else check.TOLERANCE
    for name, error in errors.items():
        print(f"{name:7s} max|err|/max|ref| = {error:.4%}")
    verdict = max(errors.values()) <= tolerance
    print(f"{'ok' if verdict else 'FAILED'}: tolerance {tolerance:.2%}")
    return 0 if verdict else 1


def run_build(args: argparse.Namespace) -> int:
    from mlx_serve.errors import InvalidRequest

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise InvalidRequest(f"{model_dir} is not a model directory (no config.json)")
    package = build_cached(args, model_dir)
    if args.out:
        out = Path(args.out)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(package, out)
        print(f"package: {out}")
    else:
        print(f"package: {package}")
    return 0


def build_cached(args: argparse.Namespace, model_dir: Path) -> Path:
    from mlx_serve.ane import cache

    options = cache.BuildOptions(
        chunk_sizes=cache.parse_chunk_sizes(args.chunk_sizes),
        max_context=args.max_context,
        compression=args.compress,
    )
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    fingerprint = cache.model_fingerprint(model_dir)
    hit = None if args.force else cache.cached_package(fingerprint, options, cache_dir)
    if hit is not None:
        print(f"cache hit: {fingerprint[:12]} ({options.key()})")
        return hit
    return _build_into_cache(model_dir, fingerprint, options, cache_dir)


def _build_into_cache(model_dir: Path, fingerprint: str, options, cache_dir: Path | None) -> Path:
    import mlx_lm
    from tqdm import tqdm

    from mlx_serve.ane import builder, cache
    from mlx_serve.errors import InvalidRequest

    entry = cache.cache_entry(fingerprint, options, cache_dir)
    if entry.exists():
        shutil.rmtree(entry)
    entry.mkdir(parents=True)
    model, _ = mlx_lm.load(str(model_dir))
    total = builder.count_steps(options.chunk_sizes, options.compression)
    with tqdm(total=total, desc="ane build", unit="step") as bar:
        try:
            builder.build_package(
                model,
                entry / cache.PACKAGE_NAME,
                options.chunk_sizes,
                options.max_context,
                options.compression,
                progress=bar,
            )
        except ValueError as exc:
            shutil.rmtree(entry, ignore_errors=True)
            raise InvalidRequest(str(exc)) from exc
    cache.write_record(entry, fingerprint, options, model_dir)
    return entry / cache.PACKAGE_NAME
