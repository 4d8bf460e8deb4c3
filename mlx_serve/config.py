"""Engine configuration: one slotted dataclass, mapped one to one onto `serve` flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_serve.adapter_specs import AdapterSpec

# `step_target_ms="auto"`: a contended step may take 3 decode steps (scheduler/step_target.py). 4 until the chunk
# kernel's two row tiles (twenty-sixth run): at 3, 8B's 16k TTFT under 8 streams went from 1.57x solo to 1.32x and
# 8B 4-bit's to 1.45x, and 30B-A3B, whose decode step is long, keeps its gaps near 3x the median (3.0-3.1, 4.2 at 4)
AUTO_STEP_FACTOR = 3.0
# the auto target's least value, binding only where 3 decode steps are shorter (0.6B on an H100: 3.6 ms steps; its
# contended gap ratio met 3 in 0 of 9 runs at 15 ms, in 7 of 12 at 11 ms, both targets in 6; RESULTS forty-fourth run)
AUTO_STEP_FLOOR_MS = 11.0


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # local dir or hub id; None = the built-in tiny dummy model
    adapter_path: str | None = None  # an mlx_lm.lora adapter applied to the model itself (as mlx_lm.load does)
    adapters: tuple[AdapterSpec, ...] = ()  # LoRA adapters requests choose by name (`GenerationRequest.adapter`)
    adapter_memory_gb: float = 0.0  # kept from the KV pool for adapters loaded while serving (`load_adapter`)
    chat_template: str | None = None  # a Jinja chat template (or a file of one) in place of the checkpoint's
    memory_budget_gb: float | None = None  # weights + KV pool; None = a share of the machine's memory
    kv_blocks: int | None = None  # exact pool size in blocks (overrides the budget; tests use it)
    # tokens of the window space, where sliding-window layers keep only the blocks their windows reach (the rest of the
    # budget goes to the full layers); None: auto (`model_loading.window_space_blocks`), 0: off (kept whole)
    window_kv_tokens: int | None = None
    # a model with recurrent layers: snapshots of a request's state kept at block boundaries, where its prefix hits may
    # end (`scheduler/state_snapshots.py`); None: max_running of them, 0: none (no prefix hits for such a model)
    state_snapshots: int | None = None
    # KV stored quantized to this many bits (mlx-lm's --kv-bits: its QuantizedKVCache), `kv_group_size` values sharing a
    # scale and a bias; None: the model's dtype
    kv_bits: int | None = None
    kv_group_size: int = 64
    block_size: int = 16
    max_running: int = 64
    queue_limit: int = 1024
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    step_target_ms: float | str = 500.0  # or "auto": step_target_factor measured decode-only steps (engine_setup)
    step_target_factor: float = AUTO_STEP_FACTOR  # with auto: decode steps a contended step may take
    step_target_floor_ms: float = AUTO_STEP_FLOOR_MS  # with auto: the least target (a tiny model's step is noise)
    row_ceiling: int = 2048  # most rows one step carries (SCHEDULER.md)
    row_floor: int = 64  # fewest prefill rows a contended step is cut to
    untrained_rows: int = 0  # most prefill rows of a contended step the cost model cannot price yet; 0: the ceiling
    row_quantum: int | str = "auto"  # contended steps fill their last row tile of this many rows; auto: engine_setup
    budget_midpoints: bool = True  # a halved budget grows by half again where still predicted within the target
    price_first_runs: bool = False  # a never-run shape that would overrun gives way to a smaller run one (SchedulerConfig)
    # "off" | "untraced" | "on": a row-tile fill past the budget's query bucket (SchedulerConfig); it only acts
    # where a row tile is on (`row_quantum` > 1: quantized models on CUDA)
    checked_fill: str = "on"
    plan_headroom: float = 0.9  # contended steps are planned to this fraction of the step target
    # a contended step may take this x the floor step's time where that exceeds the target; auto: engine_setup
    floor_slack: float | str = "auto"
    slack_guard_rows: int = 512  # ... only where this many rows do not fit the target, to their price (SchedulerConfig)
    max_prefill_slowdown: float = 0.0  # contended chunks grow until a long prompt runs >= 1/x its solo speed; 0: off
    plan_padding: bool = True  # budgets and the affine cost model see chunks padded as the runner pads them (CUDA)
    cost_model: str = "ema"
    cost_trust_factor: float = 1.5  # affine: steps past this many times the largest recent one priced by its cost per row
    cost_residual_weight: float = 0.3  # affine: a price corrected by its rows bucket's recent misses, this weight; 0: off
    max_overtakes: int = 4
    enable_prefix_cache: bool = True
    # a waiting request waits for a running prefill computing this many of its next prompt tokens; 0: off
    shared_prefill_tokens: int = 256
    decode_debt: bool = True
    debt_tolerance: float = 1.25  # a stream is in decode debt only past this x what its step may take
    # speculative decoding by prompt lookup: a request's decode lane also verifies up to this many tokens that
    # followed an earlier occurrence of its last `speculative_ngram` tokens (0: off)
    speculative_tokens: int = 0
    speculative_ngram: int = 3
    # a small model of the same vocabulary drafts instead (mlx-lm's --draft-model; speculative_tokens 0: 3 a step),
    # its caches holding at most draft_kv_tokens tokens together (kept from the KV pool's memory)
    draft_model: str | None = None
    draft_kv_tokens: int = 16384
    pipeline: bool = True  # keep a sampling step in flight while the next one is planned and queued
    decode_attention: str = "auto"  # "auto" | "reference" | "batched" | "kernel": attention of single-row lanes
    compile_decode: str = "auto"  # "auto" (on with MLX's CUDA backend) | "on" | "off": mx.compile single-row steps
    warm_up: bool = True  # build the prefill attention shapes before serving (CUDA: cuDNN graphs, seconds)
    # with warm_up: one eager step of this many decode lanes beside a chunk of each rows bucket, before serving (0: off;
    # ModelRunner.warm_chunk_rows): a rows bucket's first eager step pays one-off work (GEMM kernels' first loads)
    warm_chunk_rows: int = 0
    fuse_decode: str = "auto"  # "auto" (on when compiled on CUDA and the family is known) | "on" | "off"
    fuse_mixed: str = "auto"  # "auto" (on with CUDA) | "on" | "off": steps with prefill take the fused forward too
    compile_mixed: str = "auto"  # "auto" (on with CUDA) | "on" | "off": decode lanes + one chunk replay a compiled trace
    defer_mixed_traces: bool = True  # a compiled mixed shape runs eager until the engine, idle, has traced it
    # deferred: each shape traced idle also runs once there, over the pool's scratch block, so that its first real
    # step pays no first-run work (H200, 0.6B: a long prompt's first chunk beside 8 streams 29.9 -> 13.7-16.0 ms)
    run_idle_traces: bool = True
    trace_neighbour_shapes: int = 0  # deferred: at most this many shapes next to met ones traced ahead, when idle
    # deferred: a step whose shape has no trace replays a traced one of its lanes with at least its rows and history
    # bucket, padded, where that ran no longer than eager steps take to build or than the step was planned to take
    # (CompiledMixed.stand_in). H200, 0.6B beside 8 streams: a long prompt's 16-272-row tails ran in 15-18 ms, where
    # their eager builds held the streams 20-33 ms
    stand_in_traces: bool = True
    # with run_idle_traces: each such shape runs a second time there, timed (host wall time), so that it may stand in
    # before a real step of its own shape has run. H100, a 16k prompt beside 8 streams: TTFT / solo 1.18-1.40 on
    # against 1.28-1.70 off in five of five pairs (0.6B and 8B), gaps held (fifty-third run)
    time_idle_traces: bool = True
    price_stand_ins: bool = False  # budgets price a step a stand-in would replay as compiled (`TracedMixedShapes`)
    fill_stand_ins: bool = True  # a step that would stand in grows to the rows its stand-in carries (SchedulerConfig)
    price_stand_in_runs: bool = True  # a step that would stand in is priced at its stand-in's last run (SchedulerConfig)
    expert_tiles: str = "auto"  # "auto" (the CUDA kernel with CUDA) | "on" | "off": MoE steps of many rows in expert tiles
    dense_experts: str = "auto"  # "auto" (on with CUDA) | "on" | "off": MoE steps of enough rows use every expert
    split_quantized_k: str = "auto"  # "auto" (all with CUDA) | "on" | "off" | "all": quantized projections over K slices
    chunk_attention: str = "auto"  # "auto" | "sdpa" | "matmul" | "paged": how prefill chunks attend (`ragged.ChunkAttention`)
    quantized_gemv: str = "auto"  # "auto" (the CUDA kernel with CUDA) | "on" | "off": 4-bit products of <= 8 rows
    quantized_tiles: str = "auto"  # "auto" (the CUDA kernel with CUDA) | "on" | "off": 4-bit steps of many rows
    dequantize_rows: int = 0  # quantized projections of steps with this many rows as dense matmuls (0: never)
    ane_lane: str = "off"  # "off" | "cpu" (labelled MLX CPU stand-in) | "ane" (Core ML, macOS only)
    ane_package: str | None = None  # the `ane build` package that "ane" runs
    ane_timeout_s: float = 30.0  # a chunk slower than this reruns on the GPU
    trace: Any = None  # a tracing sink; None = the null sink
    observer: Any = None  # metrics hooks (see mlx_serve.engine.EngineObserver)
    progress: bool = False  # show a progress bar while the model loads
