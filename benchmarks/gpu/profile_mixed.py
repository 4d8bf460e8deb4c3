"""Where a step with a prefill chunk spends its time on CUDA: the whole step, then the host cost of each op in it.

The contended steps of issue 7 cost ~18 ms of host submission on the 8B shape against a 7.7 ms decode step, and
that fixed cost is what keeps a 16k prompt's chunks small. This splits it:
- `step`: 8 decode lanes plus one chunk of `--rows` rows over a `--history`-token history, through the runner as the
  engine runs it, its MoE and quantized products as the engine picks them (`--variants`: mlx-lm's modules, the fused
  forward, its compiled trace), each step synchronous:
  submission (host metadata, graph build, MLX's encode and launch) and wait (the device finishing after that), the
  first step's whole time (a trace's cost), then the step queued `--repeats` times with one in flight (ms a step).
- `op`: each kind of op such a step is made of, `layers` independent instances in one graph: host microseconds a
  call spends in async_eval (encode and launch) and in all (until the results are ready).

    python -m benchmarks.gpu.profile_mixed --shape 8b --lanes 8 --rows 128 --history 8192
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import tempfile
import time
from collections.abc import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from benchmarks.gpu.models import dummy_and_layout
from benchmarks.gpu.profile_step import cuda_profiled
from mlx_serve import ragged
from mlx_serve.engine_setup import (
    chunk_attention,
    dense_experts,
    expert_tiles,
    prefill_gather,
    quantized_gemv,
    quantized_tiles,
    split_quantized_k,
)
from mlx_serve.kernels.paged_attention import cuda_available, select_decode_attention
from mlx_serve.kv_pool import KVLayout, KVPool
from mlx_serve.runner import KV_BUCKET, ModelRunner, history_bucket, query_bucket
from mlx_serve.types import SamplingParams
from scheduler.plan import Lane, LaneKind, StepPlan

BLOCK = 16
DECODE_HISTORY = 512
WARMUP = 3
# primitives that make a view of their input, not a kernel launch, where the input's layout allows
VIEW_PRIMITIVES = ("Reshape", "Slice", "Transpose", "Broadcast", "Squeeze", "ExpandDims", "AsStrided", "Depends")


def _median(samples: list[float], scale: float = 1e3) -> float:
    return round(scale * statistics.median(samples), 3)


VARIANTS = {  # name: (fuse_mixed, compile_mixed)
    "modules": (False, False),  # mlx-lm's modules through the ragged caches
    "fused": (True, False),  # the fused forward, eager
    "compiled": (True, True),  # the fused forward, a compiled trace per bucketed shape (CompiledMixed)
}


def engine_runner(model, pool: KVPool, variant: str, split: str = "auto", attention: str = "auto") -> ModelRunner:
    """A runner over `pool` with the engine's CUDA choices, its steps with prefill through `variant` (VARIANTS)."""
    fuse_mixed, compile_mixed = VARIANTS[variant]
    return ModelRunner(
        model, pool, select_decode_attention("auto"), compile_decode=True, fuse_decode=True, fuse_mixed=fuse_mixed,
        compile_mixed=compile_mixed, prefill_gather=prefill_gather(pool), split_k=split_quantized_k(split, fuse_mixed),
        chunk_attention=chunk_attention(attention), dense_moe=dense_experts("auto"), expert_tiles=expert_tiles("auto"),
        quantized_tiles=quantized_tiles("auto"), quantized_gemv=quantized_gemv("auto"),
    )  # fmt: skip


