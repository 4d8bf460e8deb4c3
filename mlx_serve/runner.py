"""The model runner: the only code that turns a `StepPlan` into MLX work.

`execute(plan)` lays the plan's lanes out as `[T, 1]` rows, runs mlx-lm's model once over them with one
`RaggedLayerCache` per layer, computes logits only for the rows that sample, samples each with its request's
own parameters, and reports the tokens and the step's wall time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_serve import ane_chunks, dense_experts, ragged
from mlx_serve.adapters import AdapterSet
from mlx_serve.compiled_mixed import CompiledMixed, MixedShape, TracedMixedShapes, compilable
from mlx_serve.compiled_step import CompiledDecode, lane_bucket, padded_tables
from mlx_serve.embeddings import PooledRows, Pooler, QueuedEmbedding
from mlx_serve.fused_decode import FusedDecode, split_fused_projections, viewed_projections
from mlx_serve.grouped_experts import TileMatmul
from mlx_serve.kernels.paged_attention import cuda_available
from mlx_serve.kernels.step_clock import CONTINUITY_S, GpuStepClock, StepClock, step_interval_ms
from mlx_serve.kv_pool import KVPool, slot_array
from mlx_serve.model_head import family_head, plain_head
from mlx_serve.prompt_scores import PromptScorer, QueuedScores, ScoredRows, score_arrays
from mlx_serve.quantized_rows import (
    DequantizedRows,
    QuantizedGemv,
    QuantizedTiles,
    fold_quantized_rows,
    split_standalone_projections,
)
from mlx_serve.ragged import (
    ChunkAttention,
    DecodeAttention,
    DecodeRows,
    LaneRows,
    PagedChunkAttention,
    PrefillGather,
    RaggedLayerCache,
    StepLayout,
    install_ragged_attention,
    reference_decode_attention,
    sdpa_chunk_attention,
)
from mlx_serve.recurrent import LayerCaches, RecurrentLayerCache, StatePool
from mlx_serve.rope_guard import install_rope_guard
from mlx_serve.sampling import RequestSampler, SampledRows, draft_verdict, sample_rows, top_logprobs
from mlx_serve.types import PromptLogprob, SamplingParams, TokenLogprob
from scheduler import Lane, LaneKind, StepOutcome, StepPlan
from scheduler.buckets import KV_BUCKET, history_bucket, query_bucket, query_buckets
from scheduler.plan import PENDING_TOKEN

log = logging.getLogger("mlx_serve.runner")

# MLX's CUDA quantized matmul runs a matrix-vector kernel per row below 8 rows (a packed read per row: 0.068 / 0.121
# ms for 2 / 4 rows of a 4096x12288 4-bit product on the H200) and one GEMM from 8 (0.036 ms): quantized decode steps
# of 2-7 lanes are padded to 8
QUANTIZED_MIN_LANES = 8
EAGER_SHAPES_MOST = 4096  # eager step shapes remembered as met (`_first_eager_shape`); past it every shape counts as met
# prompt rows of the continuations traced before serving (`warm_continuation_traces`): chat turns of up to 128 tokens
CONTINUATION_ROWS = (64, 128)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[TokenLogprob, ...] | None


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    outcome: StepOutcome
    samples: dict[str, SampledToken]
    phase_ms: dict[str, float] = field(default_factory=dict)  # preparation, submission, consumption
    lane_spans: list = field(default_factory=list)  # ANE chunk spans (host submit-to-ready intervals)
    # request id -> (the prompt position of its first entry, its prompt log-probabilities from this step)
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # request id -> its pooled prompt
    # request id -> the drafts the model agreed with, as committed tokens (log-probabilities where asked for)
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    one_off: str = ""  # why the step trains no cost model (`ModelRunner._one_off`; "": it does)


@dataclass(frozen=True, slots=True)
class DraftCheck:
    """The drafted rows' verdict, queued with the step: the model's greedy token at each, and (where a drafting
    request asked for log-probabilities) each row's log-probabilities."""

    kept: mx.array  # [D] whether each draft is kept (`sampling.draft_verdict`)
    tokens: mx.array  # [D] the token that replaces each draft where it is not
    logprobs: mx.array | None  # [D, V]


@dataclass(frozen=True, slots=True)
class InFlightStep:
    """A step queued on the device whose tokens have not been read back yet."""

    plan: StepPlan
    sample_ids: tuple[str, ...]
    samplers: list[RequestSampler]
    sampled: Any  # SampledRows, or None for a prefill-only step
    row_of: dict[str, int]  # request id -> its row in `sampled.tokens`
    started: float
    phases: dict[str, float]
    ane: tuple = ()  # ane_chunks.AneChunk submitted with this step
    stamp: mx.array | None = None  # the device clock's reading after the step (None: timed on the host)
    # why its time teaches the scheduler nothing about the next step of its shape (`ModelRunner._one_off`: it traced
    # a compiled shape, stood in, ...; ""): a step run eager while its shape's trace is deferred is an ordinary step
    one_off: str = ""
    compiled: bool = False  # it replays a compiled trace (the scheduler's cost model prices the two forms apart)
    timed_shape: MixedShape | None = None  # an ordinary run of this compiled mixed shape: its time goes to `stand_in`
    scores: tuple[QueuedScores, ...] = ()  # prompt log-probabilities its rows computed
    verify: DraftCheck | None = None  # the model's greedy token at each drafted row (speculative decoding)
    drafted: tuple[tuple[str, tuple[int, ...]], ...] = ()  # each drafted lane's request id and drafts, in row order
    embeddings: tuple[QueuedEmbedding, ...] = ()  # embedding requests' vectors its rows finished
    first_run: bool = False  # its shape ran for the first time in its form (`OneOff.first_run`)


@dataclass(frozen=True, slots=True)
class _PreparedStep:
    inputs: mx.array  # [T, 1]
    layout: StepLayout
    sample_rows: mx.array  # [S] row index of each sampling lane's last row
    sample_ids: tuple[str, ...]  # request id of each sampling row
    scored: tuple[ScoredRows, ...] = ()  # rows whose prompt log-probabilities were asked for
    adapter_rows: mx.array | None = None  # [T] each row's adapter slot; None: no row has an adapter
    verify_rows: mx.array | None = None  # rows whose next token checks a draft (speculative decoding)
    pooled: tuple[PooledRows, ...] = ()  # rows an embedding request pools
    drafted: tuple[tuple[str, tuple[int, ...]], ...] = ()  # each drafted lane's request id and drafts


class OneOff(NamedTuple):
    """Why a step's time teaches the scheduler nothing about its shape ("": it does, `ModelRunner._one_off`), and
    whether its shape ran for the first time in its form (a build rode along: what `price_first_runs` learns)."""

    reason: str = ""
    first_run: bool = False


def stand_in_reason(trace: MixedShape) -> str:
    """A stand-in step's `one_off`: the trace it replayed, by rows and history bucket."""
    return f"stand-in {trace[2]}x{trace[3]}"


