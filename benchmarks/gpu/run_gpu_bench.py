"""GPU benchmark of issue 7: our engine against mlx-lm on dummy-weight Qwen3 shapes, in one process, one run.

    python -m benchmarks.gpu.run_gpu_bench --shapes 0.6b,8b,30b-a3b,8b-4bit --quick --out $OUT

Per shape (weights built in memory, never on disk), mlx-lm's BatchGenerator and generate_step against our engine
(`Engine.from_model`) on the same model object: decode tok/s at 1/8/32/64 streams over a 1k history (both
engines in alternating order, `--decode-rounds` times, median),
prefill tok/s, 8 streams decoding while a 16k prompt arrives (gaps and the long prompt's TTFT against its solo
TTFT), and a shared 8k prefix (continuation TTFT against cold). Writes gpu_bench.json and gpu_bench.md into
--out after every shape, so a run cut short keeps what it measured. `--shapes tiny --device cpu` checks the
script itself on a CPU (CI does, `tests/benchmarks/test_gpu_bench_harness.py`). On the lent H200, one device call
installs, checks parity and runs it: `bash benchmarks/gpu/on_device.sh <these arguments>`.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import time
import traceback
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx

from benchmarks.gpu import peer
from benchmarks.gpu.models import build_dummy_model, pristine_copy
from benchmarks.gpu.ours import OurSide
from benchmarks.gpu.report import markdown
from benchmarks.gpu.workloads import FULL, QUICK, TINY, BenchParams, Prompts
from mlx_serve import engine_setup, ragged
from mlx_serve.commands.serve import factor_arg, floor_slack_arg, row_quantum_arg, step_target_arg, weight_arg
from mlx_serve.config import AUTO_STEP_FACTOR, AUTO_STEP_FLOOR_MS
from mlx_serve.kernels import paged_attention


class Progress:
    """Prints each figure as it is measured and rewrites the JSON, so a run cut short keeps what it measured."""

    def __init__(self, results: list[dict], args: argparse.Namespace, header: str, meta: dict) -> None:
        self.results, self.args, self.header, self.meta = results, args, header, meta
        self.t0 = time.perf_counter()

    def __call__(self, what: str, value: object) -> None:
        print(
            f"[{time.perf_counter() - self.t0:7.1f} s] {what}: {json.dumps(value, default=str)[:240]}",
            flush=True,
        )
        write(self.results, self.args.out, self.header, self.meta)


def measure_peer(dummy, prompts: Prompts, p: BenchParams, out: dict, note: Progress, decode_only: bool = False) -> None:
    """mlx-lm's figures except decode, which `measure_decode` takes interleaved with ours."""
    model = dummy.peer_model
    peer.decode(model, prompts, replace(p, decode_prompt=min(256, p.decode_prompt), decode_tokens=4), 8)
    peer.prefill(model, prompts, p.prefill_lengths[0])  # warm-up: JIT compilation, allocations
    if decode_only:
        return
    out["prefill"] = {}
    for n in (*p.prefill_lengths, p.contended_long):
        out["prefill"][str(n)] = peer.prefill(model, prompts, n)
        note(f"{dummy.name} mlx-lm prefill {n}", out["prefill"][str(n)])
    out["contended"] = peer.contended(model, prompts, p)
    note(f"{dummy.name} mlx-lm contended", out["contended"])
    mx.clear_cache()


