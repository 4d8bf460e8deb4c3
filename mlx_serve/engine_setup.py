"""How the engine's parts are chosen from its configuration, and what a request must satisfy to be taken."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from mlx_serve.adapter_specs import check_specs
from mlx_serve.config import AUTO_STEP_FACTOR, EngineConfig
from mlx_serve.errors import ContextLengthExceeded, InvalidRequest
from mlx_serve.types import GenerationRequest
from scheduler import SchedulerConfig

if TYPE_CHECKING:  # the module stays importable without MLX
    from mlx_serve.grouped_experts import TileMatmul
    from mlx_serve.quantized_rows import QuantizedGemv, QuantizedTiles
    from mlx_serve.runner import ModelRunner

def step_target(value: float | str, factor: float = AUTO_STEP_FACTOR) -> tuple[float, float]:
    """(fixed target in ms, factor over the measured decode step; 0: fixed) for `EngineConfig.step_target_ms` and
    its `step_target_factor` (used with auto)."""
    if value == "auto":
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise InvalidRequest(f"step_target_factor must be a number > 0, not {factor!r}", param="step_target_factor")
        return 500.0, float(factor)  # the seed's value holds until a decode step has been measured
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidRequest(f"step_target_ms must be a number of milliseconds > 0 or 'auto', not {value!r}",
                             param="step_target_ms")  # fmt: skip
    return float(value), 0.0


KV_BITS = (2, 3, 4, 5, 6, 8)  # what `mx.quantize` packs
KV_GROUP_SIZES = (32, 64, 128)
SWITCHES = ("compile_decode", "fuse_decode", "fuse_mixed", "compile_mixed", "dense_experts", "expert_tiles",
            "quantized_tiles", "quantized_gemv")  # fmt: skip


def check_settings(c: EngineConfig) -> None:
    """Every setting that needs no model, checked before one is loaded (a real checkpoint takes seconds to
    minutes): InvalidRequest naming it. Those that depend on the model or on each other (fuse_decode on a family
    without the fused forward, split_quantized_k all without fuse_mixed) are checked as the engine resolves them."""
    for name in SWITCHES:
        _check_switch(getattr(c, name), name)
    if c.split_quantized_k not in ("auto", "on", "off", "all"):
        split_quantized_k(c.split_quantized_k, True)  # raises its error
    chunk_attention(c.chunk_attention)
    dequantize_rows(c.dequantize_rows)
    _check_count(c.trace_neighbour_shapes, "trace_neighbour_shapes")
    _check_count(c.slack_guard_rows, "slack_guard_rows")
    _check_count(c.untrained_rows, "untrained_rows")
    _check_count(c.speculative_tokens, "speculative_tokens")
    _check_count(c.draft_kv_tokens, "draft_kv_tokens")
    if c.window_kv_tokens is not None:
        _check_count(c.window_kv_tokens, "window_kv_tokens")
    check_specs(c.adapters)
    if not (isinstance(c.adapter_memory_gb, (int, float)) and c.adapter_memory_gb >= 0):
        raise InvalidRequest(f"adapter_memory_gb must be a number >= 0, not {c.adapter_memory_gb!r}",
                             param="adapter_memory_gb")  # fmt: skip
    if c.chat_template is not None:
        from mlx_serve.model_loading import chat_template_text

        chat_template_text(c.chat_template)
    if c.kv_bits is not None and c.kv_bits not in KV_BITS:
        raise InvalidRequest(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, not {c.kv_bits!r}",
                             param="kv_bits")  # fmt: skip
    if c.kv_group_size not in KV_GROUP_SIZES:
        raise InvalidRequest(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, not "
                             f"{c.kv_group_size!r}", param="kv_group_size")  # fmt: skip
    if c.kv_bits is not None and c.ane_lane != "off":  # the Core ML lane hands float KV over
        raise InvalidRequest("--kv-bits cannot run with --ane-lane: the ANE lane's KV is not quantized", param="kv_bits")
    if c.adapter_path is not None and c.ane_lane == "ane":  # the Core ML package is built from the base weights
        raise InvalidRequest("--adapter-path cannot run with --ane-lane ane: the Core ML package has no adapter",
                             param="adapter_path")  # fmt: skip
    if c.row_quantum != "auto":
        row_quantum(c.row_quantum, False)
    try:
        scheduler_config(c, num_blocks=1, context_length=1)  # the scheduler's own checks (row floor <= ceiling...)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _check_count(value: int, name: str) -> None:
    """A whole number >= 0, or a clear 400 naming the setting."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"{name} must be a whole number >= 0, not {value!r}", param=name)


