"""Where one decode step's time goes on the GPU: building the graph, queueing it (async_eval), and waiting.

Runs the model runner directly (no engine, no scheduler) on a dummy model: `lanes` decode lanes over a `history`
token history, every step synchronous (build -> async_eval -> eval) so the three phases are separate, then the
same steps pipelined (one in flight) as the engine runs them. mlx-lm's own batched decode step over a dense
cache is measured the same way. Run it under different MLX settings (e.g. MLX_MAX_OPS_PER_BUFFER) to compare.

    python -m benchmarks.gpu.profile_step --shape 8b --lanes 1,8,64 --variants fused,compiled,mlx-lm

With `--cuda-profile`, one more synchronous step of each of our variants runs between cuProfilerStart and
cuProfilerStop, so that Nsight Compute started with `--profile-from-start off` times that step's kernels alone:

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python -m benchmarks.gpu.profile_step --shape 8b-4bit --lanes 8 --variants fused --cuda-profile
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import time

import mlx.core as mx

from benchmarks.gpu.models import dummy_and_layout
from mlx_serve.engine_setup import split_quantized_k
from mlx_serve.kernels.paged_attention import select_decode_attention
from mlx_serve.kv_pool import KVLayout, KVPool
from mlx_serve.runner import ModelRunner
from mlx_serve.sampling import sample_rows
from mlx_serve.types import SamplingParams
from scheduler.plan import PENDING_TOKEN, Lane, LaneKind, StepPlan

STEPS = 20


def _median_ms(samples: list[float]) -> float:
    return round(1e3 * statistics.median(samples), 3)


@contextlib.contextmanager
def cuda_profiled(enabled: bool):
    """Nsight Compute's capture range (`--profile-from-start off`) around the block, when enabled."""
    cuda = ctypes.CDLL("libcuda.so.1") if enabled else None
    if cuda is not None:
        cuda.cuProfilerStart()
    try:
        yield
    finally:
        if cuda is not None:
            cuda.cuProfilerStop()


def ours(
    model, layout: KVLayout, lanes: int, history: int, compiled: bool, fused: bool = False, profiled: bool = False,
    split: str = "auto",
) -> dict:
    blocks_per_lane = -(-(history + 101 + STEPS + 8) // 16)
    pool = KVPool(layout, lanes * blocks_per_lane, 16)
    runner = ModelRunner(
        model, pool, select_decode_attention("auto"), compile_decode=compiled, fuse_decode=fused,
        split_k=split_quantized_k(split, False),
    )  # fmt: skip
    ids = [f"r{i}" for i in range(lanes)]
    for rid in ids:
        runner.add_request(rid, SamplingParams(temperature=0.0))

    def plan(step: int, pending: bool) -> StepPlan:
        token = PENDING_TOKEN if pending else 7
        return StepPlan(
            step,
            tuple(
                Lane(rid, LaneKind.DECODE, (token,), history + step,
                     tuple(range(i * blocks_per_lane, (i + 1) * blocks_per_lane)), True)
                for i, rid in enumerate(ids)
            ),
            0, "profile", None, True,
        )  # fmt: skip

    build, queue, wait = [], [], []
    for step in range(STEPS + 3):
        lanes_ = list(plan(step, False).lanes)
        t0 = time.perf_counter()
        if compiled:
            logits = runner.compiled(lanes_, mx.array([7] * lanes, dtype=mx.int32))
        else:
            prepared = runner._prepare(lanes_, None)
            logits = runner._logits(runner._forward(prepared)[prepared.sample_rows])
        sampled = sample_rows(logits, [runner.samplers[rid] for rid in ids])
        t1 = time.perf_counter()
        mx.async_eval(sampled.tokens, pool.state())
        t2 = time.perf_counter()
        mx.eval(sampled.tokens, pool.state())
        t3 = time.perf_counter()
        if step >= 3:
            build.append(t1 - t0)
            queue.append(t2 - t1)
            wait.append(t3 - t2)
    if profiled:
        mx.synchronize()
        with cuda_profiled(True):
            runner.collect(runner.submit(plan(STEPS + 3, False)))
            mx.synchronize()
    previous = runner.submit(plan(100, False))
    t0 = time.perf_counter()
    for step in range(101, 101 + STEPS):
        current = runner.submit(plan(step, True), previous)
        runner.collect(previous)
        previous = current
    runner.collect(previous)
    pipelined = (time.perf_counter() - t0) / STEPS
    return {
        "build_ms": _median_ms(build), "async_eval_ms": _median_ms(queue), "wait_ms": _median_ms(wait),
        "pipelined_step_ms": round(1e3 * pipelined, 3),
    }  # fmt: skip


def mlx_lm(model, lanes: int, history: int, profiled: bool = False) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((lanes, history), mx.int32), cache=cache))
    token = mx.zeros((lanes, 1), mx.int32)
    build, queue, wait = [], [], []
    for step in range(STEPS + 3):
        t0 = time.perf_counter()
        token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[:, None]
        t1 = time.perf_counter()
        mx.async_eval(token)
        t2 = time.perf_counter()
        mx.eval(token)
        t3 = time.perf_counter()
        if step >= 3:
            build.append(t1 - t0)
            queue.append(t2 - t1)
            wait.append(t3 - t2)
    if profiled:
        mx.synchronize()
        with cuda_profiled(True):
            token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[:, None]
            mx.eval(token)
            mx.synchronize()
    # pipelined as generate_step does: queue step n+1 before reading step n
    t0 = time.perf_counter()
    nxt = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[:, None]
    mx.async_eval(nxt)
    for _ in range(STEPS):
        current = nxt
        nxt = mx.argmax(model(current, cache=cache)[:, -1, :], axis=-1)[:, None]
        mx.async_eval(nxt)
        current.tolist()
    nxt.tolist()
    pipelined = (time.perf_counter() - t0) / (STEPS + 1)
    return {
        "build_ms": _median_ms(build), "async_eval_ms": _median_ms(queue), "wait_ms": _median_ms(wait),
        "pipelined_step_ms": round(1e3 * pipelined, 3),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--lanes", default="1,8,64")
    parser.add_argument("--history", type=int, default=1024)
    parser.add_argument("--variants", default="fused,compiled,eager,mlx-lm")
    parser.add_argument("--cuda-profile", action="store_true", help="one step of ours in a CUDA profiler range")
    parser.add_argument("--split-quantized-k", default="auto", choices=("auto", "on", "off"))
    parser.add_argument(
        "--single-pass-tokens", type=int, default=None,
        help="histories up to this many tokens take the decode attention's one-pass kernel (default: the module's)",
    )
    args = parser.parse_args()
    if args.single_pass_tokens is not None:
        from mlx_serve.kernels import paged_attention

        paged_attention.SINGLE_PASS_TOKENS = args.single_pass_tokens
    dummy, layout = dummy_and_layout(args.shape)
    env = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    for lanes in [int(n) for n in args.lanes.split(",")]:
        for variant in args.variants.split(","):
            if variant == "mlx-lm":
                row = mlx_lm(dummy.peer_model, lanes, args.history, args.cuda_profile)
            else:
                compiled, fused = variant in ("compiled", "fused"), variant == "fused"
                row = ours(
                    dummy.model, layout, lanes, args.history, compiled, fused, args.cuda_profile, args.split_quantized_k
                )
            print(json.dumps({"shape": args.shape, "env": env, "lanes": lanes, "variant": variant, **row}), flush=True)
            mx.clear_cache()


if __name__ == "__main__":
    main()