def measure_decode(
    dummy, side: OurSide, prompts: Prompts, p: BenchParams, rounds: int, peer_out: dict, ours_out: dict, note: Progress
) -> None:
    """Decode figures of both engines in alternating order (mlx-lm first in even rounds, ours first in odd ones):
    the host's speed drifts by up to 2x within minutes, so a figure is the median over rounds, each round's pair
    taken back to back."""
    peer_runs: dict[str, list[dict]] = {}
    our_runs: dict[str, list[dict]] = {}
    for round_ in range(rounds):
        for n in p.stream_counts:
            def theirs(n: int = n) -> dict:
                if n == 1:  # batch 1 is compared with generate_step, mlx-lm's fastest single-stream path
                    return peer.generate_step_decode(dummy.peer_model, prompts, p)
                return _peer_decode(dummy.peer_model, prompts, p, n)

            order = (("mlx-lm", theirs), ("ours", lambda n=n: side.decode(prompts, p, n)))
            for name, run in order if round_ % 2 == 0 else order[::-1]:
                # each side starts without the other's cached buffers: MLX's CUDA allocator hands a freed buffer back
                # to the device's pool lazily, and a 61 GB model's mlx-lm 64-stream prefill right after ours ran out
                # of memory (H100, 30B-A3B, forty-ninth run; not enough alone in the fiftieth: `_peer_decode`)
                mx.clear_cache()
                memory = {"active_gb": mx.get_active_memory() / 1e9, "cache_gb": mx.get_cache_memory() / 1e9}
                result = {**run(), "memory_before": memory}
                (peer_runs if name == "mlx-lm" else our_runs).setdefault(str(n), []).append(result)
                note(f"{dummy.name} {name} decode {n} (round {round_ + 1})", result)
    for runs, out in ((peer_runs, peer_out), (our_runs, ours_out)):
        out["decode"] = {n: _median_run(results) for n, results in runs.items()}
        out["decode_rounds"] = runs
    peer_out["generate_step"] = peer_out["decode"].get("1", {"tok_s": None})


def _peer_decode(model, prompts: Prompts, p: BenchParams, streams: int) -> dict:
    """mlx-lm's decode, prefilling all streams' prompts at once; where that runs out of memory beside our engine
    (30B-A3B's 64 streams on an 80 GB H100: n30_1, n30_3), again at mlx_lm.server's default of 8 prompts at once,
    which the result records (`prefill_batch`): such a round read ~12% slower in n30_6 (`peer.decode`); the figure
    is the median of the rounds, so one retried round does not set it."""
    try:
        return peer.decode(model, prompts, p, streams)
    except RuntimeError as error:
        if "out of memory" not in str(error):
            raise
    gc.collect()  # the failed generator's arrays
    mx.clear_cache()
    return {**peer.decode(model, prompts, p, streams, prefill_batch=8), "prefill_batch": 8}