def _check_switch(kind: str, name: str) -> None:
    """An auto/on/off setting, or a clear 400 naming it."""
    if kind not in ("auto", "on", "off"):
        raise InvalidRequest(f"{name} must be auto, on or off, not {kind!r}", param=name)


def row_quantum(value: int | str, quantized: bool) -> int:
    """The scheduler's `row_quantum` for `EngineConfig.row_quantum`. auto: with MLX's CUDA backend and quantized
    projections, the quantized GEMM's 64-row tile (8 decode lanes + 64 prefill rows run two tiles, as 8 + 120
    do: H200, 8B 4-bit, 25 against 32 ms a step, contended 16k TTFT 3.35x -> 2.35x solo at the same target), else 1
    (off: cuBLAS showed no cliff at 136 rows on the H200, RESULTS eighth run)."""
    if value == "auto":
        from mlx_serve.kernels.paged_attention import cuda_available
        from mlx_serve.quantized_rows import QMM_ROW_TILE

        return QMM_ROW_TILE if quantized and cuda_available() else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"row_quantum must be a whole number >= 1 or 'auto', not {value!r}", param="row_quantum")
    return value


# `floor_slack="auto"`: what a contended step may take over the floor step's prediction. Where the row-tile fill is
# checked against that limit (`checked_fill` on, a row tile on: quantized models on CUDA) the limit is a bound on
# every step, so it may be set where the step should be: H200, 8B 4-bit beside 8 streams, 1.75 ran 512-row chunks
# in 4 of 4 runs (16k TTFT 1.31-1.38x solo, gap ratio 1.71-2.75), where 1.5 ran 256-384-row ones (TTFT 1.49-1.76x)
# and, unchecked, 384- or 768-row ones (TTFT 1.22-1.61x, gap ratio 1.55-5.46; RESULTS, twenty-eighth to thirtieth
# runs). 2.0 since the fiftieth run: at plan headroom 0.9 (a 1.94x bound at 1.75) the H100 held 384-row chunks
# (TTFT 1.56-1.67x, 0 of 4 met) where 2.0 ran 512-row ones (TTFT 1.35-1.53x, 4 of 5; gap ratio 1.54-2.23); a replay
# of the H200 runs above at 2.0 chooses 512 rows, not 768. 1.5 elsewhere (bf16 shapes, where the floor step rarely
# fills the target; every run since the twenty-first)
CHECKED_FLOOR_SLACK = 2.0
FLOOR_SLACK = 1.5


def floor_slack(value: float | str, quantum: int, checked_fill: str) -> float:
    """The scheduler's `floor_slack` for `EngineConfig.floor_slack`: a number >= 1, or auto (`CHECKED_FLOOR_SLACK`
    where a row-tile fill of `quantum` > 1 rows is checked against the step's limit, else `FLOOR_SLACK`)."""
    if value == "auto":
        return CHECKED_FLOOR_SLACK if quantum > 1 and checked_fill == "on" else FLOOR_SLACK
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 1:
        raise InvalidRequest(f"floor_slack must be a number >= 1 or 'auto', not {value!r}", param="floor_slack")
    return float(value)


