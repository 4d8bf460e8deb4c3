"""Micro-benchmark of Qwen3-30B-A3B's expert block by step rows: mlx-lm's gathered experts (`gather_mm` per pair),
every expert computed densely (`dense_experts`) and pairs grouped into expert tiles (`grouped_moe` below).

The grouped form sorts the (row, expert) pairs by expert into fixed-size row tiles and runs one GEMM per tile
against its expert (`mx.gather_mm` over tiles): the needed FLOPs plus at most one padded tile per expert, in a
tile count fixed by the rows, so no host sync. It lost on the H200 (twelfth run, RESULTS.md): MLX's CUDA
`gather_mm` for M > 1 runs a Volta-style kernel at ~80 TFLOP/s, so the grouped form only ties the gathered one
from 1,024 rows and loses to the dense one below 512. It stays here as the measured alternative.

    python -m benchmarks.gpu.bench_moe [--rows 8,64,256,1024,2048] [--tiles 16,32,64] [--out moe.jsonl]

Each form runs the 48 MoE blocks of one forward pass over `--distinct` blocks of real size (128 experts, 2048 ->
768 -> 2048, top 8, bf16, random weights), each call's input the previous call's output as in a forward pass.
A line per (rows, form): milliseconds for the 48 blocks, and the error of each form against mlx-lm's block.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import mlx.core as mx
from mlx_lm.models.qwen3_moe import ModelArgs, Qwen3MoeSparseMoeBlock

from benchmarks.gpu.bench_kernel import time_ms
from mlx_serve import dense_experts

LAYERS = 48


def tile_count(pairs: int, experts: int, tile: int) -> int:
    """Tiles that always hold `pairs` pairs over `experts` experts: sum over e of ceil(n_e / tile) is at most
    ceil((pairs + experts * (tile - 1)) / tile)."""
    return -(-(pairs + experts * (tile - 1)) // tile)


def tile_layout(chosen: mx.array, experts: int, tile: int) -> tuple[mx.array, mx.array, mx.array]:
    """Where each pair goes: `order` (pairs sorted by expert, stable), `slot` (the padded row of each sorted pair)
    and `tile_expert` (each tile's expert, non-decreasing; tiles past the last used one repeat the last expert and
    hold zero rows)."""
    flat = chosen.reshape(-1)
    pairs = flat.size
    order = mx.argsort(flat)
    by_expert = flat[order]
    counts = (flat[:, None] == mx.arange(experts, dtype=flat.dtype)[None, :]).astype(mx.int32).sum(axis=0)
    first_pair = mx.cumsum(counts) - counts  # sorted position of each expert's first pair
    tiles = (counts + tile - 1) // tile
    tile_end = mx.cumsum(tiles)
    first_slot = (tile_end - tiles) * tile
    rank = mx.arange(pairs, dtype=mx.int32) - first_pair[by_expert]
    slot = first_slot[by_expert] + rank
    total = tile_count(pairs, experts, tile)
    tile_expert = (tile_end[None, :] <= mx.arange(total, dtype=mx.int32)[:, None]).astype(mx.int32).sum(axis=1)
    return order, slot, mx.minimum(tile_expert, experts - 1).astype(mx.uint32)


def grouped_moe(mlp: Any, x: mx.array, tile: int = 32) -> mx.array:
    """`mlp(x)` for `x` `[T, hidden]` over the tiles of `tile_layout`."""
    chosen, scores = dense_experts.route(mlp, x)
    glu = mlp.switch_mlp
    experts = glu.gate_proj.num_experts
    k = mlp.top_k
    order, slot, tile_expert = tile_layout(chosen, experts, tile)
    total = tile_expert.size
    padded = mx.zeros((total * tile, x.shape[-1]), dtype=x.dtype)
    padded[slot] = x[order // k]
    tiles = padded.reshape(total, tile, x.shape[-1])
    every_tile = mx.arange(total, dtype=mx.uint32)

    def project(inputs: mx.array, linear: Any) -> mx.array:
        weights = linear.weight.swapaxes(-1, -2)
        return mx.gather_mm(inputs, weights, every_tile, tile_expert, sorted_indices=True)

    hidden = glu.activation(project(tiles, glu.up_proj), project(tiles, glu.gate_proj))
    out = project(hidden, glu.down_proj).reshape(total * tile, -1)
    per_pair = mx.zeros((chosen.size, out.shape[-1]), dtype=out.dtype)
    per_pair[order] = out[slot]
    per_pair = per_pair.reshape(*chosen.shape, -1)  # [T, k, hidden], pairs back in each row's top-k order
    return (per_pair * scores[..., None]).sum(axis=-2).astype(per_pair.dtype)


def blocks(distinct: int, dtype: mx.Dtype) -> list[Qwen3MoeSparseMoeBlock]:
    args = ModelArgs(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=LAYERS, intermediate_size=6144,
                     num_attention_heads=32, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                     mlp_only_layers=[], moe_intermediate_size=768, rms_norm_eps=1e-6, vocab_size=151936,
                     num_key_value_heads=4, head_dim=128, rope_theta=1e6, tie_word_embeddings=False,
                     max_position_embeddings=40960, norm_topk_prob=True)  # fmt: skip
    made = []
    for index in range(distinct):
        block = Qwen3MoeSparseMoeBlock(args)
        block.update(
            {"gate": {"weight": mx.random.normal((128, 2048), key=mx.random.key(index)).astype(dtype) * 0.05},
             "switch_mlp": {name: {"weight": (mx.random.normal(
                 (128, 2048, 768) if name == "down_proj" else (128, 768, 2048), key=mx.random.key(100 * index + j))
                 * 0.02).astype(dtype)} for j, name in enumerate(("gate_proj", "up_proj", "down_proj"))}})  # fmt: skip
        mx.eval(block.parameters())
        made.append(block)
    return made


def forward(form, layers: list[Qwen3MoeSparseMoeBlock], x: mx.array) -> mx.array:
    for index in range(LAYERS):
        x = x + form(layers[index % len(layers)], x) * 0.1  # residual-like: routing varies layer to layer
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,64,128,256,512,1024,2048")
    parser.add_argument("--tiles", default="16,32,64")
    parser.add_argument("--distinct", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", help="float32 on the CPU backend (its gather_mm)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    layers = blocks(args.distinct, dtype)
    forms = {"gathered": lambda mlp, x: mlp(x), "dense": dense_experts.dense_moe}
    for tile in (int(t) for t in args.tiles.split(",")):
        forms[f"grouped{tile}"] = lambda mlp, x, tile=tile: grouped_moe(mlp, x, tile)
    lines = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = mx.random.normal((rows, 2048), key=mx.random.key(rows)).astype(dtype)
        reference = forms["gathered"](layers[0], x).astype(mx.float32)
        for name, form in forms.items():
            if name == "dense" and rows > 2048:
                continue
            err = mx.abs(form(layers[0], x).astype(mx.float32) - reference).max().item()
            ms = time_ms(lambda form=form, x=x: forward(form, layers, x), repeats=5)
            line = {"rows": rows, "form": name, "ms": round(ms, 2), "max_abs_err_vs_gathered": err}
            print(json.dumps(line), flush=True)
            lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