def _median_run(results: list[dict]) -> dict:
    """The run with the median tok/s (the lower middle one for an even count)."""
    valid = sorted((r for r in results if r.get("tok_s")), key=lambda r: r["tok_s"])
    return valid[(len(valid) - 1) // 2] if valid else results[0]


def measure_lever(
    dummy, kv_blocks: int, args: argparse.Namespace, engine: dict, prompts: Prompts, p: BenchParams,
    streams: list[int], label: str, note: Progress, fresh: bool = False,
) -> dict:
    """Decode figures of our engine with `engine`'s overrides (one fast path off), for the lever's before/after.
    A lever that changes the weights' layout (`fresh`: split over K) runs on a fresh copy of mlx-lm's modules: our
    first engine re-laid the shared model's arrays in place."""
    engine = dict(engine)
    attention = engine.pop("attention", args.attention)
    if fresh:
        dummy = replace(dummy, model=pristine_copy(dummy.peer_model))
    side = OurSide(dummy, kv_blocks, 500.0, attention, **engine, warm_up=False)
    try:
        figures = {}
        for n in streams:
            figures[str(n)] = side.decode(prompts, p, n)
            note(f"{dummy.name} ours decode {n}, {label}", figures[str(n)])
        return figures
    finally:
        side.close()
        del side
        gc.collect()


def engine_settings(args: argparse.Namespace) -> dict:
    """OurSide's keyword arguments from the flags (the EngineConfig fields they name)."""
    return {
        "compile_decode": args.compile_decode,
        "fuse_decode": args.fuse_decode,
        "cost_model": args.cost_model,
        "dense_experts": args.dense_experts,
        "dequantize_rows": args.dequantize_rows,
        "expert_tiles": args.expert_tiles,
        "quantized_tiles": args.quantized_tiles,
        "quantized_gemv": args.quantized_gemv,
        "split_quantized_k": args.split_quantized_k,
        "chunk_attention": args.chunk_attention,
        "fuse_mixed": args.fuse_mixed,
        "compile_mixed": args.compile_mixed,
        "row_quantum": args.row_quantum,
        "step_target_factor": args.target_factor,
        "step_target_floor_ms": args.target_floor_ms,
        "defer_mixed_traces": args.defer_mixed_traces == "on",
        "trace_neighbour_shapes": args.trace_neighbour_shapes,
        "run_idle_traces": args.run_idle_traces == "on",
        "stand_in_traces": args.stand_in_traces == "on",
        "price_stand_ins": args.price_stand_ins == "on",
        "time_idle_traces": args.time_idle_traces == "on",
        "fill_stand_ins": args.fill_stand_ins == "on",
        "price_stand_in_runs": args.price_stand_in_runs == "on",
        "budget_midpoints": args.budget_midpoints == "on",
        "price_first_runs": args.price_first_runs == "on",
        "checked_fill": args.checked_fill,
        "plan_headroom": args.plan_headroom,
        "debt_tolerance": args.debt_tolerance,
        "cost_trust_factor": args.cost_trust_factor,
        "cost_residual_weight": args.cost_residual_weight,
        "floor_slack": args.floor_slack,
        "slack_guard_rows": args.slack_guard_rows,
        "untrained_rows": args.untrained_rows,
        "max_prefill_slowdown": args.max_prefill_slowdown,
        "plan_padding": args.plan_padding == "on",
        "warm_chunk_rows": args.warm_chunk_rows,
    }


def warm_pass_summary(pass_result: dict) -> dict:
    """A warm pass's headline figures, kept for every pass (only the last one's full record is): the first starts
    from a fit that has seen only solo prefill, as a server's first long prompt beside streams does."""
    steps = pass_result["steps"]
    return {"long_ttft_s": pass_result["long_ttft_s"], "gap_ratio": pass_result["gap_ratio"],
            "gap_max_ms": pass_result["gap_max_ms"], "mixed_steps": steps["mixed_steps"],
            "mixed_rows_p50": steps["mixed_rows_p50"], "mixed_ms_p50": steps["mixed_ms_p50"]}  # fmt: skip


def resolved_settings(engine) -> dict:
    """The settings as the engine resolved them (auto: by model and backend), for the record."""
    scheduler = engine.scheduler.config
    return {
        "row_quantum": scheduler.row_quantum,  # as resolved (auto: by model and backend)
        "budget_midpoints": scheduler.budget_midpoints,
        "price_first_runs": scheduler.price_first_runs,
        "warm_chunk_rows": engine.config.warm_chunk_rows,
        "checked_fill": scheduler.checked_fill,
        "plan_headroom": scheduler.plan_headroom,
        "debt_tolerance": scheduler.debt_tolerance,
        "price_stand_ins": engine.config.price_stand_ins,
        "fill_stand_ins": scheduler.fill_stand_ins,
        "price_stand_in_runs": scheduler.price_stand_in_runs,
        "time_idle_traces": engine.config.time_idle_traces,
        "cost_trust_factor": scheduler.cost_trust_factor,
        "cost_residual_weight": scheduler.cost_residual_weight,
        "floor_slack": scheduler.floor_slack,
        "slack_guard_rows": scheduler.slack_guard_rows,
        "untrained_rows": scheduler.untrained_rows,
        "max_prefill_slowdown": scheduler.max_prefill_slowdown,
        "plan_kv_bucket": scheduler.kv_bucket,  # 0: planned with exact counts
        "pads_history": scheduler.pads_history,  # False: the attention read the pool
        "step_target_floor_ms": scheduler.step_target_floor_ms,
    }


@dataclass(frozen=True, slots=True)
class Lever:
    """A fast path measured off, before and after: the same engine with `overrides`, decoding the stream counts
    its flag names, recorded under `key`."""

    flag: str
    key: str
    label: str
    overrides: dict
    help: str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


LEVERS = (  # in the order they run
    Lever("--eager-streams", "decode_compile_off", "compile off", {"compile_decode": "off", "fuse_decode": "off"},
          "compile off (e.g. 1,8,32)"),
    Lever("--unfused-streams", "decode_unfused", "unfused", {"fuse_decode": "off"},
          "the fused decode forward off (e.g. 1,8)"),
    Lever("--gathered-experts-streams", "decode_gathered_experts", "gathered experts", {"dense_experts": "off"},
          "MoE experts gathered (dense experts off; e.g. 8,64)"),
    Lever("--quantized-streams", "decode_quantized_matmul", "quantized matmul", {"dequantize_rows": 0},
          "every quantized matmul kept (dequantize rows 0; e.g. 8,64)"),
    Lever("--unsplit-streams", "decode_unsplit", "not split over K", {"split_quantized_k": "off"},
          "quantized projections not split over K (e.g. 8,64)"),
    Lever("--split-all-streams", "decode_split_all", "fused projections split over K too", {"split_quantized_k": "all"},
          "the fused q/k/v and gate/up split over K too (e.g. 8,64)"),
)  # fmt: skip
# `--reference-streams N`: one count, the attention's own reference (the others take a list)
REFERENCE_ATTENTION = Lever("--reference-streams", "decode_reference_attention", "reference attention",
                            {"attention": "reference"}, "the reference attention")


def measure_levers(dummy, kv_blocks: int, args: argparse.Namespace, engine: dict, prompts: Prompts,
                   p: BenchParams, out: dict, note: Progress) -> None:
    """Each lever whose flag names stream counts, then the reference attention where `--reference-streams` asks."""
    runs = [(lever, getattr(args, lever.dest)) for lever in LEVERS]
    runs.append((REFERENCE_ATTENTION, [args.reference_streams] if args.reference_streams else []))
    for lever, streams in runs:
        if streams:
            fresh = "split_quantized_k" in lever.overrides
            out[lever.key] = measure_lever(
                dummy, kv_blocks, args, {**engine, **lever.overrides}, prompts, p, streams, lever.label, note, fresh
            )


def measure_ours(
    dummy, prompts: Prompts, p: BenchParams, args: argparse.Namespace, out: dict, peer_out: dict, note: Progress
) -> float:
    kv_blocks = math.ceil(1.25 * max(p.stream_counts) * (p.decode_prompt + p.decode_tokens + 16) / 16)
    kv_blocks = max(kv_blocks, math.ceil(2.5 * (p.contended_long + p.prefix_len) / 16))
    # a serving-sized pool (`--kv-blocks`): MLX's CUDA encoder counts each pool array a kernel reads toward its
    # 1,000 MB a graph, so a pool of GBs a layer commits a graph after every kernel that touches it
    kv_blocks = args.kv_blocks or kv_blocks
    engine = engine_settings(args)
    # only the contended engine meets long prompts' chunk shapes: the others skip the warm-up
    side = OurSide(dummy, kv_blocks, 500.0, args.attention, **engine, warm_up=False)
    try:
        side.decode(prompts, replace(p, decode_prompt=min(256, p.decode_prompt), decode_tokens=4), 8)
        side.prefill(prompts, p.prefill_lengths[0])
        if not args.contended_only:
            measure_decode(dummy, side, prompts, p, args.decode_rounds, peer_out, out, note)
        out["prefill"] = {}
        lengths = (*([] if args.contended_only else p.prefill_lengths), p.contended_long)
        for n in () if args.decode_only else lengths:
            out["prefill"][str(n)] = side.prefill(prompts, n)
            note(f"{dummy.name} ours prefill {n}", out["prefill"][str(n)])
    finally:
        side.close()
    del side
    gc.collect()
    if args.fresh_cache == "on":  # the contended engine starts without the decode engine's cached buffers
        mx.clear_cache()
    measure_levers(dummy, kv_blocks, args, engine, prompts, p, out, note)
    if args.decode_only:
        return 0.0
    # the step target for contention: a few 8-stream decode steps, so a prefill chunk never freezes the streams
    step8 = (
        out["decode"][str(p.contended_streams)]["step_ms"]
        if str(p.contended_streams) in out.get("decode", {})
        else None
    )
    # or "auto": the engine's own
    target = args.step_target_ms or max(args.target_floor_ms, args.target_factor * (step8 or 10.0))
    side = OurSide(dummy, kv_blocks, target, args.attention, **engine)
    try:
        side.prefill(prompts, p.prefill_lengths[0])  # the cost model learns prefill, then contended steps
        out["warm_up"] = {"shapes": side.engine.warmed[0], "s": round(side.engine.warmed[1], 2)}
        out.update(resolved_settings(side.engine))
        note(f"{dummy.name} ours warm-up", out["warm_up"])
        # warm-up with the same long prompt: the chunk shapes it meets are compiled (cuDNN graphs) before the run
        # that counts, as mlx-lm's were by its solo prefill of the same prompt length
        # kept: its steps train the cost model the measured run starts from
        out["settled_traces"], out["warm_passes"] = [], []
        for _ in range(max(1, args.warm_passes)):  # the record of the last pass is kept
            out["contended_warm"] = side.contended(prompts, replace(p, tokens_before=4, tokens_after=4))
            out["warm_passes"].append(warm_pass_summary(out["contended_warm"]))
            out["settled_traces"].append(side.settle_traces())  # the pass's new compiled shapes, traced while idle
        if args.keep_traces_at:
            out["kept_traces_at"] = args.keep_traces_at
            out["untraced"] = side.keep_traces_at(p.contended_streams, args.keep_traces_at)
        out["contended"] = side.contended(prompts, p)
        note(f"{dummy.name} ours contended", out["contended"])
        out["shared_prefix"] = side.shared_prefix(prompts, p)
        mixed = side.engine.runner.compiled_mixed  # shapes traced and waiting, stand-ins, traces' runs, eager builds
        out["compiled_mixed"] = None if mixed is None else mixed.summary()
        status = side.engine.status()
        out["scheduler"] = status["counters"]
        out["step_target_ms"] = status["step_target_ms"]  # with auto: the one it had learned by the end
        out["cost_observations"] = side.cost_observations  # what the contended engine's cost model was shown
        out["decode_observations"] = side.decode_observations  # its decode-only steps, placed among those
        note(f"{dummy.name} ours shared prefix", out["shared_prefix"])
    finally:
        side.close()
    mx.clear_cache()
    return out["step_target_ms"]


def bench_shape(name: str, p: BenchParams, args: argparse.Namespace, result: dict, note: Progress) -> None:
    """Fills `result` (already in the run's list) figure by figure."""
    t0 = time.perf_counter()
    dummy = build_dummy_model(name, args.dtype)
    result.update(
        shape=name, weight_bytes=dummy.weight_bytes, build_s=time.perf_counter() - t0, step_target_ms=0,
        expert_bytes=dummy.expert_bytes, experts=dummy.config.get("num_experts", 0),
        experts_per_token=dummy.config.get("num_experts_per_tok", 0),
    )
    result.update(asdict(p), peer={}, ours={}, decode_only=args.decode_only, contended_only=args.contended_only)
    note(f"{name} built", {"weight_gb": dummy.weight_bytes / 1e9})
    prompts = Prompts(dummy.config["vocab_size"], seed=args.seed)
    if not args.contended_only:
        measure_peer(dummy, prompts, p, result["peer"], note, args.decode_only)
    result["step_target_ms"] = measure_ours(dummy, prompts, p, args, result["ours"], result["peer"], note)
    result["wall_s"] = time.perf_counter() - t0


def mlx_settings(environ: dict[str, str]) -> dict[str, str]:
    """MLX's own tuning variables set for the run (MLX_MAX_OPS_PER_BUFFER, MLX_MAX_MB_PER_BUFFER: how much work one
    CUDA graph takes). They change what a run measures, so the recorded command carries them; the kernel cache's
    location and our engine's variables do not."""
    return {
        k: v for k, v in sorted(environ.items())
        if k.startswith("MLX_") and not k.startswith("MLX_SERVE_") and k != "MLX_PTX_CACHE_DIR"
    }  # fmt: skip


def write(results: list[dict], out: Path, header: str, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    (out / "gpu_bench.md").write_text(markdown(results, header) + "\n")


def _argument(name: str, value: object) -> str:
    """One parsed argument as it is typed, so the recorded command pastes: a flag bare, a list comma-joined;
    "" where it was left unset (None, False, empty)."""
    flag = f"--{name.replace('_', '-')}"
    if value is None or value is False or value in ([], ""):
        return ""
    if value is True:
        return flag
    if isinstance(value, list):
        return f"{flag} {','.join(str(v) for v in value)}"
    return f"{flag} {value}"


def _counts(text: str) -> list[int]:
    """A comma-separated list of stream counts ("8,64")."""
    return [int(n) for n in text.split(",") if n]


def _head_rows(text: str) -> list[int]:
    """`--paged-head-rows SHORT,LONG`: two whole numbers of head rows ("8192,24576")."""
    rows = _counts(text)
    if len(rows) != 2 or min(rows) < 0:
        raise argparse.ArgumentTypeError(f"two whole numbers >= 0, SHORT,LONG, not {text!r}")
    return rows


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('what runs and where its results go')
    group.add_argument("--shapes", default="0.6b,8b,30b-a3b,8b-4bit")
    group.add_argument("--quick", action="store_true", help="fewer decode tokens per measurement")
    group.add_argument("--dtype", default="bfloat16")
    group.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--streams", default="", help="decode stream counts instead of 1,8,32,64 (e.g. 32,64)")
    group.add_argument("--decode-only", action="store_true", help="measure decode only (JSON and log, no table)")
    group.add_argument(
        "--contended-only",
        action="store_true",
        help="our contended run, its solo prefill and the shared prefix only (needs --step-target-ms; no table)",
    )
    group.add_argument(
        "--decode-rounds", type=int, default=3,
        help="decode figures: rounds of both engines in alternating order, each figure a side's median round (3 "
             "since the fiftieth run: with 2 the median was each side's slower round, so one slow round set it)"
    )
    group.add_argument(
        "--decode-prompt", type=int, default=0, help="history of the decode streams (default 1,024)"
    )
    group.add_argument(
        "--step-target-ms", type=step_target_arg, default=None,
        help="default: target-factor x 8-stream step; auto: the engine's own (target-factor x its measured decode step)"
    )
    group.add_argument("--target-factor", type=float, default=AUTO_STEP_FACTOR)
    group.add_argument("--target-floor-ms", type=float, default=AUTO_STEP_FLOOR_MS,
                        help="EngineConfig.step_target_floor_ms: the least auto target")
    group.add_argument("--warm-passes", type=int, default=2,
                        help="contended warm passes before the measured one, the idle engine tracing after each: a "
                             "server that has read such a prompt before (the second pass's budgets want traces the "
                             "first pass's compiled steps taught; 1: the nineteenth run's setting)")
    group.add_argument("--keep-traces-at", type=_counts, default=[], metavar="HISTORIES",
                        help="after the warm passes, forget every trace beside the contended streams but those at "
                             "these history buckets (e.g. 1024,12288,16384: a sparse trace set met by chance)")
    group.add_argument("--kv-blocks", type=int, default=0,
                        help="our engines' KV pool in blocks of 16 (0: what the workloads need, x1.25-2.5)")
    group.add_argument("--fresh-cache", choices=["on", "off"], default="off",
                        help="empty MLX's buffer cache before the contended engine is built")
    group.add_argument("--out", type=Path, default=Path("gpu_bench_out"))
    group.add_argument(
        "--label", default="", help="free text for the header (e.g. the commit and patches measured)"
    )


def _add_variant_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("extra decode measurements, each beside the default engine's")
    group.add_argument(REFERENCE_ATTENTION.flag, type=int, default=0,
                       help=f"also decode this many streams with {REFERENCE_ATTENTION.help}")
    for lever in LEVERS:
        group.add_argument(lever.flag, type=_counts, default=[], help=f"also decode these stream counts with {lever.help}")


def _add_path_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the engine's compute paths (EngineConfig; auto: the engine's own choice)")
    group.add_argument(
        "--attention", default="auto", help="decode attention of our engine (auto/kernel/reference)"
    )
    group.add_argument("--compile-decode", default="auto", choices=("auto", "on", "off"))
    group.add_argument("--fuse-decode", default="auto", choices=("auto", "on", "off"))
    group.add_argument("--fuse-mixed", default="auto", choices=("auto", "on", "off"),
                        help="steps with prefill chunks through the fused forward too (FusedDecode.mixed; auto: CUDA)")
    group.add_argument("--compile-mixed", default="auto", choices=("auto", "on", "off"),
                        help="decode lanes + one chunk through a compiled trace (CompiledMixed; auto: on with CUDA)")
    group.add_argument("--dense-experts", default="auto", choices=("auto", "on", "off"))
    group.add_argument("--expert-tiles", default="auto", choices=("auto", "on", "off"))
    group.add_argument("--quantized-tiles", default="auto", choices=("auto", "on", "off"))
    group.add_argument("--quantized-gemv", default="auto", choices=("auto", "on", "off"))
    group.add_argument("--split-quantized-k", default="auto", choices=("auto", "on", "off", "all"))
    group.add_argument("--chunk-attention", default="auto", choices=("auto", "sdpa", "matmul", "paged"))
    group.add_argument("--dequantize-rows", type=int, default=0, help="EngineConfig.dequantize_rows (0: never)")


def _add_planning_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('step planning (EngineConfig: cost model, row budgets, compiled traces)')
    group.add_argument("--cost-model", default="ema", choices=("ema", "bucketed", "affine"))
    group.add_argument("--defer-mixed-traces", choices=["on", "off"], default="on",
                        help="EngineConfig.defer_mixed_traces: a new compiled mixed shape runs eager until traced idle")
    group.add_argument("--run-idle-traces", choices=["on", "off"], default="on",
                        help="EngineConfig.run_idle_traces: each shape traced idle also runs once there (scratch block)")
    group.add_argument("--stand-in-traces", choices=["on", "off"], default="on",
                        help="EngineConfig.stand_in_traces: an untraced step may replay a larger traced shape, padded")
    group.add_argument("--price-stand-ins", choices=["on", "off"], default="off",
                        help="EngineConfig.price_stand_ins: budgets price a step a stand-in would replay as compiled")
    group.add_argument("--time-idle-traces", choices=["on", "off"], default="on",
                        help="EngineConfig.time_idle_traces: a shape traced idle runs twice there, the second timed, "
                             "so it may stand in before a real step ran it")
    group.add_argument("--fill-stand-ins", choices=["on", "off"], default="on",
                        help="EngineConfig.fill_stand_ins: a step that would stand in grows to its stand-in's rows")
    group.add_argument("--price-stand-in-runs", choices=["on", "off"], default="on",
                        help="EngineConfig.price_stand_in_runs: a step that would stand in is priced at that trace's run")
    group.add_argument("--trace-neighbour-shapes", type=int, default=0,
                        help="EngineConfig.trace_neighbour_shapes: shapes next to met ones traced ahead when idle")
    group.add_argument("--budget-midpoints", choices=["on", "off"], default="on",
                        help="EngineConfig.budget_midpoints: a halved budget grows by half again where it fits")
    group.add_argument("--price-first-runs", choices=["on", "off"], default="off",
                        help="EngineConfig.price_first_runs: a never-run shape priced with its first run's excess")
    group.add_argument("--checked-fill", choices=["off", "untraced", "on"], default="on",
                        help="EngineConfig.checked_fill: when a row-tile fill past the budget's bucket is held")
    group.add_argument("--plan-headroom", type=float, default=0.9,
                        help="EngineConfig.plan_headroom: contended steps planned to this fraction of the target")
    group.add_argument("--debt-tolerance", type=factor_arg, default=1.25,
                        help="EngineConfig.debt_tolerance: decode debt only past this x what a contended step may take")
    group.add_argument("--cost-trust-factor", type=float, default=1.5,
                        help="EngineConfig.cost_trust_factor: the affine fit's trust region in rows (0: off)")
    group.add_argument("--cost-residual-weight", type=weight_arg, default=0.3,
                        help="EngineConfig.cost_residual_weight: a price corrected by its rows bucket's recent misses "
                             "(0: off)")
    group.add_argument("--floor-slack", type=floor_slack_arg, default="auto",
                        help="EngineConfig.floor_slack: a step may take this x the floor step's time over the target "
                             "(auto: engine_setup.floor_slack)")
    group.add_argument("--slack-guard-rows", type=int, default=512,
                        help="EngineConfig.slack_guard_rows: no floor slack where a step of this many rows fits, "
                        "and at most its price elsewhere (0: off)")
    group.add_argument("--untrained-rows", type=int, default=0,
                        help="EngineConfig.untrained_rows: most prefill rows of a contended step the cost model "
                        "cannot price yet (0: the ceiling)")
    group.add_argument("--warm-chunk-rows", type=int, default=0, metavar="LANES",
                        help="EngineConfig.warm_chunk_rows: at start-up an eager step of LANES decode lanes beside a "
                        "chunk of each rows bucket (0: off)")
    group.add_argument("--max-prefill-slowdown", type=float, default=0.0,
                        help="EngineConfig.max_prefill_slowdown: contended chunks grow until a long prompt runs at "
                             "least 1/x its solo speed (0: off)")
    group.add_argument("--plan-padding", choices=["on", "off"], default="on",
                        help="EngineConfig.plan_padding: plan chunks as the engine pads them (off: exact counts)")
    group.add_argument("--row-quantum", default="auto", type=row_quantum_arg,
                        help="EngineConfig.row_quantum: contended steps fill their last row tile (1: off)")


def _add_kernel_constant_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kernel module constants, for A/Bs (default: the module's own)")
    group.add_argument(
        "--single-pass-tokens", type=int, default=None,
        help="paged_attention.SINGLE_PASS_TOKENS: decode histories read by one thread block a kv head (A/B)",
    )
    group.add_argument(
        "--single-pass-warps", type=int, default=None,
        help="paged_attention.SINGLE_PASS_WARPS: warps of a one-pass decode attention block (A/B; 16 sits at the "
        "register limit of a block)",
    )
    group.add_argument(
        "--one-pass-blocks", type=int, default=None,
        help="paged_attention.ONE_PASS_BLOCKS: (lane, kv head) blocks from which histories up to 4,096 tokens take "
        "one pass (A/B; a huge value splits every history over SINGLE_PASS_TOKENS)",
    )
    group.add_argument(
        "--attention-mma", choices=("on", "off"), default=None,
        help="paged_attention.MMA: the tensor-core decode-attention kernel where it fits (A/B)",
    )
    group.add_argument(
        "--paged-rows-first", choices=("on", "off"), default=None,
        help="ragged.PAGED_ROWS_FIRST: the paged chunk attention reads and writes the step's rows in place (A/B)",
    )
    group.add_argument(
        "--paged-head-rows", type=_head_rows, default=None, metavar="SHORT,LONG",
        help="engine_setup.CUDA_PAGED_HEAD_ROWS and CUDA_PAGED_LONG_HEAD_ROWS: the most head rows (chunk rows x "
        "query heads) the paged chunk-attention kernel takes, and over tables of >= 8k tokens (SHORT 0: no limit; "
        "for an A/B of the limits)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in (_add_run_arguments, _add_variant_arguments, _add_path_arguments, _add_planning_arguments,
                _add_kernel_constant_arguments):
        add(parser)
    args = parser.parse_args(argv)
    if args.contended_only and args.step_target_ms is None:
        parser.error("--contended-only needs --step-target-ms (the full run's target for the shape)")
    return args


def set_kernel_constants(args: argparse.Namespace) -> None:
    """The A/B flags of module constants: set before any engine is built, so every trace sees them."""
    if args.single_pass_tokens is not None:
        paged_attention.SINGLE_PASS_TOKENS = args.single_pass_tokens
    if args.single_pass_warps is not None:
        paged_attention.SINGLE_PASS_WARPS = args.single_pass_warps
    if args.one_pass_blocks is not None:
        paged_attention.ONE_PASS_BLOCKS = args.one_pass_blocks
    if args.attention_mma is not None:
        paged_attention.MMA = args.attention_mma == "on"
    if args.paged_rows_first is not None:
        ragged.PAGED_ROWS_FIRST = args.paged_rows_first == "on"
    if args.paged_head_rows is not None:
        engine_setup.CUDA_PAGED_HEAD_ROWS, engine_setup.CUDA_PAGED_LONG_HEAD_ROWS = args.paged_head_rows


def run_meta(args: argparse.Namespace) -> dict:
    """What the JSON and the table carry about the run: the command that repeats it, the date, the machine."""
    settings = mlx_settings(os.environ)
    return {
        "command": "".join(f"{k}={v} " for k, v in settings.items())
        + "python -m benchmarks.gpu.run_gpu_bench "
        + " ".join(filter(None, (_argument(k, v) for k, v in vars(args).items()))),
        "mlx_settings": settings,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": mx.device_info().get("device_name", platform.processor()),
        "mlx": mx.__version__,
        "label": args.label,
    }


def shape_params(name: str, args: argparse.Namespace) -> BenchParams:
    plan = TINY if name.startswith("tiny") else (QUICK if args.quick else FULL)
    if args.decode_prompt:
        plan = replace(plan, decode_prompt=args.decode_prompt)
    if args.streams:
        plan = replace(plan, stream_counts=tuple(int(n) for n in args.streams.split(",")))
    return plan


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    set_kernel_constants(args)
    meta = run_meta(args)
    header = f"{meta['date']}, {meta['machine']}, MLX {meta['mlx']}, {args.label} `{meta['command']}`"
    results: list[dict] = []
    note = Progress(results, args, header, meta)
    for name in args.shapes.split(","):
        results.append({"shape": name, "weight_bytes": 0, "step_target_ms": 0})
        try:
            bench_shape(name, shape_params(name, args), args, results[-1], note)
        except Exception as exc:  # one shape failing must not lose the others' numbers
            traceback.print_exc()
            results[-1]["error"] = repr(exc)
        gc.collect()
        mx.clear_cache()
        write(results, args.out, header, meta)
        if not (args.decode_only or args.contended_only):
            print(markdown(results[-1:], header), flush=True)


if __name__ == "__main__":
    main()
