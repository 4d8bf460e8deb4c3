"""Micro-benchmark of a prefill chunk's attention over a long paged history (the contended step's fixed cost).

For one chunk of `rows` queries at `history` tokens (Qwen3-8B attention: 32 heads, 8 KV heads x 128, bf16),
times every layer's (36 calls) pieces: reading the history out of the pool (the slot gather of `KVPool.gather`,
or the paged-gather kernel), the masked SDPA over the bucketed history, and, as the floor, SDPA over the exact
history with the "causal" mask and no gather at all.

    python -m benchmarks.gpu.bench_prefill_history --out $OUT/prefill_history.json
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np

from benchmarks.gpu.bench_kernel import time_ms
from mlx_serve.kernels.paged_gather import paged_gather
from mlx_serve.ragged import LaneRows

LAYERS = 36
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
BUCKET = 1024
SHAPES = [(64, 8192), (64, 16384), (512, 16384), (1024, 8192)]  # (rows, history)


def bench(rows: int, history: int) -> dict:
    end = history + rows
    padded = -(-end // BUCKET) * BUCKET
    blocks = padded // BLOCK + 8
    rng = np.random.default_rng(rows + history)
    pool_k = mx.random.normal((blocks * BLOCK, KV_HEADS, HEAD_DIM)).astype(mx.bfloat16)
    pool_v = mx.random.normal((blocks * BLOCK, KV_HEADS, HEAD_DIM)).astype(mx.bfloat16)
    table_np = rng.permutation(blocks)[: -(-end // BLOCK)].astype(np.int32)
    slots_np = np.zeros(padded, np.int32)
    slots_np[:end] = (table_np[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[:end]
    slots = mx.array(slots_np)
    lane = LaneRows(0, rows, slots, None, mx.array(table_np), mx.array([end, padded], mx.int32), padded)
    q = mx.random.normal((1, HEADS, rows, HEAD_DIM)).astype(mx.bfloat16)
    qpos = mx.arange(history, end)[:, None]
    kpos = mx.arange(padded)[None, :]
    mask = mx.where(kpos <= qpos, mx.array(0, mx.bfloat16), mx.array(-3e38, mx.bfloat16))[None, None]
    mx.eval(pool_k, pool_v, q, mask)
    scale = HEAD_DIM**-0.5

    def slot_gather():
        return pool_k[slots].transpose(1, 0, 2)[None], pool_v[slots].transpose(1, 0, 2)[None]

    def kernel_gather():
        return paged_gather(pool_k, pool_v, lane, BLOCK)

    k_pre, v_pre = kernel_gather()
    k_exact, v_exact = k_pre[:, :, :end], v_pre[:, :, :end]
    mx.eval(k_pre, v_pre, k_exact, v_exact)
    row = {"rows": rows, "history": history, "padded": padded}
    row["slot_gather_ms"] = time_ms(lambda: [slot_gather() for _ in range(LAYERS)])
    row["kernel_gather_ms"] = time_ms(lambda: [kernel_gather() for _ in range(LAYERS)])
    row["masked_sdpa_ms"] = time_ms(
        lambda: [mx.fast.scaled_dot_product_attention(q, k_pre, v_pre, scale=scale, mask=mask) for _ in range(LAYERS)]
    )
    row["causal_sdpa_exact_ms"] = time_ms(
        lambda: [
            mx.fast.scaled_dot_product_attention(q, k_exact, v_exact, scale=scale, mask="causal") for _ in range(LAYERS)
        ]
    )

    def whole(gather):
        def run():
            outs = []
            for _ in range(LAYERS):
                k, v = gather()
                outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
            return outs

        return run

    row["slots_total_ms"] = time_ms(whole(slot_gather))
    row["kernel_total_ms"] = time_ms(whole(kernel_gather))
    row["history_gb_read"] = 2 * end * KV_HEADS * HEAD_DIM * 2 * LAYERS / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for r, h in SHAPES:
        rows.append(bench(r, h))
        print(json.dumps(rows[-1]), flush=True)
    names = ["slot_gather", "kernel_gather", "masked_sdpa", "causal_sdpa_exact", "slots_total", "kernel_total"]
    print(f"\nprefill chunk attention over paged history, {LAYERS} layers, bf16 (ms, median of 10)")
    print("| rows x history | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['rows']} x {r['history']} | " + " | ".join(f"{r[n + '_ms']:.2f}" for n in names) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
