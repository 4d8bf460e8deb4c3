"""Single-row steps replayed through mx.compile give mlx-lm's tokens, and pad lanes never touch real KV."""

from __future__ import annotations

import pytest

from mlx_serve.compiled_step import lane_bucket, width_bucket
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest
from tests.engine.reference import prompt_of, reference_tokens, run_staggered

LENGTHS = [3, 17, 40, 9, 64, 5, 33, 21, 90]


def test_buckets_cover_and_repeat():
    for n in range(1, 300):
        assert lane_bucket(n) >= n and lane_bucket(n) - n < max(8, n // 2 + 1)
        assert width_bucket(n) >= n
    assert {lane_bucket(n) for n in range(1, 65)} == {1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64}
    assert {width_bucket(n) for n in range(1, 600)} == {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768}


@pytest.mark.parametrize("fuse", ["off", "on"])
@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_moe", "tiny_llama"])
def test_compiled_decode_matches_mlx_lm(fixture, fuse, request):
    """Staggered requests: lane counts move across buckets (pad lanes) and histories across widths. Fused: the
    concatenated projections and mlx-lm's attention prologue over them (the CUDA kernel's CPU twin)."""
    path = request.getfixturevalue(fixture)
    prompts = [prompt_of(n, seed=i) for i, n in enumerate(LENGTHS)]
    config = EngineConfig(
        model=str(path), row_ceiling=50, row_floor=1, block_size=4, compile_decode="on", fuse_decode=fuse
    )
    engine = Engine.load(config)
    try:
        assert engine.runner.compiled is not None
        assert (engine.runner.compiled.fused is not None) == (fuse == "on")
        results = run_staggered(engine, prompts, first=3, max_tokens=16)
        # alone, a short prompt's history crosses several table widths
        [alone] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt_of(5, seed=99)), max_tokens=40)])
        shapes = engine.runner.compiled.shapes
        traced = len(engine.runner.compiled.trace_times)
        engine.generate([GenerationRequest(prompt_ids=tuple(prompt_of(5, seed=99)), max_tokens=40)])  # shapes met
        retraced = len(engine.runner.compiled.trace_times) - traced
    finally:
        engine.shutdown()
    assert traced == len(shapes) and retraced == 0  # one trace a shape, each recorded; a shape met again replays
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_tokens(path, prompt, 16), f"request {i} (prompt {len(prompt)} tokens)"
    assert list(alone.token_ids) == reference_tokens(path, prompt_of(5, seed=99), 40)
    assert len({lanes for lanes, _ in shapes}) > 1 and len({width for _, width in shapes}) > 1, shapes


def test_history_buckets_cover_with_bounded_padding():
    from mlx_serve.runner import history_bucket

    seen = set()
    for end in range(1, 40_000, 7):
        padded = history_bucket(end, 1024)
        assert padded >= end and padded % 1024 == 0
        assert padded <= max(2 * end, 1024) and (end <= 8192 or padded <= 1.5 * end)
        seen.add(padded)
    assert sorted(p // 1024 for p in seen if p <= 16 * 1024) == [1, 2, 4, 8, 12, 16]


@pytest.mark.parametrize("compile_decode", [False, True])
def test_pipelined_step_is_timed_from_the_previous_read_back(tiny_qwen3, compile_decode):
    """Step B is queued (reading A's token on the device) before A is read back; B's measured time must start
    when A was read back, not when B was queued, or the cost model learns B as one step too slow."""
    import time

    import mlx.core as mx
    from mlx_lm import load

    from mlx_serve.kernels.paged_attention import select_decode_attention
    from mlx_serve.kv_pool import KVLayout, KVPool
    from mlx_serve.runner import ModelRunner
    from mlx_serve.types import SamplingParams
    from scheduler.plan import PENDING_TOKEN, Lane, LaneKind, StepPlan

    model, _ = load(str(tiny_qwen3))
    args = model.args
    layout = KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32)
    runner = ModelRunner(
        model, KVPool(layout, 8, 16), select_decode_attention("auto"), compile_decode=compile_decode
    )
    runner.add_request("r", SamplingParams(temperature=0.0))

    def plan(step: int, token: int) -> StepPlan:
        return StepPlan(step, (Lane("r", LaneKind.DECODE, (token,), step, (0, 1), True),), 0, "t", None, True)

    first = runner.submit(plan(0, 5))
    second = runner.submit(plan(1, PENDING_TOKEN), first)
    time.sleep(0.05)  # host work between queueing B and reading A back must not count as B's time
    runner.collect(first)
    after_first = time.perf_counter()
    out = runner.collect(second)
    assert out.outcome.elapsed_ms <= (time.perf_counter() - after_first) * 1e3 + 1.0
    assert out.samples["r"].token_id >= 0


class _FakeDeviceClock:
    """Stamps that read back as given device times, in read order (the runner reads steps in queue order)."""

    def __init__(self, ends_ns: list[int]) -> None:
        self.ends_ns = list(ends_ns)
        self.stamped = 0

    def stamp(self, after):
        self.stamped += 1
        return after.reshape(-1)[:1] * 0  # computed once the step's output is

    def read_ns(self, stamp) -> int:
        return self.ends_ns.pop(0)


