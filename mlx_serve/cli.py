"""`python -m mlx_serve`: one subcommand per module in `mlx_serve.commands`.

Each command module exposes `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`. Commands import
their heavy dependencies (MLX, the server) inside `run`, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module under mlx_serve.commands
COMMANDS = {
    "serve": "serve",
    "generate": "generate",
    "run-batch": "run_batch",
    "chat": "chat",
    "make-model": "make_model",
    "make-adapter": "make_adapter",
    "bench": "bench",
    "ane": "ane",
    "check-backend": "check_backend",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_serve",
        description="mlx_serve: an LLM serving runtime on MLX (ragged continuous batching, paged KV, OpenAI API).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"mlx_serve.commands.{module_name}")
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from mlx_serve.errors import MlxServeError

    try:
        return int(args._run(args) or 0)
    except MlxServeError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