def scheduler_config(
    c: EngineConfig, num_blocks: int, context_length: int, quantum: int = 1, kv_bucket: int = 0,
    pads_history: bool = True, window_tokens: int = 0, window_blocks: int = 0, recurrent_state: bool = False,
    state_snapshots: int = 0,
) -> SchedulerConfig:
    """`quantum`: the resolved `row_quantum` (it depends on the loaded model); `kv_bucket` and `pads_history`: the
    runner's (whether its chunk attention computes over the padded history); `window_tokens` and `window_blocks`: the
    pool's window space (the widest window, its blocks; 0: none)."""
    target_ms, factor = step_target(c.step_target_ms, c.step_target_factor)
    floor = c.step_target_floor_ms
    if isinstance(floor, bool) or not isinstance(floor, int | float) or not floor >= 0:
        raise InvalidRequest(f"step_target_floor_ms must be a number >= 0, not {floor!r}", param="step_target_floor_ms")
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=c.block_size,
        max_running=c.max_running,
        queue_limit=c.queue_limit + c.max_running,  # the engine refuses first, synchronously, in submit()
        max_model_len=context_length,
        step_target_ms=target_ms,
        step_target_factor=factor,
        step_target_floor_ms=float(floor),
        row_ceiling=c.row_ceiling,
        row_floor=c.row_floor,
        row_quantum=quantum,
        kv_bucket=kv_bucket,
        pads_history=pads_history,
        budget_midpoints=c.budget_midpoints,
        price_first_runs=c.price_first_runs,
        fill_stand_ins=c.fill_stand_ins,
        price_stand_in_runs=c.price_stand_in_runs,
        checked_fill=c.checked_fill,
        plan_headroom=c.plan_headroom,
        floor_slack=floor_slack(c.floor_slack, quantum, c.checked_fill),
        slack_guard_rows=c.slack_guard_rows,
        untrained_rows=c.untrained_rows,
        max_prefill_slowdown=c.max_prefill_slowdown,
        cost_model=c.cost_model,
        cost_trust_factor=c.cost_trust_factor,
        cost_residual_weight=c.cost_residual_weight,
        speculative_ngram=c.speculative_ngram,
        max_overtakes=c.max_overtakes,
        decode_debt=c.decode_debt,
        debt_tolerance=c.debt_tolerance,
        enable_prefix_cache=c.enable_prefix_cache,
        shared_prefill_tokens=c.shared_prefill_tokens,
        ane_lane=c.ane_lane != "off",
        window_tokens=window_tokens if window_blocks else 0,
        window_blocks=window_blocks,
        recurrent_state=recurrent_state,
        state_snapshots=state_snapshots,
    )


def decode_attention(kind: str) -> Any:
    """The attention function for single-row lanes; None means the runner's exact reference path."""
    if kind == "reference":
        return None
    from mlx_serve.kernels.paged_attention import select_decode_attention

    return select_decode_attention(kind)


def compile_decode(kind: str) -> bool:
    """Whether single-row steps run compiled. "auto": on with MLX's CUDA backend, where host time is the
    decode step's bottleneck; off on the CPU backend, where the first call of each shape compiles C++."""
    _check_switch(kind, "compile_decode")
    if kind == "auto":
        import mlx.core as mx

        return mx.cuda.is_available() and mx.default_device().type == mx.gpu
    return kind == "on"


def fuse_decode(kind: str, model: Any, compiled: bool, quantized_kv: bool = False) -> bool:
    """Whether compiled single-row steps take the fused forward (`mlx_serve.fused_decode`). "auto": with MLX's
    CUDA backend, for the families it knows and KV in the model's dtype; "on" refuses what it cannot take, with the
    reason."""
    _check_switch(kind, "fuse_decode")
    if kind == "off":
        return False
    from mlx_serve.fused_decode import unsupported_reason

    reason = "its KV is quantized (--kv-bits)" if quantized_kv else unsupported_reason(model)
    if kind == "on":
        if not compiled:
            raise InvalidRequest("fuse_decode on needs compiled decode steps (compile_decode)", param="fuse_decode")
        if reason is not None:
            raise InvalidRequest(f"fuse_decode on: this model cannot take the fused forward: {reason}",
                                 param="fuse_decode")  # fmt: skip
        return True
    return compiled and reason is None and compile_decode("auto")