class ModelRunner:
    def __init__(
        self,
        model: Any,
        pool: KVPool,
        decode_attention: DecodeAttention | None = None,
        kv_bucket: int | None = None,
        prefill_lane: Any = None,
        lane_timeout_s: float = 30.0,
        compile_decode: bool = False,
        prefill_gather: PrefillGather | None = None,
        fuse_decode: bool = False,
        dense_moe: bool = False,
        expert_tiles: TileMatmul | None = None,
        dequantize_rows: int = 0,
        quantized_tiles: QuantizedTiles | None = None,
        quantized_gemv: QuantizedGemv | None = None,
        fuse_mixed: bool = False,
        compile_mixed: bool = False,
        defer_mixed_traces: bool = False,
        neighbour_traces: int = 0,
        run_idle_traces: bool = False,
        stand_in_traces: bool = False,
        time_idle_traces: bool = False,
        split_k: str = "off",
        chunk_attention: ChunkAttention | None = None,
        clock: StepClock | None | str = "auto",
        adapters: AdapterSet | None = None,
        states: StatePool | None = None,
    ) -> None:
        self.model = model
        self.states = states  # each running request's recurrent layers' state (`mlx_serve.recurrent`), if any
        self.adapters = adapters  # LoRA adapters chosen per request (`mlx_serve.adapters`)
        self._adapter_of: dict[str, int] = {}  # request id -> its adapter's slot, for requests with one
        self._speculating: set[str] = set()  # requests whose decode lanes carry drafts: read back every step
        self.pool = pool
        self.decode_attention = decode_attention or reference_decode_attention
        # only the reference reads each decode lane's slots; the paged paths read the block tables
        self._decode_lane_slots = self.decode_attention is reference_decode_attention
        self._no_slots = mx.zeros((0,), dtype=mx.int32)
        # prefill lanes pad their KV to a `history_bucket` of this unit (0: exact): on CUDA, MLX builds a cuDNN
        # attention graph for every new (rows, history) shape, tens of ms each, so a growing history must repeat shapes
        self.kv_bucket = (KV_BUCKET if mx.cuda.is_available() else 0) if kv_bucket is None else kv_bucket
        self.eager_shapes: set[tuple] = set()  # padded shapes of eager steps with prefill met so far
        # how bucketed prefill lanes read their history: a kernel through the block table (CUDA), else slots
        self.prefill_gather = prefill_gather
        self.chunk_attention = chunk_attention or sdpa_chunk_attention  # how prefill lanes attend
        self.prefill_lane = prefill_lane  # the ANE lane (or its CPU stand-in); None when off
        self.lane_timeout_s = lane_timeout_s
        self.samplers: dict[str, RequestSampler] = {}
        self.scorer = PromptScorer()  # requests that asked for their prompt's log-probabilities
        self.pooler = Pooler()  # embedding requests
        # steps are timed on the device where it has a clock (see kernels/step_clock.py), else on the host
        self.clock = (GpuStepClock() if cuda_available() else None) if clock == "auto" else clock
        self._last_done = 0.0  # host time the last step was read back
        self._last_end_ns: int | None = None  # the device clock at the last step's end
        # how many there are sets the scheduler's row tile
        self.quantized_projections = self._patch_model(dequantize_rows, quantized_tiles, quantized_gemv, dense_moe,
                                                       expert_tiles)
        self._tied = bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))
        # other families' heads scale, cap or always tie: their own forward's tail runs over the hidden states
        self._family_head = None if plain_head(model) else family_head(model)
        # a tied output projection of this many rows runs dense too (the quantized linears were folded above)
        self.dequantize = DequantizedRows(dequantize_rows)
        trace_policy = {"defer_traces": defer_mixed_traces, "neighbour_traces": neighbour_traces,
                        "run_traces": run_idle_traces, "stand_ins": stand_in_traces, "time_traces": time_idle_traces}
        self._build_compiled_steps(compile_decode, fuse_decode, fuse_mixed, compile_mixed, split_k, trace_policy)

    def _patch_model(self, dequantize_rows: int, quantized_tiles: QuantizedTiles | None,
                     quantized_gemv: QuantizedGemv | None, dense_moe: bool, expert_tiles: TileMatmul | None) -> int:
        """The model's modules swapped in place for the engine's forms; returns the quantized projections folded."""
        model, layout = self.model, self.pool.layout
        install_ragged_attention(model, any(layout.attends(layer) for layer in range(layout.num_layers)))
        install_rope_guard()  # the ragged rows as RoPE's batch: MLX's CUDA launch needs it split past 127 rows
        folded = fold_quantized_rows(model, dequantize_rows, quantized_tiles, quantized_gemv)
        if dense_moe or expert_tiles is not None:  # MoE blocks pick their form by the step's rows
            dense_experts.install(model, dense=dense_moe, tiles=expert_tiles)
        return folded

    def _build_compiled_steps(self, compile_decode: bool, fuse_decode: bool, fuse_mixed: bool, compile_mixed: bool,
                              split_k: str, trace_policy: dict[str, Any]) -> None:
        """The fused forward and the compiled decode and mixed steps, where the settings and the attention allow;
        `trace_policy`: CompiledMixed's keyword arguments for when it traces and replays shapes."""
        model, pool = self.model, self.pool
        # single-row steps replay one compiled graph; the reference attention reads per-lane slot lists instead
        use_compiled = compile_decode and not self._decode_lane_slots
        fused = FusedDecode(model, self.decode_attention) if use_compiled and fuse_decode else None
        # quantized projections as batched products over K slices (`quantized_rows.split_k`): "standalone" ones
        # (o_proj, down_proj), or "all" (the fused q/k/v and gate/up too: every step then takes the fused forward)
        if split_k in ("standalone", "all"):
            split_standalone_projections(model, viewed_projections(fused.layers) if fused is not None else set())
        if split_k == "all":
            if fused is None or not fuse_mixed:
                raise ValueError("splitting the fused projections needs the fused forward for every step")
            split_fused_projections(fused.layers)
        quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
        # kept with the GEMV (whose cost is flat from 1 to 8 rows): the shapes compiled steps meet stay the ones
        # measured before it; contended-only H200 runs with 4-lane shapes stalled ~2 s on their first steps
        min_lanes = QUANTIZED_MIN_LANES if quantized and cuda_available() else 1
        self.compiled = (
            CompiledDecode(model, pool, self.decode_attention, self._logits, fused, min_lanes) if use_compiled else None
        )
        self.fused_mixed = fused if fuse_mixed else None  # steps with prefill through the fused forward too
        # a decode batch with one prefill chunk replays a compiled trace per shape (where the history is bucketed)
        self.compiled_mixed = (
            CompiledMixed(pool, fused, self.decode_attention, self._logits, min_lanes, self.chunk_attention,
                          **trace_policy)
            if compile_mixed and self.fused_mixed is not None
            else None
        )

    def warm_prefill_attention(self, max_len: int, max_rows: int) -> int:
        """Build the attention graph of every bucketed prefill shape up to `max_len` history and `max_rows` rows.

        On CUDA, MLX builds a cuDNN graph the first time it meets an attention shape (tens of ms, on the engine
        thread's own cache): done here, before requests arrive, no contended step stalls the streams for it.
        Returns the number of shapes."""
        if not self.kv_bucket:
            return 0
        layout = self.pool.layout
        heads = self.model.args.num_attention_heads
        shapes = 0
        for rows in query_buckets(max_rows):
            for padded in (h for h in self._history_buckets(max_len) if h >= rows):
                q = mx.zeros((1, heads, rows, layout.head_dim), layout.dtype)
                kv = mx.zeros((1, layout.num_kv_heads, padded, layout.head_dim), layout.dtype)
                mask = mx.zeros((rows, padded), layout.dtype)[None, None]  # the layout `_bucketed_lane` makes
                mx.eval(mx.fast.scaled_dot_product_attention(q, kv, kv, scale=layout.head_dim**-0.5, mask=mask))
                shapes += 1
        return shapes

    def warm_paged_chunk_attention(self) -> int:
        """Run the paged chunk-attention kernel once in each form a step may launch (one pass or history splits,
        ordered after in-place KV writes or not, alone or led by decode rows' `head`) on a small zero pool. On CUDA
        each form compiles at first use (a contended-only 0.6B run's streams stalled 4.1 s on it): paid here.
        Returns the number of calls."""
        attention = self.chunk_attention
        if not isinstance(attention, PagedChunkAttention) or not self.kv_bucket or self.prefill_gather is None:
            return 0
        layout, size = self.pool.layout, self.pool.block_size
        heads = self.model.args.num_attention_heads
        # as steps lay it: the kernel builds apart by layout
        q_shape = (1, heads, layout.head_dim) if ragged.PAGED_ROWS_FIRST else (1, heads, 1, layout.head_dim)
        q = mx.zeros(q_shape, layout.dtype)
        keys = mx.zeros((KV_BUCKET, layout.num_kv_heads, layout.head_dim), layout.dtype)
        if not attention.supports(q, keys, size):
            return 0
        calls = 0
        for tokens in (size, KV_BUCKET):  # one block runs one pass; a 1,024-token history splits for one row
            table, length = mx.arange(tokens // size, dtype=mx.int32), mx.array([tokens, tokens], dtype=mx.int32)
            lane = LaneRows(0, 1, self._no_slots, None, table, length, tokens, 1, mx.zeros((1,), dtype=mx.int32))
            for ordered in (attention, attention.ordered_after(q)):
                for head in (None, q) if ragged.PAGED_ROWS_FIRST else (None,):
                    mx.eval(ordered.paged(q, keys, keys, lane, layout.head_dim**-0.5, size, head))
                    calls += 1
        return calls

    def warm_chunk_rows(self, max_rows: int, lanes: int) -> int:
        """Run one eager step of `lanes` decode lanes beside a chunk of each query bucket up to `max_rows` rows, every
        lane over the pool's scratch block. On the H100 (0.6B beside 8 streams, 151 logged first eager runs) a step
        whose rows bucket had never run ran 5.4 ms over its price (median, up to 17.4), against 1.7 once the bucket
        had run at any lane count or history. Returns the number of steps (0 where chunks are not bucketed)."""
        if not self.kv_bucket or lanes < 0 or self.pool.window_blocks or self.states is not None:
            return 0  # unbucketed chunks never repeat a shape; windowed and recurrent steps need their own tables
        size, scratch = self.pool.block_size, self.pool.scratch_block
        decode = [Lane("warm-up", LaneKind.DECODE, (0,), 0, (scratch,), False) for _ in range(lanes)]
        buckets = query_buckets(max_rows)
        for rows in buckets:
            chunk = Lane("warm-up", LaneKind.PREFILL, (0,) * rows, 0, (scratch,) * -(-rows // size), False)
            hidden = self._forward(self._prepare([*decode, chunk], None))
            mx.eval(self._logits(hidden[: lanes + 1]), self.pool.state())  # the LM head over as many rows as samples
        return len(buckets)

    def _history_buckets(self, max_len: int) -> list[int]:
        """Every padded history a prefill lane up to `max_len` tokens long meets."""
        return sorted({history_bucket(end, self.kv_bucket) for end in range(1, max_len + 1, self.kv_bucket)})

    def warm_continuation_traces(self, max_len: int, rows: Sequence[int] = CONTINUATION_ROWS) -> int:
        """Trace the compiled shapes of a short prompt alone over a cached history (a chat's next turn, a request
        that shares a long prefix) at every history bucket up to `max_len`, on zero inputs (nothing evaluated).

        Deferred, such a shape ran eager the first time a continuation met it: on the H200 a 32-row Qwen3-0.6B
        continuation of a cached 8k prefix took 17 ms, 12.6 of them building the eager graph, against a cold TTFT of
        107 (twentieth run). Returns the number of shapes traced."""
        mixed = self.compiled_mixed
        if not self._mixed_on or not mixed.defer_traces:
            return 0
        for padded in self._history_buckets(max_len):
            for count in (bucket for bucket in map(query_bucket, rows) if bucket <= padded):
                mixed.want((0, 1, count, padded), self.prefill_gather, self.kv_bucket)
        traced = 0
        # not run on the scratch block (`run_idle_traces` runs only the shapes traced while serving): running them at
        # start-up did not move a continuation's TTFT on the H200 (twenty-third run) and costs start-up time
        while mixed.deferred and mixed.trace_deferred(run=False):
            traced += 1
        return traced

    def warm_quantized_products(self, max_rows: int) -> int:
        """Run every distinct quantized projection of the step (the fused ones too) once at each power-of-two row
        count up to `max_rows`. On CUDA, MLX compiles a quantized matmul variant the first time a row range meets
        it, tens of seconds each on the H200 (the seventh run's first 16k 4-bit prefill took ~70 s, a cold 8k
        prompt 40 s): paid here, before serving, not by a request. Returns the number of products run."""
        fused = self.compiled.fused if self.compiled is not None else None
        # with every step through the fused forward, the block's own q/k/v and gate/up (views of it) never run
        unused = viewed_projections(fused.layers) if fused is not None and self.fused_mixed is not None else set()
        modules = [
            m for _, m in self.model.named_modules() if isinstance(m, nn.QuantizedLinear) and id(m) not in unused
        ]
        for layer in fused.layers if fused is not None else ():
            modules.extend(m for m in (layer.qkv, layer.gate_up) if isinstance(m, nn.QuantizedLinear))
        shapes = {}
        for module in modules:
            key = (module.weight.shape, module.scales.dtype, module.group_size, module.bits, module.mode)
            shapes.setdefault(key, module)
        products = 0
        for module in shapes.values():
            width = module.scales.shape[-1] * module.group_size * getattr(module, "k_splits", 1)
            rows = 1
            while rows <= max_rows:
                mx.eval(module(mx.zeros((rows, 1, width), dtype=module.scales.dtype)))  # the step's [T, 1] rows
                products, rows = products + 1, rows * 2
        return products

    def warm_moe_blocks(self, max_rows: int) -> int:
        """Run one MoE block whose forms `dense_experts.install` chose once at a row count of each form and tile
        size up to `max_rows`: on CUDA the expert-tiles and tile-layout kernels compile at first use (seconds on
        the H200: a contended 30B-A3B run's first long prompt stalled the streams 4.4 s), paid here, not by a
        request. Returns the number of block calls."""
        blocks = [getattr(layer, "mlp", None) for layer in getattr(self.model.model, "layers", [])]
        blocks = [b for b in blocks if getattr(type(b), "forms_installed", False)]
        if not blocks:
            return 0
        block = blocks[0]  # the kernels are the same for every layer (same shapes)
        rows = sorted({r for r in dense_experts.warm_up_rows() if r <= max_rows})
        for count in rows:
            mx.eval(block(mx.zeros((count, block.gate.weight.shape[-1]), dtype=block.gate.weight.dtype)))
        return len(rows)

    # request lifecycle -------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, params: SamplingParams, constraint: Any = None, prompt_ids: Sequence[int] = (),
        adapter: int = 0, speculate: bool = False, pooling: str | None = None, stop_ids: Iterable[int] = (),
    ) -> None:
        """`constraint`: a `grammar.Constraint` the request's every token must satisfy (None: free text);
        `prompt_ids`: the prompt whose tokens `params.prompt_logprobs` scores; `adapter`: its adapter's slot;
        `stop_ids`: the tokens that end it (held back for `params.min_tokens`)."""
        self.samplers[request_id] = RequestSampler.create(params, constraint, stop_ids)
        if adapter:
            self._adapter_of[request_id] = adapter
        if speculate:
            self._speculating.add(request_id)
        if pooling is not None:
            self.pooler.add(request_id, len(prompt_ids), pooling)
        if params.prompt_logprobs is not None:
            self.scorer.add(request_id, prompt_ids, params.prompt_logprobs)

    def can_stay_in_flight(self, step: InFlightStep) -> bool:
        """Whether the engine may queue the next step before reading this one back: it samples (its tokens prove
        its KV writes done), has no ANE chunk (collected on the host) and no lane whose next mask needs its token."""
        return (step.sampled is not None and not step.ane and not self.constrained(step.plan)
                and not any(lane.request_id in self._speculating for lane in step.plan.lanes))  # fmt: skip

    def constrained(self, plan: StepPlan) -> bool:
        """Whether a lane of the step samples under a grammar (its next mask needs this token on the host)."""
        return any(
            (sampler := self.samplers.get(lane.request_id)) is not None and sampler.constraint is not None
            for lane in plan.lanes
        )

    def release_one(self, request_id: str) -> None:
        """Forget a finished request's sampling state (a preempted one keeps it: its seed chain goes on)."""
        self.samplers.pop(request_id, None)
        self.scorer.discard(request_id)
        self._adapter_of.pop(request_id, None)
        self._speculating.discard(request_id)
        self.pooler.discard(request_id)
        if self.states is not None:
            self.states.release(request_id)

    # the step ----------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run one step and wait for it."""
        return self.collect(self.submit(plan))

    def submit(self, plan: StepPlan, previous: InFlightStep | None = None) -> InFlightStep:
        """Queue the step's work on the device and return at once.

        Decode lanes whose input is `PENDING_TOKEN` read it from `previous`'s sampled tokens on the device, so
        this step can be queued while the previous one still runs (one step in flight).
        """
        t0 = time.perf_counter()
        if self.states is not None:  # a preempted request starts again from position 0, with a slot taken then
            for request_id in plan.released_request_ids:
                self.states.release(request_id)
        gpu_lanes, ane_lanes = ane_chunks.split_lanes(plan.lanes, self.prefill_lane)
        # compiled steps give the last row's logits only: rows that score or pool a prompt run eager (the scheduler
        # keeps them off the ANE lane: `Request.gpu_only`); so do drafted rows (every one's logits are read), and
        # prefill beside rows of an adapter (the mixed traces and the fused forward are the base model's)
        scoring = self.scorer.wants(gpu_lanes) or self.pooler.wants(gpu_lanes)
        drafted = any(lane.drafts for lane in gpu_lanes)
        adapted = any(lane.request_id in self._adapter_of for lane in gpu_lanes)
        eager_only = scoring or drafted
        chunks = ane_chunks.submit(self.prefill_lane, ane_lanes, self.pool) if ane_lanes else []
        compiled = (self.compiled is not None and bool(gpu_lanes) and all(lane.rows == 1 for lane in gpu_lanes)
                    and not eager_only)  # fmt: skip
        mixable = not compiled and self._mixed_on and compilable(gpu_lanes) and not (eager_only or adapted)
        mixed_shape = self._mixed_ready(gpu_lanes, plan.limit_ms) if mixable else None
        mixed = mixed_shape is not None
        prepared = None if compiled or mixed else self._prepare(gpu_lanes, previous)
        traced = self._traced_shapes()
        t1 = time.perf_counter()
        scores: list[QueuedScores] = []
        verify, embeddings = None, []
        if compiled:
            sample_ids, sampled = self._submit_compiled(gpu_lanes, previous)
        elif mixed:
            sample_ids, sampled = self._submit_compiled_mixed(gpu_lanes, previous, mixed_shape)
        else:
            sampled, scores, verify, embeddings = self._submit_eager(prepared, previous)
            sample_ids = prepared.sample_ids
        stamp = self._stamp(sampled) if gpu_lanes else None
        t2 = time.perf_counter()
        phases = {"preparation": (t1 - t0) * 1e3, "submission": (t2 - t1) * 1e3}
        rows = {rid: i for i, rid in enumerate(sample_ids)}
        samplers = [self.samplers[rid] for rid in sample_ids]
        one_off = self._one_off(scoring or drafted, traced, mixed_shape, compiled or mixed, gpu_lanes)
        if mixable and not mixed:
            self.compiled_mixed.record_eager_build(self._mixed_shape(gpu_lanes), phases["submission"])
        # a stand-in replays its trace as an ordinary run would (pad rows, the padded history): its time is the
        # trace's, so the next stand-in is priced at it (H100: one fast 68.9 ms run priced eight replays of 73-81 ms)
        timed = mixed_shape if mixed and one_off.reason in ("", stand_in_reason(mixed_shape)) else None
        return InFlightStep(
            plan, sample_ids, samplers, sampled, rows, t0, phases, tuple(chunks), stamp, one_off.reason,
            compiled or mixed, timed, tuple(scores), verify, prepared.drafted if prepared is not None else (),
            tuple(embeddings), first_run=one_off.first_run,
        )

    def _one_off(self, scored: bool, traced_before: int, mixed: MixedShape | None, replayed: bool,
                 lanes: Sequence[Lane]) -> OneOff:  # fmt: skip
        """Why the step's time teaches the scheduler nothing about its shape ("": it does). A scoring or drafted step
        also runs the LM head over those rows ("scored"); a trace built in the step ("traced"); a compiled shape's
        first run ("first-run"); a stand-in, whose time is the padded trace's, not the planned shape's ("stand-in
        ROWSxHISTORY", the trace's rows and history bucket); a padded eager shape's first run ("first-eager")."""
        if scored:
            return OneOff("scored")
        if self._traced_shapes() != traced_before:
            return OneOff("traced", first_run=True)
        if mixed is not None and (self.compiled_mixed.first_run or self.compiled_mixed.stood_in):
            first = "first-run" if self.compiled_mixed.first_run else ""
            stand_in = stand_in_reason(mixed) if self.compiled_mixed.stood_in else ""
            return OneOff(" ".join(part for part in (first, stand_in) if part), self.compiled_mixed.first_run)
        if not replayed and self._first_eager_shape(lanes):
            return OneOff("first-eager", first_run=True)
        return OneOff()

    def _mixed_ready(self, lanes: list[Lane], limit_ms: float | None) -> MixedShape | None:
        """The compiled shape the step replays (its own or a stand-in within `limit_ms`), or None: it runs eager."""
        decode, chunk = self._decode_and_chunk(lanes)
        return self.compiled_mixed.ready(decode, chunk, self.kv_bucket, self.prefill_gather, limit_ms)

    def _mixed_shape(self, lanes: list[Lane]) -> MixedShape:
        """The step's own compiled shape."""
        decode, chunk = self._decode_and_chunk(lanes)
        return self.compiled_mixed.shape(decode, chunk, self.kv_bucket)

    @staticmethod
    def _decode_and_chunk(lanes: list[Lane]) -> tuple[list[Lane], Lane]:
        """A compilable step's decode lanes and its one prefill chunk."""
        return [lane for lane in lanes if lane.rows == 1], next(lane for lane in lanes if lane.rows > 1)

    def _first_eager_shape(self, lanes: Sequence[Lane]) -> bool:
        """Whether an eager step with prefill meets its padded shape for the first time (CUDA): its time holds
        one-off builds (cuDNN graphs, NVRTC kernels: 1.3-2.5 s on the H200's first 4-lane 4-bit steps) that an
        unbounded cost fit learned as the cost of rows, so it does not train the scheduler."""
        if not self.kv_bucket or all(lane.rows == 1 for lane in lanes):
            return False
        decode = sum(lane.rows == 1 for lane in lanes)
        chunks = tuple(
            (query_bucket(lane.rows), history_bucket(lane.end, self.kv_bucket)) for lane in lanes if lane.rows > 1
        )
        shape = (lane_bucket(decode) if decode else 0, chunks)
        if shape in self.eager_shapes or len(self.eager_shapes) >= EAGER_SHAPES_MOST:
            return False
        self.eager_shapes.add(shape)
        return True

    def _traced_shapes(self) -> int:
        """How many shapes the compiled forwards have traced (a step that adds one paid for its trace)."""
        return sum(len(c.shapes) for c in (self.compiled, self.compiled_mixed) if c is not None)

    def compiled_shapes(self) -> dict[str, int]:
        """Shapes with a compiled trace (decode steps, mixed steps) and mixed shapes met but not traced yet."""
        mixed = self.compiled_mixed
        return {
            "decode": len(self.compiled.shapes) if self.compiled is not None else 0,
            "mixed": len(mixed.shapes) if mixed is not None else 0,
            "mixed_waiting": mixed.deferred if mixed is not None else 0,
            "stand_ins": mixed.stand_ins_run if mixed is not None else 0,
        }

    @property
    def _mixed_on(self) -> bool:
        """Whether steps of decode lanes and one chunk can replay compiled traces here (bucketed, table-gathered)."""
        return self.compiled_mixed is not None and bool(self.kv_bucket) and self.prefill_gather is not None

    def traced_shapes(self, price_stand_ins: bool = False) -> TracedMixedShapes | None:
        """What the scheduler asks about compiled steps (None: no prefill step runs compiled here); with
        `price_stand_ins` a step a larger trace would stand in for counts as compiled."""
        if not self._mixed_on:
            return None
        return TracedMixedShapes(self.compiled_mixed, self.kv_bucket, self.prefill_gather, price_stand_ins)

    def trace_deferred(self) -> bool:
        """Trace one compiled shape a step met and ran eager (for when the engine has nothing to run)."""
        return self.compiled_mixed is not None and self.compiled_mixed.trace_deferred()

    def _stamp(self, sampled: SampledRows | None) -> mx.array | None:
        """The device clock after the step's last output: its tokens, else the last layer's KV writes."""
        if self.clock is None:
            return None
        return self.clock.stamp(sampled.tokens if sampled is not None else self.pool.state()[-1])

    def _submit_eager(
        self, prepared: _PreparedStep, previous: InFlightStep | None
    ) -> tuple[SampledRows | None, list[QueuedScores], DraftCheck | None, list[QueuedEmbedding]]:
        """The step's sampled rows (None: none sample), the prompt scores its rows compute, the model's greedy
        token at each drafted row and the embeddings its rows finish."""
        if not prepared.layout.decode and not prepared.layout.lanes:  # every lane of the step is on the ANE lane
            return None, [], None, []
        writes = self.pool.functional_writes
        hidden = self._forward(prepared)
        # recurrent states are always written through MLX's scatter
        functional = self.pool.functional_writes != writes or self.states is not None
        scores = self.scorer.queue(hidden, prepared.scored, self._logits) if prepared.scored else []
        embeddings, pooled = self.pooler.queue(hidden, prepared.pooled) if prepared.pooled else ([], [])
        verify = None
        # prefill only: only the KV writes are needed (MLX skips the unused last MLP)
        logits = self._logits(hidden[prepared.sample_rows]) if prepared.sample_ids else None
        if prepared.verify_rows is not None:  # one LM head over the drafted rows and the sampled ones (one weight read)
            both = self._logits(hidden[mx.concatenate([prepared.verify_rows, prepared.sample_rows])])
            drafted = prepared.verify_rows.size
            rows, logits = both[:drafted], both[drafted:]
            verify = self._draft_check(rows - mx.logsumexp(rows, axis=-1, keepdims=True), prepared.drafted)
        extra = list(pooled)
        if verify is not None:
            extra += [verify.kept, verify.tokens] + ([verify.logprobs] if verify.logprobs is not None else [])
        wait_for = previous if functional else None
        return self._queue(logits, prepared.sample_ids, scores, extra, wait_for), scores, verify, embeddings

    def _draft_check(self, logprobs: mx.array, drafted: Sequence[tuple[str, tuple[int, ...]]]) -> DraftCheck:
        """Each drafted lane's verdict on its rows (drafting requests draw from raw logits: no processors), and the
        rows' log-probabilities where a drafting request asked for them (as `sample_rows` gives them)."""
        kept, tokens, offset = [], [], 0
        for request_id, drafts in drafted:
            rows = logprobs[offset : offset + len(drafts)]
            lane_kept, lane_tokens = draft_verdict(self.samplers[request_id], rows, mx.array(drafts, dtype=mx.int32))
            kept.append(lane_kept)
            tokens.append(lane_tokens.astype(mx.int32))
            offset += len(drafts)
        wanted = any(self.samplers[rid].params.logprobs is not None for rid, _ in drafted)
        return DraftCheck(mx.concatenate(kept), mx.concatenate(tokens), logprobs if wanted else None)

    def _submit_compiled(
        self, lanes: list[Lane], previous: InFlightStep | None
    ) -> tuple[tuple[str, ...], SampledRows | None]:
        tokens = self._input_tokens(lanes, previous)
        self._observe(lanes, tokens, list(range(len(lanes))))
        adapter_slots = [self._adapter_of.get(lane.request_id, 0) for lane in lanes] if self._adapter_of else []
        if any(adapter_slots):
            logits = self.compiled(lanes, tokens, adapter_slots, self.adapters.selection)
        else:
            logits = self.compiled(lanes, tokens)
        sampling = [i for i, lane in enumerate(lanes) if lane.samples]
        sample_ids = tuple(lanes[i].request_id for i in sampling)
        if 0 < len(sampling) < len(lanes):
            logits = logits[mx.array(sampling, dtype=mx.int32)]
        wait_for = None if self.compiled.writes_in_place(any(adapter_slots)) else previous
        return sample_ids, self._queue(logits if sample_ids else None, sample_ids, wait_for=wait_for)

    def _submit_compiled_mixed(
        self, lanes: list[Lane], previous: InFlightStep | None, shape: MixedShape
    ) -> tuple[tuple[str, ...], SampledRows | None]:
        ordered = sorted(lanes, key=lambda lane: lane.rows != 1)  # the decode lanes, then the chunk
        tokens = self._input_tokens(ordered, previous)
        self._observe(ordered, tokens, list(range(len(ordered))))
        logits = self.compiled_mixed(ordered[:-1], ordered[-1], tokens, self.kv_bucket, self.prefill_gather, shape)
        sampling = [i for i, lane in enumerate(ordered) if lane.samples]
        sample_ids = tuple(ordered[i].request_id for i in sampling)
        if 0 < len(sampling) < len(ordered):
            logits = logits[mx.array(sampling, dtype=mx.int32)]
        wait_for = None if self.compiled_mixed.writes_in_place(self.prefill_gather) else previous
        return sample_ids, self._queue(logits if sample_ids else None, sample_ids, wait_for=wait_for)

    def _queue(
        self, logits: mx.array | None, sample_ids: tuple[str, ...], scores: Sequence[QueuedScores] = (),
        extra: Sequence[mx.array] = (), wait_for: InFlightStep | None = None,
    ) -> SampledRows | None:
        """Sample the step's rows (if any) and queue the step on the device with its KV writes (and prompt scores,
        pooled rows and draft checks: `extra`).

        `wait_for`: a step still in flight whose reads hold arrays this one writes through MLX's scatter. MLX writes
        an array in place only where no queued work holds it, else it copies it (a whole pool layer, each step), so
        that step's tokens are waited for first (at once where it is done); the host built this step's graph
        meanwhile. `mx.synchronize()` in its place cost CUDA steps more (H100, thirty-seventh run)."""
        if wait_for is not None and wait_for.sampled is not None:
            mx.eval(wait_for.sampled.tokens)
        outputs = [*score_arrays(scores), *extra]
        if logits is None:
            mx.async_eval(*outputs, self.pool.state())
            return None
        sampled = sample_rows(logits, [self.samplers[rid] for rid in sample_ids])
        mx.async_eval(sampled.tokens, *outputs, self.pool.state())
        return sampled

    def _elapsed_ms(self, step: InFlightStep) -> float:
        """The step's time, now that it is read back (see kernels/step_clock.py)."""
        now = time.perf_counter()
        # on the host, a step queued behind another starts when that one was read back, not when it was queued
        host_ms = (now - max(step.started, self._last_done)) * 1e3
        end_ns = self.clock.read_ns(step.stamp) if step.stamp is not None else None
        continuous = step.started <= self._last_done + CONTINUITY_S
        elapsed_ms = step_interval_ms(host_ms, end_ns, self._last_end_ns, continuous)
        self._last_done, self._last_end_ns = now, end_ns
        return elapsed_ms

    def collect(self, step: InFlightStep) -> RunnerOutput:
        """Wait for a submitted step and read its tokens back."""
        t2 = time.perf_counter()
        try:
            samples = self._read_samples(step.sample_ids, step.samplers, step.sampled)
            accepted = self._accept_drafts(step, samples)
        except Exception:
            self._last_end_ns = None  # the failed step has no end to time the next one from
            raise
        spans = self._collect_ane(step, samples) if step.ane else []
        prompt_logprobs = self.scorer.read(step.scores) if step.scores else {}
        embeddings = self.pooler.read(step.embeddings) if step.embeddings else {}
        if step.sampled is None or step.ane:
            # nothing read back proves the KV writes done. Such a step is never left in flight, so the pool's
            # arrays are still its own; a sampled step's tokens depend on every layer's writes already
            mx.eval(self.pool.state())
        t3 = time.perf_counter()
        elapsed_ms = self._elapsed_ms(step)
        ane_ms = max((span.end - span.start) * 1e3 for span in spans) if spans else None
        if step.timed_shape is not None and math.isfinite(elapsed_ms):
            self.compiled_mixed.record_run(step.timed_shape, elapsed_ms)
        outcome = StepOutcome({rid: s.token_id for rid, s in samples.items()}, elapsed_ms, ane_elapsed_ms=ane_ms,
                              auxiliary=bool(step.one_off), first_run=step.first_run, compiled=step.compiled,
                              accepted_drafts={rid: tuple(s.token_id for s in kept) for rid, kept in accepted.items()})
        return RunnerOutput(outcome, samples, {**step.phases, "consumption": (t3 - t2) * 1e3}, spans, prompt_logprobs,
                            embeddings, accepted, step.one_off)  # fmt: skip

    def _accept_drafts(self, step: InFlightStep, samples: dict[str, SampledToken]) -> dict[str, list[SampledToken]]:
        """Each drafted lane's drafts up to the first the model disagrees with; there the model's own token replaces
        the lane's sample (which, past all drafts, is the token after the last)."""
        if step.verify is None:
            return {}
        picks, verdicts = step.verify.tokens.tolist(), step.verify.kept.tolist()
        accepted, offset = {}, 0
        for request_id, drafts in step.drafted:
            model = picks[offset : offset + len(drafts)]
            kept = verdicts[offset : offset + len(drafts)]
            agreed = next((i for i, keep in enumerate(kept) if not keep), len(drafts))
            top = self.samplers[request_id].params.logprobs if request_id in self.samplers else None
            kept = [self._committed(step.verify, offset + i, draft, top) for i, draft in enumerate(drafts[:agreed])]
            accepted[request_id] = kept
            if agreed < len(drafts):
                samples[request_id] = self._committed(step.verify, offset + agreed, model[agreed], top)
            offset += len(drafts)
        return accepted

    @staticmethod
    def _committed(check: DraftCheck, row: int, token: int, top: int | None) -> SampledToken:
        """A token committed at a drafted row, with its log-probability and top `top` alternatives where asked."""
        if top is None or check.logprobs is None:
            return SampledToken(token, None, None)
        logprobs = check.logprobs[row]
        alternatives = None
        if top:
            ids, values = top_logprobs(logprobs, top)
            alternatives = tuple(TokenLogprob(t, lp) for t, lp in zip(ids.tolist(), values.tolist()))
        return SampledToken(token, logprobs[token].item(), alternatives)

    def _collect_ane(self, step: InFlightStep, samples: dict[str, SampledToken]) -> list:
        """Finish the step's ANE chunks; a chunk the lane failed reruns here on the GPU path."""
        spans = []
        for chunk in step.ane:
            result = ane_chunks.collect(self.prefill_lane, chunk, self.pool, self.lane_timeout_s, step.plan.step_id)
            if result.error is not None:
                log.warning("ANE lane failed on %s (%s): rerunning the chunk on the GPU", chunk.lane.request_id, result.error)
                retry = replace(step.plan, lanes=(ane_chunks.on_gpu(chunk.lane),))
                samples.update(self.collect(self.submit(retry)).samples)
                continue
            spans.append(result.span)
            if result.logits is not None:
                sampler = self.samplers[chunk.lane.request_id]
                sampled = sample_rows(result.logits, [sampler])
                samples.update(self._read_samples((chunk.lane.request_id,), [sampler], sampled))
        return spans

    def _prepare(self, plan_lanes: list[Lane], previous: InFlightStep | None) -> _PreparedStep:
        block_size = self.pool.block_size
        # single-row lanes first: their attention is one batched call (see ragged.DecodeRows)
        ordered = sorted(plan_lanes, key=lambda lane: lane.rows != 1)
        positions: list[int] = []
        write_slots: list[np.ndarray] = []
        lanes: list[LaneRows] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        scored: list[ScoredRows] = []
        adapter_rows: list[int] = []
        verify_rows: list[int] = []
        drafted: list[tuple[str, tuple[int, ...]]] = []
        pooled: list[PooledRows] = []
        row_start = 0
        for lane in ordered:
            if (rows := self.scorer.rows(lane, row_start)) is not None:
                scored.append(rows)
            if (part := self.pooler.rows(lane, row_start)) is not None:
                pooled.append(part)
            positions.extend(range(lane.start, lane.end))
            write_slots.append(slot_array(lane.block_ids, lane.start, lane.end, block_size))
            if lane.rows != 1 and self.kv_bucket:
                lanes.append(self._bucketed_lane(row_start, lane))
            elif lane.rows != 1 or self._decode_lane_slots:
                lanes.append(LaneRows(row_start, lane.rows, mx.array(slot_array(lane.block_ids, 0, lane.end, block_size))))
            else:
                lanes.append(LaneRows(row_start, lane.rows, self._no_slots))
            if lane.samples:
                sample_rows.append(row_start + lane.rows - 1)
                sample_ids.append(lane.request_id)
            if self._adapter_of:  # per row only while some request has an adapter (a 2k-row chunk: 2k entries)
                adapter_rows.extend([self._adapter_of.get(lane.request_id, 0)] * lane.rows)
            if lane.drafts:  # row i's next token checks draft i + 1
                verify_rows.extend(range(row_start, row_start + lane.drafts))
                drafted.append((lane.request_id, lane.token_ids[1:]))
            row_start += lane.rows
        inputs = self._input_tokens(ordered, previous)
        self._observe(ordered, inputs, [rows.row_start for rows in lanes])
        num_single = sum(1 for lane in ordered if lane.rows == 1)
        step_positions = mx.array(positions, dtype=mx.int32)
        decode = self._decode_rows(ordered[:num_single], lanes[:num_single]) if num_single else None
        layout = StepLayout(
            positions=step_positions,
            write_slots=mx.array(np.concatenate(write_slots) if write_slots else np.zeros(0, np.int32)),
            decode=decode,
            lanes=tuple(lanes[num_single:]),
            decode_attention=self.decode_attention,
            prefill_gather=self.prefill_gather,
            chunk_attention=self.chunk_attention,
            windowed=self._window_layout(ordered, lanes, decode, step_positions) if self.pool.window_blocks else None,
            states=self.states.rows(ordered, num_single) if self.states is not None else None,
        )
        return _PreparedStep(
            inputs=inputs[:, None],
            layout=layout,
            sample_rows=mx.array(sample_rows, dtype=mx.int32),
            sample_ids=tuple(sample_ids),
            scored=tuple(scored),
            adapter_rows=mx.array(adapter_rows, dtype=mx.uint32) if any(adapter_rows) else None,
            verify_rows=mx.array(verify_rows, dtype=mx.int32) if verify_rows else None,
            drafted=tuple(drafted),
            pooled=tuple(pooled),
        )

    def _input_tokens(self, lanes: list[Lane], previous: InFlightStep | None) -> mx.array:
        """The lanes' input rows `[T]`; a `PENDING_TOKEN` is taken from `previous`'s tokens on the device."""
        tokens: list[int] = []
        pending_rows: list[int] = []
        pending_sources: list[int] = []
        for lane in lanes:
            if lane.token_ids[-1] == PENDING_TOKEN:
                pending_rows.append(len(tokens) + lane.rows - 1)
                pending_sources.append(previous.row_of[lane.request_id])
            tokens.extend(max(t, 0) for t in lane.token_ids)
        inputs = mx.array(tokens, dtype=mx.int32)
        if pending_rows:
            inputs[mx.array(pending_rows)] = previous.sampled.tokens[mx.array(pending_sources)]
        return inputs

    def _observe(self, lanes: list[Lane], inputs: mx.array, row_starts: list[int]) -> None:
        for lane, start in zip(lanes, row_starts):
            sampler = self.samplers.get(lane.request_id)
            if sampler is not None and sampler.processors:
                sampler.observe(lane.start, inputs[start : start + lane.rows])

    def _bucketed_lane(self, row_start: int, lane: Lane) -> LaneRows:
        """A prefill lane whose KV is padded to a `history_bucket` and whose queries to a `query_bucket`, with the
        causal mask that hides the pad (pad queries repeat the last row's position, so their rows stay finite).

        With a `prefill_gather` the lane carries its block table; otherwise slots, padded with slot 0."""
        padded = history_bucket(lane.end, self.kv_bucket)
        queries = query_bucket(lane.rows)
        query_pos = mx.minimum(mx.arange(lane.start, lane.start + queries, dtype=mx.int32), lane.end - 1)
        key_pos = mx.arange(padded, dtype=mx.int32)[None, :]
        dtype = self.pool.layout.dtype
        visible = key_pos <= query_pos[:, None]  # left unevaluated where the attention reads the pool itself
        mask = mx.where(visible, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))[None, None]
        if self.prefill_gather is not None:
            table = mx.array(np.asarray(lane.block_ids[: -(-lane.end // self.pool.block_size)], dtype=np.int32))
            length = mx.array([lane.end, padded], dtype=mx.int32)
            return LaneRows(row_start, lane.rows, self._no_slots, mask, table, length, padded, queries, query_pos)
        slots = np.zeros(padded, dtype=np.int32)
        slots[: lane.end] = slot_array(lane.block_ids, 0, lane.end, self.pool.block_size)
        return LaneRows(row_start, lane.rows, mx.array(slots), mask, query_rows=queries, positions=query_pos)

    def _window_layout(self, plan_lanes: list[Lane], rows: list[LaneRows], decode: DecodeRows | None,
                       positions: mx.array) -> StepLayout:  # fmt: skip
        """The step's rows in the window space: their writes, the decode lanes' tables (`decode`'s lanes, their
        lengths), and each prefill lane's slots from the earliest position its window reaches (queries as in `rows`)."""
        size, reach = self.pool.block_size, self.pool.layout.widest_window - 1
        num_single = decode.count if decode is not None else 0
        tables = [self.pool.window_table(lane.window_block_ids) for lane in plan_lanes]
        writes = [slot_array(table, lane.start, lane.end, size) for lane, table in zip(plan_lanes, tables)]
        lanes = []
        scratch = self.pool.window_scratch_block * size
        for lane, table, full in list(zip(plan_lanes, tables, rows))[num_single:]:
            first = max(0, lane.start - reach)
            slots = slot_array(table, first, lane.end, size)
            if self.kv_bucket:  # one key length per query bucket, as padded histories repeat shapes (cuDNN graphs)
                padded = np.full(reach + max(full.query_rows, lane.rows), scratch, dtype=np.int32)
                padded[: len(slots)] = slots
                slots = padded  # the pad sits past the lane's last row: the window's causal mask hides it
            lanes.append(LaneRows(full.row_start, lane.rows, mx.array(slots), query_rows=full.query_rows,
                                  positions=full.positions, kv_start=first))  # fmt: skip
        window_decode = None
        if decode is not None:
            width = max(len(table) for table in tables[:num_single])
            padded = padded_tables(tables[:num_single], num_single, width, self.pool.window_scratch_block)
            window_decode = DecodeRows(num_single, mx.array(padded), decode.lengths, size, lanes=())
        return StepLayout(positions, mx.array(np.concatenate(writes)), window_decode, tuple(lanes))

    def _decode_rows(self, plan_lanes: list, rows: list[LaneRows]) -> DecodeRows:
        width = max(len(lane.block_ids) for lane in plan_lanes)
        tables = [list(lane.block_ids) + [0] * (width - len(lane.block_ids)) for lane in plan_lanes]
        return DecodeRows(
            count=len(plan_lanes),
            block_tables=mx.array(tables, dtype=mx.int32),
            lengths=mx.array([lane.end for lane in plan_lanes], dtype=mx.int32),
            block_size=self.pool.block_size,
            lanes=tuple(rows),
        )

    def _forward(self, prepared: _PreparedStep) -> mx.array:
        """Hidden states after the final norm, `[T, hidden]`."""
        if prepared.adapter_rows is not None:
            return self._adapted_forward(prepared)
        if self.fused_mixed is not None:
            return self.fused_mixed.mixed(prepared.inputs[:, 0], prepared.layout, self.pool)
        return self._module_forward(prepared)

    def _module_forward(self, prepared: _PreparedStep) -> mx.array:
        caches = [self._layer_cache(layer, prepared.layout) for layer in range(len(self.pool.keys))]
        return self.model.model(prepared.inputs, cache=caches)[:, 0, :]

    def _layer_cache(self, layer: int, layout: StepLayout) -> Any:
        """A layer's cache for the step: its K/V's, its recurrent state's, or both (Falcon-H1's `CacheList`)."""
        kv = RaggedLayerCache(self.pool, layer, layout) if self.pool.layout.attends(layer) else None
        if self.states is None or layer not in self.states.layers:
            return kv
        state = RecurrentLayerCache(self.states, layer, layout.states)
        return state if kv is None else LayerCaches(state, kv)

    def _adapted_forward(self, prepared: _PreparedStep) -> mx.array:
        """The model's own modules, each adapted linear adding its rows' adapters (read while the graph is built)."""
        selection = self.adapters.selection
        selection.rows = prepared.adapter_rows
        try:
            return self._module_forward(prepared)
        finally:
            selection.rows = None

    def _logits(self, hidden: mx.array) -> mx.array:
        # the LM head runs only on sampling rows: prefill rows never need vocabulary-sized logits
        if self._family_head is not None:
            return self._family_head(hidden)
        if self._tied:
            return self.dequantize.embedding_as_linear(self.model.model.embed_tokens, hidden)
        return self.model.lm_head(hidden)

    def _read_samples(
        self, sample_ids: tuple[str, ...], samplers: list[RequestSampler], sampled: Any
    ) -> dict[str, SampledToken]:
        if not sample_ids:
            return {}
        token_ids = sampled.tokens.tolist()
        for sampler, token_id in zip(samplers, token_ids):
            if sampler.constraint is not None:  # the grammar's next mask starts from this token
                sampler.constraint.advance(token_id)
        wanted = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
        chosen: dict[int, float] = {}
        tops: dict[int, tuple[TokenLogprob, ...]] = {}
        if wanted:
            rows = mx.array(wanted)
            chosen_lp = sampled.logprobs[rows, mx.array([token_ids[i] for i in wanted])].tolist()
            chosen = dict(zip(wanted, chosen_lp))
            for i in wanted:
                k = samplers[i].params.logprobs
                if k:
                    ids, values = top_logprobs(sampled.logprobs[i], k)
                    tops[i] = tuple(TokenLogprob(t, lp) for t, lp in zip(ids.tolist(), values.tolist()))
        return {
            rid: SampledToken(token_ids[i], chosen.get(i), tops.get(i)) for i, rid in enumerate(sample_ids)
        }
