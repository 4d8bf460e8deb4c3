"""`make-adapter`: write a dummy LoRA adapter (random matrices) over a checkpoint, in mlx_lm.lora's layout."""

from __future__ import annotations

import argparse

HELP = "Write a random LoRA adapter over a model, as mlx_lm.lora lays one out (for --lora / --adapter-path)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="DIR_OR_ID",
                        help="the base model (default: the built-in tiny dummy model)")
    parser.add_argument("--out", required=True, help="output directory (must be absent or empty)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default: %(default)s)")
    parser.add_argument("--scale", type=float, default=20.0, help="LoRA scale (default: %(default)s)")
    parser.add_argument("--num-layers", type=int, default=-1,
                        help="adapt the last this many layers; -1: all (default: %(default)s)")
    parser.add_argument("--keys", nargs="+", default=["self_attn.q_proj", "self_attn.v_proj"],
                        help="the linears adapted in each layer (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from mlx_serve.checkpoints import default_model_path
    from mlx_serve.checkpoints.adapters import make_adapter
    from mlx_serve.errors import InvalidRequest
    from mlx_serve.model_source import resolve_model

    if args.rank < 1:
        raise InvalidRequest(f"--rank must be at least 1, not {args.rank}")
    model = resolve_model(args.model) if args.model else default_model_path()
    out = make_adapter(model, args.out, rank=args.rank, scale=args.scale, num_layers=args.num_layers,
                       keys=args.keys, seed=args.seed)
    print(f"wrote a rank-{args.rank} LoRA adapter of {model.name} to {out}")
    return 0