def fuse_mixed(kind: str, fused: bool) -> bool:
    """Whether steps with prefill chunks take the fused forward too (`FusedDecode.mixed`): fewer ops a layer to
    build and launch, the fixed cost that bounds a contended chunk on CUDA. auto = on with MLX's CUDA backend and
    the fused decode forward (H200, 8B, 8 streams + a 16k prompt: TTFT 3.93 -> 3.10x solo in one run)."""
    _check_switch(kind, "fuse_mixed")
    if kind == "on" and not fused:
        raise InvalidRequest("fuse_mixed on needs the fused decode forward (fuse_decode)", param="fuse_mixed")
    if kind == "auto":
        from mlx_serve.kernels.paged_attention import cuda_available

        return fused and cuda_available()
    return kind == "on"


def compile_mixed(kind: str, fused_mixed: bool) -> bool:
    """Whether a step of decode lanes and one prefill chunk replays an `mx.compile`d trace of the fused forward per
    bucketed shape (`CompiledMixed`). auto = on with MLX's CUDA backend and the fused forward: where the eager step
    is bound by the host, its chunks grow (H200, 8 streams beside a 16k prompt, same call: 0.6B 1,024-row steps in
    11-18 ms where eager 512-row ones took 13-17, TTFT 2.04x -> 1.32x solo; 8B 4-bit 768 rows in 29-33 ms where
    eager 192 rows took 26, 2.53x -> 1.73x traced at first use); on 8B it is neutral. New shapes trace when the
    engine is quiet (`EngineConfig.defer_mixed_traces`): traced at first use they cost a stream a 25-50 ms gap, and
    until traced they run eager (RESULTS, nineteenth run: 0.6B 1.17-2.93x, 8B 4-bit 1.73-2.21x across runs)."""
    _check_switch(kind, "compile_mixed")
    if kind == "on" and not fused_mixed:
        raise InvalidRequest("compile_mixed on needs fuse_mixed", param="compile_mixed")
    if kind == "auto":
        from mlx_serve.kernels.paged_attention import cuda_available

        return fused_mixed and cuda_available()
    return fused_mixed and kind == "on"


def dense_experts(kind: str) -> bool:
    """Whether steps with enough rows compute every expert of an MoE block densely (`mlx_serve.dense_experts`):
    auto = on with MLX's CUDA backend, where gather_mm reads experts far below bandwidth (measured on the H200)."""
    _check_switch(kind, "dense_experts")
    if kind == "auto":
        from mlx_serve.kernels.paged_attention import cuda_available

        return cuda_available()
    return kind == "on"


def expert_tiles(kind: str) -> TileMatmul | None:
    """How MoE steps of `dense_experts.TILES_FROM_ROWS` rows or more multiply their experts, if through expert tiles
    (`grouped_experts`): auto = the CUDA kernel with MLX's CUDA backend (H200, 30B-A3B: see `bench_moe`), else
    none; on = the kernel on CUDA, gather_mm over the tiles elsewhere (the reference, for tests); off = none."""
    _check_switch(kind, "expert_tiles")
    from mlx_serve.kernels.paged_attention import cuda_available

    if kind == "off" or (kind == "auto" and not cuda_available()):
        return None
    if cuda_available():
        from mlx_serve.kernels.expert_tiles import expert_tiles_matmul

        return expert_tiles_matmul
    from mlx_serve.grouped_experts import gather_tiles

    return gather_tiles


def quantized_tiles(kind: str) -> QuantizedTiles | None:
    """How quantized projections of `quantized_rows.TILES_FROM_ROWS` rows or more multiply: auto = the
    `quantized_tiles` kernel with MLX's CUDA backend (4-bit, bf16; MLX's quantized GEMM runs such steps at a fifth
    of the bf16 GEMM's speed on the H200), else MLX's quantized matmul; on = the kernel on CUDA, its reference
    (dequantize, then matmul) elsewhere, for tests; off = MLX's quantized matmul."""
    _check_switch(kind, "quantized_tiles")
    from mlx_serve.kernels.paged_attention import cuda_available

    if kind == "off" or (kind == "auto" and not cuda_available()):
        return None
    from mlx_serve.quantized_rows import REFERENCE_TILES, QuantizedTiles

    if cuda_available():
        from mlx_serve.kernels import quantized_tiles as kernel

        return QuantizedTiles(kernel.many_rows_matmul, kernel.fits)
    return REFERENCE_TILES