def test_steps_are_timed_by_the_device_clock_between_consecutive_ends(tiny_qwen3):
    """With a device clock, a step that followed the previous one without the engine idling is timed as the
    interval between their device ends, whatever the host did meanwhile (on CUDA the host can block inside a
    large step's submission, and host clocks then book that time to the step before). After an idle engine the
    interval would include the idle time, so that step is timed on the host."""
    import time

    import mlx.core as mx
    from mlx_lm import load

    from mlx_serve.kernels.paged_attention import select_decode_attention
    from mlx_serve.kv_pool import KVLayout, KVPool
    from mlx_serve.runner import ModelRunner
    from mlx_serve.types import SamplingParams
    from scheduler.plan import PENDING_TOKEN, Lane, LaneKind, StepPlan

    model, _ = load(str(tiny_qwen3))
    args = model.args
    layout = KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32)
    base = 1_000_000_000
    clock = _FakeDeviceClock([base, base + 7_000_000, base + 900_000_000, base + 912_500_000])
    runner = ModelRunner(model, KVPool(layout, 8, 16), select_decode_attention("auto"), clock=clock)
    runner.add_request("r", SamplingParams(temperature=0.0))
    runner.add_request("p", SamplingParams(temperature=0.0))

    def decode(step: int, token: int) -> StepPlan:
        return StepPlan(step, (Lane("r", LaneKind.DECODE, (token,), step, (0, 1), True),), 0, "t", None, True)

    first = runner.submit(decode(0, 5))
    second = runner.submit(decode(1, PENDING_TOKEN), first)
    time.sleep(0.05)  # host time (publishing, a blocking submission) is not the device's
    first_out, second_out = runner.collect(first), runner.collect(second)
    assert second_out.outcome.elapsed_ms == 7.0
    assert first_out.outcome.elapsed_ms < 1000.0  # nothing before it on the device: host time, not the stamp

    time.sleep(0.05)  # the engine idles: the next step's device interval would include this
    prefill = StepPlan(2, (Lane("p", LaneKind.PREFILL, tuple(range(1, 9)), 0, (2, 3), True),), 8, "t", None, True)
    queued = time.perf_counter()
    third = runner.collect(runner.submit(prefill))
    assert 0.0 < third.outcome.elapsed_ms <= (time.perf_counter() - queued) * 1e3 + 1.0
    fourth = runner.collect(runner.submit(decode(2, 7)))  # queued right after the third's read-back
    assert fourth.outcome.elapsed_ms == 12.5
    assert clock.stamped == 4 and not clock.ends_ns
    assert all(out.samples for out in (first_out, second_out, third, fourth))


def test_gpu_clock_reads_its_two_words_as_nanoseconds():
    import mlx.core as mx

    from mlx_serve.kernels.step_clock import GpuStepClock, step_interval_ms

    value = (7 << 32) | 123_456_789
    assert GpuStepClock().read_ns(mx.array([123_456_789, 7], dtype=mx.uint32)) == value
    assert step_interval_ms(3.0, value + 2_000_000, value, True) == 2.0
    assert step_interval_ms(3.0, value + 2_000_000, value, False) == 3.0  # the engine idled between them
    assert step_interval_ms(3.0, value, None, True) == 3.0  # no previous end on the device
    assert step_interval_ms(3.0, value, value + 1, True) == 3.0  # a clock that went back is not trusted


def test_compiled_decode_keeps_penalties_logprobs_and_seeds(tiny_qwen3):
    """The same requests with per-request sampling features, compiled and eager, in one busy batch each:
    penalties and logit bias (device-side history), logprobs, and seeded sampling give identical results."""
    from mlx_serve.types import SamplingParams

    requests = [
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={77: 4.0}),
        SamplingParams(logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=11, logprobs=0),
        SamplingParams(),
    ]
    prompts = [prompt_of(9 + 7 * i, seed=40 + i) for i in range(len(requests))]
    results = {}
    for mode in ("off", "on"):
        engine = Engine.load(EngineConfig(model=str(tiny_qwen3), compile_decode=mode))
        try:
            assert (engine.runner.compiled is not None) == (mode == "on")
            completions = engine.generate(
                [
                    GenerationRequest(prompt_ids=tuple(p), max_tokens=12, sampling=s, ignore_eos=True)
                    for p, s in zip(prompts, requests)
                ]
            )
        finally:
            engine.shutdown()
        results[mode] = [
            (list(c.token_ids), [round(lp, 5) for lp in c.logprobs] if c.logprobs is not None else None)
            for c in completions
        ]
    assert results["on"][1][1] and results["on"][3][1] is not None  # logprobs were really returned
    assert results["on"] == results["off"]


