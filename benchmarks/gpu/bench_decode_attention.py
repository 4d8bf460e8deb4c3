"""Decode attention's device time per layer, timed on the device: our kernel's forms against cuDNN's SDPA.

A decode step's attention is a chain: each layer's queries come from the previous layer's output. This runs
that chain over 36 layers (12 pools of random KV, each read 3 times: too much for L2 to hold), Qwen3-8B heads
(32 query, 8 KV heads x 128, bf16), with the block table padded to the engine's width bucket. The host's cost
per launch is kept out: a kernel spins on the device's clock first, long enough for the whole chain to be
queued behind it, and `%globaltimer` stamps after the spin and after the last layer give the chain's time.

Forms: `one_pass` (one block a lane and kv head), `split_P` (partitions of P tokens, then the merge kernel), the
same with `mma_` for the tensor-core kernel (`mma2_`: two 16-token tiles a warp at a time),
`auto` (what the engine picks: `paged_attention.partition_size`), and `cudnn`: mlx-lm's decode, MLX's SDPA over a
contiguous `[lanes, kv_heads, L, D]` cache. Each shape runs one unrecorded chain first (the first chain of a
shape measured 10-50% slow), then `--rounds` rounds over all forms in alternating order; a figure is a form's median
over rounds and `spread` its max / min (the same form measured up to 20% apart between calls).

    python -m benchmarks.gpu.bench_decode_attention --lanes 1,8,32 --history 512,1024,4096 > attention.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable

import mlx.core as mx

from mlx_serve.compiled_step import width_bucket
from mlx_serve.kernels import paged_attention
from mlx_serve.kernels.step_clock import GpuStepClock
from mlx_serve.kernels.synthetic import random_decode_problem
from mlx_serve.ragged import DecodeRows

LAYERS, POOLS = 36, 12
KV_HEADS, GROUP, HEAD_DIM, BLOCK = 8, 4, 128, 16
SPIN_NS = 20_000_000

# Template: N (x's size). Inputs: x, ns [1] uint32. Output: y, a copy of x made once the device's clock passed ns.
SPIN_SOURCE = r"""
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns[0]);
  for (int i = threadIdx.x; i < N; i += blockDim.x) y[i] = x[i];