def quantized_gemv(kind: str) -> QuantizedGemv | None:
    """How 4-bit projections of at most 8 rows (decode steps) multiply: auto = the `quantized_gemv` kernel with
    MLX's CUDA backend (MLX's quantized matrix-vector product reads the weights at ~17% of the H200's bandwidth, once
    per row), else MLX's quantized matmul; on = the kernel on CUDA, its reference (dequantize, then matmul)
    elsewhere, for tests; off = MLX's quantized matmul."""
    _check_switch(kind, "quantized_gemv")
    from mlx_serve.kernels.paged_attention import cuda_available

    if kind == "off" or (kind == "auto" and not cuda_available()):
        return None
    from mlx_serve.quantized_rows import REFERENCE_GEMV, QuantizedGemv

    if cuda_available():
        from mlx_serve.kernels import quantized_gemv as kernel

        return QuantizedGemv(kernel.quantized_gemv, kernel.MOST_ROWS, kernel.fits)
    return REFERENCE_GEMV


def split_quantized_k(kind: str, fused_mixed: bool) -> str:
    """Which quantized projections run as batched products over K slices (`quantized_rows.split_k`): "off",
    "standalone" (o_proj and down_proj: "on"; MLX's CUDA quantized GEMM fills a quarter of the H200's SMs on a
    4096-wide projection: 8B 4-bit down projection of 8 rows, one layer after another, 0.210 -> 0.082 ms in 8
    slices) or "all" (the fused q/k/v and gate/up too; needs fuse_mixed: 8B 4-bit decode 886 / 2,293 / 3,716 ->
    1,114 / 2,842 / 4,209 tok/s at 8 / 32 / 64 streams). auto: all with MLX's CUDA backend and the fused forward
    for mixed steps, standalone with CUDA otherwise. Each slice's product rounds to the activation dtype."""
    if kind == "all":
        if not fused_mixed:
            raise InvalidRequest("split_quantized_k all needs fuse_mixed", param="split_quantized_k")
        return "all"
    if kind not in ("auto", "on", "off"):
        raise InvalidRequest(f"split_quantized_k must be auto, on, off or all, not {kind!r}", param="split_quantized_k")
    if kind == "auto":
        from mlx_serve.kernels.paged_attention import cuda_available

        return ("all" if fused_mixed else "standalone") if cuda_available() else "off"
    return "standalone" if kind == "on" else "off"


# H200 (bench_chunk_attention, the gathered history + the faster of cuDNN and matmuls against the kernel's default
# build, ms a layer at 4k / 16k): the kernel won to 384 score rows (0.6B 192 rows 0.135 / 0.211 against 0.157 /
# 0.378), was even at 768 (8B 192 rows 0.178 / 0.416 against 0.166 / 0.446) and lost from 1,024 (0.6B 512 rows
# 0.192 / 0.484 against 0.166 / 0.449), with the gathered history padded less than the engine pads it. With splits
# for whole waves (8B, ms a layer at 4k / 8k / 16k): 192 rows 0.149 / 0.224 / 0.337 against 0.157 / 0.254 / 0.438;
# 256 rows 0.166 / 0.249 / 0.394 against 0.158 / 0.252 / 0.450 (0.6B 512 rows alike); 384 rows lost everywhere.
# With two row tiles a warp (twenty-sixth run, 4k / 16k): 8B 256 rows 0.140 / 0.304 against 0.156 / 0.446, 768
# rows 0.272 / 0.762 against 0.317 / 1.040, 384 rows 0.191 / 0.448 against 0.152 / 0.450; 0.6B 768 rows 0.174 /
# 0.437 against 0.151 / 0.454, 1,024 rows (2,048 score rows) 0.192 / 0.526 against 0.166 / 0.511
# (score rows above: rows x query heads a kv head.) The limits count head rows, rows x all query heads: 8,192 and
# 24,576 are 1,024 and 3,072 score rows for 8B and 0.6B (8 kv heads), and let 30B-A3B (4 kv heads of 8 query heads)
# chunks of 256 / 768 rows too: contended 16k TTFT 1.37-1.43x solo against 1.49-1.52x (H200, fifty-fifth run)
# The long limit starts at 8k tables: under them 768 rows on the kernel would save under 1% of a 16k prompt's read
# (even at 3-4k, losing at 1-2k; H100, fifty-sixth run)
CUDA_PAGED_HEAD_ROWS = 8192
CUDA_PAGED_LONG_HEAD_ROWS, CUDA_PAGED_LONG_HISTORY = 24576, 8192