def test_query_buckets_are_powers_of_two_and_their_midpoints_from_64():
    from mlx_serve.runner import query_bucket
    from scheduler.buckets import query_buckets

    got = [query_bucket(n) for n in (1, 7, 64, 65, 97, 192, 193, 384, 385, 512, 513, 2048)]
    assert got == [64, 64, 64, 96, 128, 192, 256, 384, 512, 512, 768, 2048]
    assert query_buckets(2048) == [64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    for rows in range(1, 2049):  # the smallest bucket that holds the rows: under 1.5x padding
        bucket = query_bucket(rows)
        assert bucket >= rows and (bucket == 64 or bucket * 2 < rows * 3)
        assert all(b < rows for b in query_buckets(2048) if b < bucket)


def test_warm_up_builds_every_bucketed_prefill_shape(tiny_qwen3):
    """Rows 64 and 96 (query buckets up to 70 rows) against the histories up to 100 tokens (buckets 32, 64, 128)
    that hold them; without history buckets (MLX's CPU backend) there is nothing to warm."""
    import mlx.core as mx
    from mlx_lm import load

    from mlx_serve.kv_pool import KVLayout, KVPool
    from mlx_serve.runner import ModelRunner

    model, _ = load(str(tiny_qwen3))
    args = model.args
    pool = KVPool(KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32), 8, 16)
    assert ModelRunner(model, pool, kv_bucket=0).warm_prefill_attention(100, 70) == 0
    assert ModelRunner(model, pool, kv_bucket=32).warm_prefill_attention(100, 70) == 3


def test_warm_up_runs_each_quantized_projection_shape_at_every_row_bucket(tiny_qwen3_4bit, monkeypatch):
    """Each distinct quantized projection (the fused q/k/v and gate/up ones too) once at 1, 2, 4, ... rows up to
    the row ceiling, through the step's own `[T, 1]` path; a bf16 model has none."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    from mlx_serve.kernels.paged_attention import select_decode_attention
    from mlx_serve.kv_pool import KVLayout, KVPool
    from mlx_serve.runner import ModelRunner

    model, _ = load(str(tiny_qwen3_4bit))
    args = model.args
    pool = KVPool(KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32), 8, 16)
    runner = ModelRunner(model, pool, select_decode_attention("auto"), compile_decode=True, fuse_decode=True)
    calls = []
    original = nn.QuantizedLinear.__call__
    monkeypatch.setattr(nn.QuantizedLinear, "__call__", lambda self, x: calls.append((self.weight.shape, x.size
                        // x.shape[-1])) or original(self, x))  # fmt: skip
    products = runner.warm_quantized_products(20)
    shapes = {shape for shape, _ in calls}
    fused = runner.compiled.fused.layers[0]
    assert {fused.qkv.weight.shape, fused.gate_up.weight.shape, model.model.layers[0].mlp.down_proj.weight.shape} <= shapes
    assert products == len(shapes) * 5  # rows 1, 2, 4, 8, 16
    assert sorted({rows for _, rows in calls}) == [1, 2, 4, 8, 16]


def test_warm_up_of_a_dense_model_runs_no_quantized_product(tiny_qwen3):
    import mlx.core as mx
    from mlx_lm import load

    from mlx_serve.kv_pool import KVLayout, KVPool
    from mlx_serve.runner import ModelRunner

    model, _ = load(str(tiny_qwen3))
    args = model.args
    pool = KVPool(KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32), 8, 16)
    assert ModelRunner(model, pool).warm_quantized_products(64) == 0


def test_a_quantized_decode_step_of_few_lanes_padded_to_eight_rows_keeps_its_tokens(tiny_qwen3_4bit):
    """On CUDA a 4-bit step of 2-7 lanes is padded to 8 rows (MLX's quantized GEMM from 8 rows reads the packed
    weights once, its per-row kernel below once per row): the padding rows change nothing of the real lanes."""
    import mlx.core as mx
    from mlx_lm import load

    from mlx_serve.kernels.paged_attention import select_decode_attention
    from mlx_serve.kv_pool import KVLayout, KVPool
    from mlx_serve.runner import QUANTIZED_MIN_LANES, ModelRunner
    from mlx_serve.types import SamplingParams
    from scheduler.plan import Lane, LaneKind, StepPlan

    model, _ = load(str(tiny_qwen3_4bit))
    args = model.args
    layout = KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32)

    def decode_step(min_lanes: int):
        runner = ModelRunner(model, KVPool(layout, 16, 16), select_decode_attention("auto"), compile_decode=True)
        runner.compiled.min_lanes = min_lanes
        for i in range(3):
            runner.add_request(f"r{i}", SamplingParams(temperature=0.0, logprobs=2))
        lanes = tuple(Lane(f"r{i}", LaneKind.DECODE, (7 + i,), 0, (i,), True) for i in range(3))
        out = runner.execute(StepPlan(0, lanes, 0, "t", None, True))
        return runner.compiled.shapes, [(s.token_id, s.logprob) for s in out.samples.values()]

    plain_shapes, plain = decode_step(1)
    padded_shapes, padded = decode_step(QUANTIZED_MIN_LANES)
    assert {lanes for lanes, _ in plain_shapes} == {4} and {lanes for lanes, _ in padded_shapes} == {8}
    assert [t for t, _ in padded] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(padded, plain):
        assert abs(a - b) < 1e-5