"""


@functools.cache
def _spin_kernel() -> object:
    return mx.fast.cuda_kernel("bench_spin", ["x", "ns"], ["y"], SPIN_SOURCE)


def spin(x: mx.array) -> mx.array:
    (y,) = _spin_kernel()(
        inputs=[x, mx.array([SPIN_NS], dtype=mx.uint32)], template=[("N", x.size)], grid=(256, 1, 1),
        threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype],
    )  # fmt: skip
    return y


def paged_layers(lanes: int, history: int) -> tuple[mx.array, list[Callable[..., mx.array]]]:
    """The first queries, and one function a pool: (attention form, queries) -> output."""
    calls = []
    queries = None
    for pool in range(POOLS):
        problem = random_decode_problem([history] * lanes, KV_HEADS, GROUP, HEAD_DIM, BLOCK, mx.bfloat16, seed=pool)
        tables = problem.rows.block_tables
        width = width_bucket(tables.shape[1])
        padded = mx.pad(tables, [(0, 0), (0, width - tables.shape[1])])
        rows = DecodeRows(lanes, padded, problem.rows.lengths, BLOCK, lanes=())
        mx.eval(problem.pool_keys, problem.pool_values, padded, problem.queries)
        queries = problem.queries if queries is None else queries
        calls.append(functools.partial(_paged, problem.pool_keys, problem.pool_values, rows, problem.scale))
    return queries, calls


def _paged(keys, values, rows, scale, form: dict, queries: mx.array) -> mx.array:
    return paged_attention.paged_decode_attention(queries, keys, values, rows, scale, **form)


def contiguous_layers(lanes: int, history: int) -> list[Callable[[mx.array], mx.array]]:
    calls = []
    for pool in range(POOLS):
        key_k, key_v = mx.random.split(mx.random.key(100 + pool))
        keys = mx.random.normal((lanes, KV_HEADS, history, HEAD_DIM), key=key_k).astype(mx.bfloat16)
        values = mx.random.normal((lanes, KV_HEADS, history, HEAD_DIM), key=key_v).astype(mx.bfloat16)
        mx.eval(keys, values)
        calls.append(functools.partial(mx.fast.scaled_dot_product_attention, k=keys, v=values, scale=HEAD_DIM**-0.5))
    return calls


def chain_us(first: mx.array, layer: Callable[[int, mx.array], mx.array], repeats: int) -> float:
    """Microseconds a layer of the chain takes on the device (median over `repeats` chains)."""
    clock = GpuStepClock()
    mx.eval([layer(i, first) for i in range(POOLS)])  # JIT and allocation outside the timed chains
    samples = []
    for _ in range(repeats):
        q = spin(first)
        start = clock.stamp(q)
        for i in range(LAYERS):
            q = layer(i % POOLS, q)
        end = clock.stamp(q)
        mx.eval(start, end)
        samples.append((clock.read_ns(end) - clock.read_ns(start)) / 1e3 / LAYERS)
    return round(statistics.median(samples), 2)


def forms(history: int) -> dict[str, dict]:
    width = width_bucket(-(-history // BLOCK)) * BLOCK
    out: dict[str, dict] = {"auto": {}, "one_pass": {"partition": width, "mma": False}}
    for size in (256, 64):
        if size < width:
            out[f"split_{size}"] = {"partition": size, "mma": False}
    # the tensor-core kernel: one and two 16-token tiles a warp at a time
    out["mma_one_pass"] = {"partition": width, "mma": True}
    out["mma2_one_pass"] = {"partition": width, "mma": True, "tiles": 2}
    for size in (1024, 512, 256):
        if size < width:
            out[f"mma_split_{size}"] = {"partition": size, "mma": True}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", default="1,8,32")
    parser.add_argument("--history", default="512,1024,4096")
    parser.add_argument("--repeats", type=int, default=5, help="chains a form's figure in one round is the median of")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every form (alternating order)")
    args = parser.parse_args()
    for lanes in (int(v) for v in args.lanes.split(",")):
        for history in (int(v) for v in args.history.split(",")):
            print(json.dumps(measure(lanes, history, args.repeats, args.rounds)), flush=True)


def measure(lanes: int, history: int, repeats: int, rounds: int) -> dict:
    """Each form's median over `rounds` rounds (every round times every form, in reversed order on odd rounds, so
    a drift of the device's speed falls on all of them), with the spread of its rounds (max / min)."""
    first, calls = paged_layers(lanes, history)
    contiguous = contiguous_layers(lanes, history)
    layers = {name: (lambda i, q, form=form: calls[i](form, q)) for name, form in forms(history).items()}
    layers["cudnn"] = lambda i, q: contiguous[i](q)
    chain_us(first, layers["auto"], 2)  # the first chain of a shape runs slow: not a form's
    samples: dict[str, list[float]] = {name: [] for name in layers}
    for round_ in range(rounds):
        for name in layers if round_ % 2 == 0 else reversed(layers):
            samples[name].append(chain_us(first, layers[name], repeats))
    row: dict = {"lanes": lanes, "history": history}
    row.update({name: round(statistics.median(values), 2) for name, values in samples.items()})
    row["spread"] = {name: round(max(values) / min(values), 2) for name, values in samples.items()}
    best = min(row[name] for name in forms(history))
    kv_bytes = lanes * history * KV_HEADS * HEAD_DIM * 2 * 2
    row["best_ours_TBps"] = round(kv_bytes / (best * 1e-6) / 1e12, 2)
    return row


if __name__ == "__main__":
    main()