def chunk_attention(kind: str) -> Any:
    """How prefill chunks attend (`ragged.ChunkAttention`): "sdpa" (MLX's fused attention, cuDNN on CUDA), "matmul"
    (`MatmulChunkAttention`: chunks of up to 128 query rows as two matmuls and a softmax, every output tile a
    thread block), "paged" (`PagedChunkAttention`: one kernel reading the paged pool, `kernels.chunk_attention`; its
    MLX-ops reference off CUDA) or "auto": paged on CUDA, the fused attention elsewhere."""
    from mlx_serve.kernels import chunk_attention as paged
    from mlx_serve.kernels.paged_attention import cuda_available
    from mlx_serve.ragged import (
        CUDA_CHUNK_ATTENTION,
        MatmulChunkAttention,
        PagedChunkAttention,
        sdpa_chunk_attention,
    )

    if kind == "paged" or (kind == "auto" and cuda_available()):
        if cuda_available():
            return PagedChunkAttention(
                paged.paged_chunk_attention, paged.supports, CUDA_CHUNK_ATTENTION, CUDA_PAGED_HEAD_ROWS,
                CUDA_PAGED_LONG_HEAD_ROWS, CUDA_PAGED_LONG_HISTORY,
            )  # fmt: skip
        return PagedChunkAttention(paged.reference_chunk_attention, _any_chunk)
    if kind in ("auto", "sdpa"):
        return sdpa_chunk_attention
    if kind == "matmul":
        return MatmulChunkAttention()
    raise InvalidRequest(
        f"chunk_attention must be auto, sdpa, matmul or paged, not {kind!r}", param="chunk_attention"
    )


def _any_chunk(q: Any, pool_keys: Any, block_size: int) -> bool:
    return True  # the reference takes every dtype and head size


def dequantize_rows(rows: int) -> int:
    """Rows from which quantized projections of decode steps and logits run dense (`DequantizedRows`); 0: never."""
    _check_count(rows, "dequantize_rows")
    return rows


def prefill_gather(pool: Any) -> Any:
    """How long prefill lanes read their history on this backend (None: the pool's slot gather, which is also the
    one for quantized KV)."""
    from mlx_serve.kernels.paged_gather import select_prefill_gather

    layout = pool.layout
    if layout.quantized or layout.any_values_differ or len(layout.recurrent) == layout.num_layers:
        return None  # the gather kernel reads keys and values of one size, in the model's dtype (or: no attention)
    return select_prefill_gather(pool.keys[pool.layout.first_attention_layer])


def prefill_lane(config: EngineConfig, model: Any, trace: Any) -> Any:
    """The ANE lane for `--ane-lane`: None when off; the CPU stand-in; or Core ML (macOS) over a built package."""
    if config.ane_lane == "off":
        return None
    from mlx_serve.ane.lane import make_lane

    clock = trace.now if trace.enabled else time.perf_counter
    if config.ane_lane == "cpu":
        return make_lane("cpu", model, clock=clock)
    if config.ane_lane != "ane":
        raise InvalidRequest(f"--ane-lane must be off, cpu or ane, not {config.ane_lane!r}", param="ane_lane")
    if config.ane_package is None:
        raise InvalidRequest(
            "--ane-lane ane needs a Core ML package: build one with `python -m mlx_serve ane build --model DIR "
            "--out PKG` and pass --ane-package PKG",
            param="ane_package",
        )
    return make_lane("coreml", model, package=config.ane_package, clock=clock)


