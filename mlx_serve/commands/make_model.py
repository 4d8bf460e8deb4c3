"""`make-model`: write a dummy checkpoint (random weights of a real architecture) that mlx-lm loads."""

from __future__ import annotations

import argparse
import json

HELP = "Write a random-weight checkpoint of a real architecture (llama, qwen2, qwen3, qwen3_moe, mistral at real sizes; 84 more mlx-lm families at a tiny size)."

# Kept here, not imported, so `--help` does not import MLX; tests check they match mlx_serve.checkpoints.
ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "phi3",
    "phimoe",
    "granite",
    "granitemoe",
    "starcoder2",
    "glm",
    "glm4",
    "stablelm",
    "mixtral",
    "qwen2_moe",
    "olmoe",
    "olmo2",
    "internlm2",
    "internlm3",
    "minicpm",
    "helium",
    "seed_oss",
    "nemotron",
    "gemma",
    "gemma2",
    "cohere",
    "smollm3",
    "hunyuan_v1_dense",
    "ernie4_5",
    "ernie4_5_moe",
    "deepseek",
    "mimo",
    "telechat3",
    "apertus",
    "glm4_moe",
    "dots1",
    "minimax",
    "afmoe",
    "solar_open",
    "exaone_moe",
    "Klear",
    "nanbeige",
    "phi",
    "laguna",
    "hunyuan",
    "bailing_moe",
    "deepseek_v3",
    "kimi_k2",
    "glm4_moe_lite",
    "mistral4",
    "deepseek_v2",
    "minicpm3",
    "exaone",
    "gpt2",
    "nanochat",
    "kimi_k25",
    "qwen2_vl",
    "pixtral",
    "qwen3_vl",
    "qwen3_vl_moe",
    "gemma3_text",
    "gemma3",
    "olmo3",
    "cohere2",
    "ministral3",
    "mistral3",
    "gemma3n",
    "gemma4_text",
    "gemma4",
    "gpt_oss",
    "step3p5",
    "mimo_v2_flash",
    "mellum",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "lfm2",
    "lfm2_moe",
    "granitemoehybrid",
    "olmo_hybrid",
    "nemotron_h",
    "falcon_h1",
    "mamba",
    "mamba2",
    "rwkv7",
    "jamba",
    "llama4",
    "exaone4",
    "gpt_neox",
)
PRESETS = ("tiny", "0.6b", "8b", "30b-a3b")
DTYPES = ("bfloat16", "float16", "float32")
RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=ARCHS, default="qwen3", help="architecture (default: qwen3)")
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        default="tiny",
        help="size: tiny (CPU tests) or the shapes of a real checkpoint (default: tiny)",
    )
    parser.add_argument("--out", required=True, help="output directory (must be absent or empty)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed; the same seed gives the same bytes")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="weight dtype (default: float32 for tiny, which CPU MoE kernels need; else bfloat16)",
    )
    parser.add_argument(
        "--quantize",
        type=int,
        choices=(4, 8),
        default=None,
        help="quantize to 4 or 8 bits the way mlx_lm.convert does",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        choices=(32, 64, 128),
        default=64,
        help="quantization group size (default: 64)",
    )
    parser.add_argument(
        "--quant-predicate",
        choices=RECIPES,
        default=None,
        help="mixed-precision recipe from mlx-lm (per-layer bits); implies quantization",
    )
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="print the config.json that would be written, and write nothing",
    )


def run(args: argparse.Namespace) -> int:
    from mlx_serve.checkpoints import checkpoint_config, make_checkpoint

    args.dtype = args.dtype or ("float32" if args.preset == "tiny" else "bfloat16")
    if args.config_only:
        print(json.dumps(checkpoint_config(args.arch, args.preset, args.dtype), indent=2))
        return 0
    out = make_checkpoint(
        args.out,
        arch=args.arch,
        preset=args.preset,
        seed=args.seed,
        dtype=args.dtype,
        quantize_bits=args.quantize,
        group_size=args.group_size,
        quant_predicate=args.quant_predicate,
    )
    print(f"wrote {args.arch} {args.preset} checkpoint to {out}")
    return 0