def mixed_step_runner(
    model, layout: KVLayout, lanes: int, rows: int, history: int, variant: str, repeats: int, split: str = "auto",
    attention: str = "auto",
) -> tuple[ModelRunner, Callable[..., StepPlan]]:
    """A runner over a pool sized for `repeats` steps of `lanes` decode lanes (`DECODE_HISTORY` tokens each) and
    one chunk of `rows` rows over `history`, and the plan of step n (each writes a row a lane). `lanes` or `rows`
    may be 0: a decode-only step, or a lone chunk as a cached prefix's continuation runs. A plan may name a smaller
    chunk (`chunk_rows` over `chunk_history`, within the pool's `rows` + `history`) and fewer decode lanes."""
    decode_blocks = -(-(DECODE_HISTORY + WARMUP + 2 * repeats + 1) // BLOCK)  # every step writes a row
    chunk_blocks = -(-(history + rows) // BLOCK) if rows else 0
    pool = KVPool(layout, max(1, lanes * decode_blocks + chunk_blocks), BLOCK)
    runner = engine_runner(model, pool, variant, split, attention)
    for rid in [f"d{i}" for i in range(lanes)] + ["p"]:
        runner.add_request(rid, SamplingParams(temperature=0.0))
    chunk_ids = tuple(range(lanes * decode_blocks, lanes * decode_blocks + chunk_blocks))

    def plan(
        step: int, chunk_rows: int = rows, chunk_history: int = history, decode_lanes: int = lanes
    ) -> StepPlan:
        decode = tuple(
            Lane(f"d{i}", LaneKind.DECODE, (7,), DECODE_HISTORY + step, tuple(range(i * decode_blocks, (i + 1) * decode_blocks)), True)
            for i in range(decode_lanes)
        )  # fmt: skip
        sampled = not decode_lanes  # a chunk alone samples its last row
        chunk = (Lane("p", LaneKind.PREFILL, (11,) * chunk_rows, chunk_history, chunk_ids, sampled),) if rows else ()
        return StepPlan(step, (*decode, *chunk), chunk_rows, "profile", None, bool(decode_lanes))

    return runner, plan


def step_phases(
    model, layout: KVLayout, lanes: int, rows: int, history: int, variant: str, repeats: int, profiled: bool = False,
    split: str = "auto", attention: str = "auto",
) -> dict:
    """One mixed step's host submission (preparation, build, encode) and device wait when run synchronously, the
    first step's (a compiled variant traces it), and the step's cost queued back to back (one in flight)."""
    runner, plan = mixed_step_runner(model, layout, lanes, rows, history, variant, repeats, split, attention)
    submit, wait, first = [], [], 0.0
    for step in range(WARMUP + repeats):
        t0 = time.perf_counter()
        in_flight = runner.submit(plan(step))
        t1 = time.perf_counter()
        runner.collect(in_flight)
        t2 = time.perf_counter()
        first = first or t2 - t0
        if step >= WARMUP:
            submit.append(t1 - t0)
            wait.append(t2 - t1)
    if profiled:  # one more synchronous step in Nsight Compute's capture range (see profile_step)
        mx.synchronize()
        with cuda_profiled(True):
            runner.collect(runner.submit(plan(WARMUP + repeats)))
            mx.synchronize()
    start = time.perf_counter()
    in_flight = None
    for step in range(repeats):
        current = runner.submit(plan(WARMUP + repeats + step), in_flight)
        if in_flight is not None:
            runner.collect(in_flight)
        in_flight = current
    runner.collect(in_flight)
    pipelined = (time.perf_counter() - start) / repeats
    return {"submit_ms": _median(submit), "wait_ms": _median(wait), "first_ms": round(1e3 * first, 1),
            "pipelined_ms": round(1e3 * pipelined, 3)}  # fmt: skip


def graph_primitives(*outputs: mx.array) -> list[str]:
    """The primitive of every node in the graph that computes `outputs`, as MLX's DOT export names them."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *outputs)
        return re.findall(r'label ="([^"]+)", shape=rectangle', dot.read())


def step_ops(model, layout: KVLayout, lanes: int, rows: int, history: int, variant: str) -> dict:
    """The primitives in one step's graph, by kind, as MLX is handed it once the step's shape is warm (a compiled
    variant then replays its trace): a host-bound step costs about one encode per primitive that is not a view."""
    runner, plan = mixed_step_runner(model, layout, lanes, rows, history, variant, WARMUP + 1)
    for step in range(WARMUP):
        runner.collect(runner.submit(plan(step)))
    queued = mx.async_eval
    labels: list[str] = []

    def exporting(*outputs):
        labels.extend(graph_primitives(*[array for _, array in tree_flatten(list(outputs))]))
        return queued(*outputs)

    mx.async_eval = exporting
    try:
        runner.collect(runner.submit(plan(WARMUP)))
    finally:
        mx.async_eval = queued
    kinds = collections.Counter(labels)
    views = sum(kinds[name] for name in VIEW_PRIMITIVES)
    return {"primitives": sum(kinds.values()), "views": views, "per_layer": round(
        (sum(kinds.values()) - views) / model.args.num_hidden_layers, 1), "kinds": dict(kinds.most_common())}


def _time_calls(make: Callable[[int], list[mx.array]], count: int, repeats: int) -> dict:
    """Host microseconds per call of `count` independent calls in one graph: in async_eval, and until done."""
    queued, done = [], []
    for attempt in range(WARMUP + repeats):
        outputs = []
        for i in range(count):
            outputs.extend(make(i))
        t0 = time.perf_counter()
        mx.async_eval(outputs)
        t1 = time.perf_counter()
        mx.eval(outputs)
        t2 = time.perf_counter()
        if attempt >= WARMUP:
            queued.append((t1 - t0) / count)
            done.append((t2 - t0) / count)
    return {"async_eval_us": _median(queued, 1e6), "total_us": _median(done, 1e6)}


def op_costs(model, layout: KVLayout, rows: int, history: int, lanes: int, repeats: int) -> dict[str, dict]:
    """Each op of a mixed step's layer, as many calls as the model has layers, on inputs of the step's shapes."""
    args = model.args
    heads, kv_heads, head_dim, dtype = args.num_attention_heads, layout.num_kv_heads, layout.head_dim, layout.dtype
    count = args.num_hidden_layers
    query_rows = query_bucket(rows)
    padded = history_bucket(history + rows, KV_BUCKET)
    block = model.model.layers[0]
    total_rows = lanes + rows
    key = iter(mx.random.split(mx.random.key(0), 64 * count))

    def normal(*shape: int) -> mx.array:
        array = (0.1 * mx.random.normal(shape, key=next(key))).astype(dtype)
        mx.eval(array)
        return array

    xs = [normal(total_rows, args.hidden_size) for _ in range(count)]
    qs = [normal(1, heads, query_rows, head_dim) for _ in range(count)]
    kvs = [normal(1, kv_heads, padded, head_dim) for _ in range(count)]
    mask = mx.zeros((1, 1, query_rows, padded), dtype)
    scale = head_dim**-0.5

    def unfused_attention(q: mx.array, kv: mx.array) -> mx.array:
        grouped = q.reshape(1, kv_heads, heads // kv_heads * query_rows, head_dim)
        scores = (grouped * scale) @ kv.swapaxes(-1, -2)
        scores = scores.reshape(1, heads, query_rows, padded) + mask
        weights = mx.softmax(scores, axis=-1, precise=True).reshape(1, kv_heads, -1, padded)
        return (weights @ kv).reshape(1, heads, query_rows, head_dim)

    ops: dict[str, Callable[[int], list[mx.array]]] = {
        "add": lambda i: [xs[i] + xs[(i + 1) % count]],
        "rms_norm": lambda i: [block.input_layernorm(xs[i])],
        "q_proj": lambda i: [block.self_attn.q_proj(xs[i])],
        "sdpa_masked": lambda i: [mx.fast.scaled_dot_product_attention(qs[i], kvs[i], kvs[i], scale=scale, mask=mask)],
        "sdpa_causal": lambda i: [mx.fast.scaled_dot_product_attention(qs[i], kvs[i], kvs[i], scale=scale, mask="causal")],
        "attention_unfused": lambda i: [unfused_attention(qs[i], kvs[i])],
        "pad_queries": lambda i: [mx.pad(qs[i][:, :, :rows], [(0, 0), (0, 0), (0, query_rows - rows), (0, 0)])],
    }  # fmt: skip
    if hasattr(block.mlp, "gate_proj"):  # dense MLP (an MoE block's experts are another study)
        ops["gate_proj"] = lambda i: [block.mlp.gate_proj(xs[i])]
    if cuda_available():
        from mlx_serve.kernels.add_norm import kernel_add_norm
        from mlx_serve.kernels.paged_gather import paged_gather
        from mlx_serve.ragged import LaneRows

        pool = KVPool(layout, -(-padded // BLOCK), BLOCK)
        table = mx.arange(-(-(history + rows) // BLOCK), dtype=mx.int32)
        lane = LaneRows(0, rows, mx.zeros((0,), mx.int32), mask, table, mx.array([history + rows, padded], dtype=mx.int32),
                        padded, query_rows)  # fmt: skip
        ops["paged_gather"] = lambda i: list(paged_gather(pool.keys[i], pool.values[i], lane, BLOCK))
        ops["add_norm_kernel"] = lambda i: list(kernel_add_norm(xs[i], xs[(i + 1) % count], block.input_layernorm))
    return {name: _time_calls(make, count, repeats) for name, make in ops.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--rows", default="128", help="chunk rows, comma-separated (e.g. 64,128,512; 0: decode only)")
    parser.add_argument("--history", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--parts", default="step,op", help="step, op, count (primitives in a warm step's graph)")
    parser.add_argument("--variants", default="modules,fused,compiled", help=f"steps through: {', '.join(VARIANTS)}")
    parser.add_argument("--cuda-profile", action="store_true", help="one step in a CUDA profiler range (ncu)")
    parser.add_argument("--split-quantized-k", default="auto", choices=("auto", "on", "off", "all"))
    parser.add_argument("--chunk-attention", default="auto", choices=("auto", "sdpa", "matmul"))
    parser.add_argument(
        "--paged-rows-first", choices=("on", "off"), default="on",
        help="ragged.PAGED_ROWS_FIRST: the paged chunk attention reads and writes the step's rows in place (A/B)",
    )
    args = parser.parse_args()
    ragged.PAGED_ROWS_FIRST = args.paged_rows_first == "on"
    dummy, layout = dummy_and_layout(args.shape)
    base = {"shape": args.shape, "lanes": args.lanes, "history": args.history, "paged_rows_first": args.paged_rows_first}
    for rows in [int(n) for n in args.rows.split(",")]:
        if "step" in args.parts:
            for variant in args.variants.split(","):
                row = step_phases(
                    dummy.model, layout, args.lanes, rows, args.history, variant, args.repeats, args.cuda_profile,
                    args.split_quantized_k, args.chunk_attention,
                )
                print(json.dumps({**base, "rows": rows, "part": "step", "variant": variant, **row}), flush=True)
                mx.clear_cache()
        if "count" in args.parts:
            for variant in args.variants.split(","):
                row = step_ops(dummy.model, layout, args.lanes, rows, args.history, variant)
                print(json.dumps({**base, "rows": rows, "part": "count", "variant": variant, **row}), flush=True)
        if "op" in args.parts:
            for name, row in op_costs(dummy.model, layout, rows, args.history, args.lanes, args.repeats).items():
                print(json.dumps({**base, "rows": rows, "part": "op", "op": name, **row}), flush=True)
            mx.clear_cache()


if __name__ == "__main__":
    main()
