"""Micro-benchmark of Qwen3-30B-A3B's expert block by step rows: mlx-lm's gathered experts (`gather_mm` per pair),
every expert computed densely (`dense_experts`), and pairs grouped into expert tiles (`grouped_experts`) multiplied
by `gather_mm` (`grouped<tile>`) or by the `expert_tiles` CUDA kernel (`kernel<tile>`, CUDA only).

Twelfth run (RESULTS.md): tiles through MLX's CUDA `gather_mm` (M > 1: a Volta-style kernel at ~80 TFLOP/s) only
tie the gathered form from 1,024 rows and lose to the dense one below 512; hence the kernel.

    python -m benchmarks.gpu.bench_moe [--rows 8,64,256,1024,2048] [--tiles 16,32,64] [--out moe.jsonl]

Each form runs the 48 MoE blocks of one forward pass over `--distinct` blocks of real size (128 experts, 2048 ->
768 -> 2048, top 8, bf16, random weights), each call's input the previous call's output as in a forward pass.
A line per (rows, form): milliseconds for the 48 blocks, and the error of each form against mlx-lm's block.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from mlx_lm.models.qwen3_moe import ModelArgs, Qwen3MoeSparseMoeBlock

from benchmarks.gpu.bench_kernel import time_ms, variants
from mlx_serve import dense_experts
from mlx_serve.grouped_experts import grouped_moe
from mlx_serve.kernels.expert_tiles import expert_tiles_matmul
from mlx_serve.kernels.paged_attention import cuda_available

LAYERS = 48


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
    parser.add_argument("--forms", default="", help="only these forms (e.g. gathered,dense,kernel64); default all")
    parser.add_argument("--breakdown", action="store_true", help="the kernel form's parts, for each rows and tile")
    parser.add_argument("--variants", default="", help="--breakdown: the kernel module's constants set in turn, "
                        "e.g. 'PIPE=2;PIPE=3,THREADS=128' (default: as the module has them)")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    layers = blocks(args.distinct, dtype)
    if args.breakdown:
        from mlx_serve.kernels import expert_tiles

        for variant in variants(args.variants) or [{}]:
            for name, value in variant.items():
                setattr(expert_tiles, name, value)
            for rows in (int(r) for r in args.rows.split(",")):
                for tile in (int(t) for t in args.tiles.split(",")):
                    print(json.dumps({"variant": variant, **breakdown(layers, rows, tile)}), flush=True)
        return
    forms = {"gathered": lambda mlp, x: mlp(x), "dense": dense_experts.dense_moe}
    for tile in (int(t) for t in args.tiles.split(",")):
        forms[f"grouped{tile}"] = lambda mlp, x, tile=tile: grouped_moe(mlp, x, tile)
        if cuda_available():
            forms[f"kernel{tile}"] = lambda mlp, x, tile=tile: grouped_moe(mlp, x, tile, expert_tiles_matmul)
    if args.forms:
        forms = {name: form for name, form in forms.items() if name in args.forms.split(",")}
    lines = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = mx.random.normal((rows, 2048), key=mx.random.key(rows)).astype(dtype)
        reference = layers[0](x).astype(mx.float32)  # mlx-lm's block
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



def breakdown(layers: list[Qwen3MoeSparseMoeBlock], rows: int, tile: int) -> dict:
    """Where the kernel form's time goes at `rows`: the router, the tile layout (MLX ops, and the layout kernel),
    the three tile products alone (on a fixed layout) and the whole block, each over the 48 layers."""
    from mlx_serve.grouped_experts import tile_layout
    from mlx_serve.kernels.tile_layout import cuda_tile_layout

    x = mx.random.normal((rows, 2048), key=mx.random.key(rows)).astype(mx.bfloat16)
    layout = tile_layout(dense_experts.route(layers[0], x)[0], 128, tile)
    mx.eval(layout.source, layout.pair_slot, layout.tile_expert, layout.used)
    experts = (layout.tile_expert, layout.used, tile)

    def vars_of(made):  # a layout's arrays, for mx.eval
        return [made.source, made.pair_slot, made.tile_expert, made.used]

    def chain(step):
        return lambda: [step(layers[i % len(layers)]) for i in range(LAYERS)]

    def products(m):
        g = m.switch_mlp
        up = expert_tiles_matmul(x, g.up_proj.weight, *experts, layout.source)
        gate = expert_tiles_matmul(x, g.gate_proj.weight, *experts, layout.source)
        return expert_tiles_matmul(g.activation(up, gate), g.down_proj.weight, *experts)

    parts = {
        "route": chain(lambda m: dense_experts.route(m, x)),
        "route+layout": chain(lambda m: vars_of(tile_layout(dense_experts.route(m, x)[0], 128, tile))),
        "route+layout_kernel": chain(lambda m: vars_of(cuda_tile_layout(dense_experts.route(m, x)[0], 128, tile))),
        "products": chain(products),
        "whole": chain(lambda m: grouped_moe(m, x, tile, expert_tiles_matmul)),
    }
    return {"rows": rows, "tile": tile, "used_tiles": layout.used.item(), "tiles": layout.tile_expert.size,
            **{name: round(time_ms(fn, repeats=5), 2) for name, fn in parts.items()}}  # fmt: skip


if __name__ == "__main__":
    main()