def model_runner(config: EngineConfig, loaded: Any, pool: Any, trace: Any, states: Any) -> ModelRunner:
    """The engine's ModelRunner over `pool`, each fast path resolved from its setting, the model and the backend."""
    from mlx_serve.runner import ModelRunner

    compiled = compile_decode(config.compile_decode)
    return ModelRunner(
        loaded.model,
        pool,
        decode_attention(config.decode_attention),
        prefill_lane=prefill_lane(config, loaded.model, trace),
        lane_timeout_s=config.ane_timeout_s,
        compile_decode=compiled,
        prefill_gather=prefill_gather(pool),
        fuse_decode=(fused := fuse_decode(config.fuse_decode, loaded.model, compiled, loaded.layout.quantized)),
        fuse_mixed=(mixed := fuse_mixed(config.fuse_mixed, fused)),
        split_k=split_quantized_k(config.split_quantized_k, mixed),
        compile_mixed=compile_mixed(config.compile_mixed, mixed),
        defer_mixed_traces=config.defer_mixed_traces,
        neighbour_traces=config.trace_neighbour_shapes,
        run_idle_traces=config.run_idle_traces,
        stand_in_traces=config.stand_in_traces,
        time_idle_traces=config.time_idle_traces,
        dense_moe=dense_experts(config.dense_experts),
        expert_tiles=expert_tiles(config.expert_tiles),
        dequantize_rows=dequantize_rows(config.dequantize_rows),
        quantized_tiles=quantized_tiles(config.quantized_tiles),
        quantized_gemv=quantized_gemv(config.quantized_gemv),
        chunk_attention=chunk_attention(config.chunk_attention),
        kv_bucket=0 if loaded.layout.latent else None,  # latent attention reads exact histories
        adapters=loaded.adapters,
        states=states,
    )


def validate_request(request: GenerationRequest, vocab_size: int, context_length: int, kv_capacity: int) -> None:
    """Refuse, with the field to blame, what could never run: before it is queued, so the caller gets a 4xx."""
    n = len(request.prompt_ids)
    if n == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be a positive integer, got {request.max_tokens!r}", param="max_tokens")
    bad = [t for t in request.prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids outside the vocabulary: {bad[:5]}", param="prompt")
    request.sampling.validate(vocab_size)
    if request.pooling not in (None, "last", "mean"):
        raise InvalidRequest(f"pooling must be last or mean, not {request.pooling!r}", param="pooling")
    total = n + (1 if request.pooling else request.max_tokens)
    if total > context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{total} tokens ({n} in the prompt, {request.max_tokens} for the completion). "
            "Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens" if n < context_length else "messages",
        )
    if total > kv_capacity:
        raise ContextLengthExceeded(
            f"the request needs up to {total} tokens of KV cache but the pool holds "
            f"{kv_capacity} (raise --memory-budget-gb or lower max_tokens)",
            param="max_tokens",
        )


DRAFT_TOKENS = 3  # mlx-lm's server drafts this many a step


def speculative_tokens(c: EngineConfig) -> int:
    """Tokens a request may draft a step: as configured, or mlx-lm's 3 where a draft model is given alone."""
    return c.speculative_tokens or (DRAFT_TOKENS if c.draft_model else 0)


def memory_limits(c: EngineConfig, loaded: Any, pool_bytes: int) -> Any:
    """MLX's allocator held to `memory_budget_gb` where one is given, its buffer cache bounded where not
    (`mlx_serve.memory_limits`)."""
    from mlx_serve.memory_limits import apply_limits
    from mlx_serve.model_loading import GIB, kept_bytes

    held = loaded.weight_bytes + pool_bytes + kept_bytes(c, loaded)
    return apply_limits(None if c.memory_budget_gb is None else int(c.memory_budget_gb * GIB), held)
