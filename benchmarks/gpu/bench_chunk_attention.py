"""A prefill chunk's attention over its paged history, by rows: MLX's fused SDPA and `MatmulChunkAttention`
(each after the `paged_gather` copy they need, and without it) against the paged flash-attention kernel
(`kernels.chunk_attention`), which reads the pool through the block table itself.

Each call's queries are the previous call's output, so the calls run one after another as a forward pass's
layers do (independent calls would run side by side in MLX's CUDA graph and hide a kernel that fills few SMs:
a 64-row chunk over 8k tokens gives cuDNN 32 thread blocks). Keys and values differ per call (36 layers'
worth, a pool and a block table each, blocks in random order), bf16; the chunk is the last `rows` tokens of
`history`, the table padded to `history + 128` tokens with a scratch block, as a bucketed lane's.

Prints ms a call, one JSON line per (shape, history, rows): `sdpa_ms` / `matmul_ms` over K/V gathered
beforehand, `gather_sdpa_ms` / `gather_matmul_ms` with the gather (`--baselines` picks which), `paged_ms` the
kernel with its own choices (`paged_variant`, `paged_splits`), any `--splits` / `--warps` overrides of the
default build, and `paged_err`: the kernel's largest difference from SDPA on one layer, over SDPA's largest
output. `--variants` times other builds of the kernel (`Variant.parse` specs, `;`-separated, or `all` for
`VARIANTS`) with the launcher's splits: `paged_<name>_ms` and `paged_<name>_err` each (`old`: the first
version, 32-token tiles in two static stages, a global table load per copy). `--target-blocks`,
`--min-split-tokens`, `--max-splits`, `--wave-splits on|off` (and `--split-overhead-tokens`) set the split policy's
constants for the whole run; a variant's splits follow its blocks a SM (`Variant.blocks_per_sm`) where the
policy looks at them.

    python -m benchmarks.gpu.bench_chunk_attention [--quick] [--splits 1,2,4,8] [--warps 8]
        [--variants "old;BN=32,STAGES=4;BN=64,STAGES=3"] [--baselines gather_sdpa]
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np

from benchmarks.gpu.bench_kernel import time_ms
from mlx_serve.kernels import chunk_attention
from mlx_serve.kernels.chunk_attention import (
    OLD,
    Variant,
    default_variant,
    paged_chunk_attention,
    split_count,
)
from mlx_serve.kernels.paged_gather import paged_gather
from mlx_serve.ragged import LaneRows, MatmulChunkAttention, sdpa_chunk_attention

# heads, kv heads, head dim; 30B-A3B groups 8 query heads a kv head (8B: 4), so its chunks have twice the score rows a
# kv head that 8B's of as many rows have
SHAPES = {"8b": (32, 8, 128), "0.6b": (16, 8, 128), "30b-a3b": (32, 4, 128)}
LAYERS = 36
BLOCK_SIZE = 16
PAD = 128  # table tokens past the history, as a bucketed lane's
ROWS = "64,128,192,256,512,1024"
HISTORIES = "2048,8192,16384"
QUICK_ROWS, QUICK_HISTORIES = "128,1024", "8192"
BASELINES = ("sdpa", "matmul", "gather_sdpa", "gather_matmul")


def variant_label(variant: Variant) -> str:
    return "old" if variant == OLD else variant.name


def make_layers(kv_heads: int, head_dim: int, history: int, seed: int) -> list[tuple[mx.array, ...]]:
    """Per layer: a pool of keys and values (the history's blocks plus a scratch block) and its block table
    (the history's blocks in random order, padded with the scratch block to `history + PAD` tokens)."""
    rng = np.random.default_rng(seed)
    used, padded_blocks = -(-history // BLOCK_SIZE), (history + PAD) // BLOCK_SIZE
    shape = ((used + 1) * BLOCK_SIZE, kv_heads, head_dim)
    layers = []
    for _ in range(LAYERS):
        table = np.full(padded_blocks, used, dtype=np.int32)  # block `used` is the scratch block
        table[:used] = rng.permutation(used)
        keys = mx.random.normal(shape).astype(mx.bfloat16)
        values = mx.random.normal(shape).astype(mx.bfloat16)
        layers.append((keys, values, mx.array(table)))
    mx.eval(layers)
    return layers


def measure(
    shape: str,
    rows: int,
    history: int,
    layers: list,
    splits: list[int],
    warps: list[int],
    variants: list[Variant] = (),
    baselines: tuple[str, ...] = BASELINES,
) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    padded = history + PAD
    q = mx.random.normal((1, heads, rows, head_dim)).astype(mx.bfloat16)
    positions = mx.arange(history - rows, history, dtype=mx.int32)
    length = mx.array([history, padded], dtype=mx.int32)
    visible = mx.arange(padded)[None, :] <= positions[:, None]
    mask = mx.where(visible, mx.array(0, mx.bfloat16), mx.array(-1e30, mx.bfloat16))[None, None]
    no_slots = mx.zeros((0,), mx.int32)
    lanes = [LaneRows(0, rows, no_slots, mask, table, length, padded, rows) for *_, table in layers]
    contiguous_runs = {"sdpa", "matmul"} & set(baselines)  # the first layer's K/V alone serve `paged_err`
    gather = zip(layers if contiguous_runs else layers[:1], lanes, strict=False)
    gathered = [paged_gather(k, v, lane, BLOCK_SIZE) for (k, v, _), lane in gather]
    mx.eval(q, positions, length, mask, gathered)
    scale = head_dim**-0.5
    matmul = MatmulChunkAttention(max_rows=1 << 20)  # past its `max_scores` it answers with SDPA

    def contiguous(attention):
        def run():
            out = q
            for keys, values in gathered:
                out = attention(out, keys, values, scale, mask)
            return out

        return run

    def gather_then(attention):
        def run():
            out = q
            for (pool_keys, pool_values, _), lane in zip(layers, lanes):
                keys, values = paged_gather(pool_keys, pool_values, lane, BLOCK_SIZE)
                out = attention(out, keys, values, scale, mask)
            return out

        return run

    def paged(**overrides):
        def run():
            out = q
            for keys, values, table in layers:
                out = paged_chunk_attention(out, keys, values, table, length, positions, scale, BLOCK_SIZE,
                                            **overrides)  # fmt: skip
            return out

        return run

    keys, values, table = layers[0]
    want = sdpa_chunk_attention(q, *gathered[0], scale, mask).astype(mx.float32)

    def error(
        **overrides,
    ) -> float:  # the largest difference from SDPA on one layer, over SDPA's largest output
        got = paged_chunk_attention(q, keys, values, table, length, positions, scale, BLOCK_SIZE, **overrides)
        return (mx.abs(got.astype(mx.float32) - want).max() / mx.abs(want).max()).item()

    def blocks(variant: Variant) -> int:  # query tiles x kv heads, before splits
        return -(-rows * heads // kv_heads // (16 * variant.warps)) * kv_heads

    runs = {
        "sdpa": contiguous(sdpa_chunk_attention),
        "matmul": contiguous(matmul),
        "gather_sdpa": gather_then(sdpa_chunk_attention),
        "gather_matmul": gather_then(matmul),
    }
    row = {"shape": shape, "rows": rows, "history": history}
    for name in baselines:
        row[f"{name}_ms"] = time_ms(runs[name]) / LAYERS
    row["paged_ms"] = time_ms(paged()) / LAYERS
    row["paged_variant"] = variant_label(default_variant())
    row["paged_splits"] = split_count(
        blocks(default_variant()), padded, default_variant().blocks_per_sm(head_dim)
    )
    row["paged_err"] = error()
    for count in splits:
        row[f"paged_s{count}_ms"] = time_ms(paged(splits=count)) / LAYERS
    for count in warps:
        row[f"paged_w{count}_ms"] = time_ms(paged(warps=count)) / LAYERS
    for variant in variants:
        label = variant_label(variant)
        same = variant == default_variant()  # timed already
        row[f"paged_{label}_ms"] = row["paged_ms"] if same else time_ms(paged(variant=variant)) / LAYERS
        row[f"paged_{label}_splits"] = split_count(blocks(variant), padded, variant.blocks_per_sm(head_dim))
        row[f"paged_{label}_err"] = row["paged_err"] if same else error(variant=variant)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8b,0.6b")
    parser.add_argument("--rows", default=None, help=f"default {ROWS} ({QUICK_ROWS} with --quick)")
    parser.add_argument("--histories", default=None, help=f"default {HISTORIES} ({QUICK_HISTORIES} --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer rows and histories")
    parser.add_argument("--splits", default="", help="also time the kernel with these history splits: 1,4")
    parser.add_argument("--warps", default="", help="also time the kernel with blocks of these warps: 8")
    parser.add_argument("--variants", default="", help='also time these builds: "old;BN=64,STAGES=3", all')
    parser.add_argument(
        "--baselines", default=",".join(BASELINES), help="of sdpa,matmul,gather_sdpa,gather_matmul"
    )
    parser.add_argument("--target-blocks", type=int, help=f"split policy: {chunk_attention.TARGET_BLOCKS}")
    parser.add_argument(
        "--min-split-tokens", type=int, help=f"split policy: {chunk_attention.MIN_SPLIT_TOKENS}"
    )
    parser.add_argument("--max-splits", type=int, help=f"split policy: {chunk_attention.MAX_SPLITS}")
    parser.add_argument("--wave-splits", choices=("on", "off"), help="split policy: whole waves (WAVE_SPLITS: on)")
    parser.add_argument(
        "--split-overhead-tokens", type=int, help=f"--wave-splits: {chunk_attention.SPLIT_OVERHEAD_TOKENS}"
    )
    args = parser.parse_args()
    if args.wave_splits is not None:
        chunk_attention.WAVE_SPLITS = args.wave_splits == "on"
    for name in ("target_blocks", "min_split_tokens", "max_splits", "split_overhead_tokens"):
        if getattr(args, name) is not None:
            setattr(chunk_attention, name.upper(), getattr(args, name))
    variants = []  # `all` stands for VARIANTS, among other specs too
    for spec in filter(str.strip, args.variants.split(";")):
        variants += chunk_attention.VARIANTS if spec.strip().lower() == "all" else [Variant.parse(spec)]
    variants = list(dict.fromkeys(variants))
    baselines = tuple(name for name in args.baselines.split(",") if name)
    assert set(baselines) <= set(BASELINES), f"baselines of {BASELINES}"
    rows_list = [int(r) for r in (args.rows or (QUICK_ROWS if args.quick else ROWS)).split(",")]
    histories = args.histories or (QUICK_HISTORIES if args.quick else HISTORIES)
    histories = [int(h) for h in histories.split(",")]
    splits = [int(s) for s in args.splits.split(",") if s]
    warps = [int(w) for w in args.warps.split(",") if w]
    assert all(h % BLOCK_SIZE == 0 for h in histories), f"histories of whole {BLOCK_SIZE}-token blocks"
    for shape in args.shapes.split(","):
        _, kv_heads, head_dim = SHAPES[shape]
        for history in histories:
            layers = make_layers(kv_heads, head_dim, history, seed=history)
            for rows in rows_list:
                if rows > history:
                    continue
                row = measure(shape, rows, history, layers, splits, warps, variants, baselines)
                rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
                print(json.dumps(rounded), flush=True)
                mx.clear_cache()
            del layers
            mx.clear_cache()


if __name__ == "__main__":
    main()
