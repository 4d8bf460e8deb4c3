"""The step in flight is read back once the first half of the next step's layers is queued (`read_midway`)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.kernels.paged_attention import select_decode_attention
from mlx_serve.kv_pool import KVLayout, KVPool
from mlx_serve.runner import ModelRunner
from mlx_serve.types import GenerationRequest, SamplingParams
from scheduler.plan import PENDING_TOKEN, Lane, LaneKind, StepPlan
from tests.engine.reference import prompt_of, reference_tokens


def _runner(path, compile_decode: bool, **options) -> ModelRunner:
    model, _ = load(str(path))
    args = model.args
    layout = KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32)
    return ModelRunner(
        model, KVPool(layout, 8, 16), select_decode_attention("auto"), compile_decode=compile_decode, **options
    )


def _decode(step: int, token: int) -> StepPlan:
    return StepPlan(step, (Lane("r", LaneKind.DECODE, (token,), step, (0, 1), True),), 0, "t", None, True)


@pytest.mark.parametrize("compile_decode", [False, True])
def test_the_step_before_is_read_between_the_halves_of_the_next(tiny_qwen3, compile_decode, monkeypatch):
    """Queue order: the middle layer's KV of the new step, then the read-back, then its tokens and whole pool;
    the tokens are mlx-lm's, and the read-back's time is recorded inside the new step's submission."""
    runner = _runner(tiny_qwen3, compile_decode)
    runner.add_request("r", SamplingParams(temperature=0.0))
    first = runner.submit(_decode(0, 17))
    events: list = []
    queue = mx.async_eval

    def recording_queue(*arrays):
        events.append(("queue", [id(a) for a in arrays[0]] if len(arrays) == 1 and isinstance(arrays[0], list)
                       else [id(a) for a in arrays]))  # fmt: skip
        queue(*arrays)

    read = []

    def midway():
        events.append(("midway",))
        read.append(runner.collect(first))

    monkeypatch.setattr(mx, "async_eval", recording_queue)
    second = runner.submit(_decode(1, PENDING_TOKEN), first, midway)
    monkeypatch.undo()
    pool = runner.pool
    middle = len(pool.keys) // 2
    assert events[0] == ("queue", [id(pool.keys[middle]), id(pool.values[middle])])
    assert events[1] == ("midway",)
    assert events[2] == ("queue", [id(second.sampled.tokens), *(id(a) for a in pool.state())])
    assert len(read) == 1 and 0 < second.phases["midway"] < second.phases["submission"]
    tokens = [read[0].samples["r"].token_id, runner.collect(second).samples["r"].token_id]
    assert tokens == reference_tokens(tiny_qwen3, [17], 2)


def test_an_eager_fused_step_reads_the_step_before_halfway_through_its_build(tiny_qwen3):
    """An eager step's graph build is its longest host work: the fused forward hands its first half to the read-back
    before the later layers are built (half its residual adds are), and the tokens of both steps stay mlx-lm's."""
    runner = _runner(tiny_qwen3, compile_decode=True, fuse_decode=True, fuse_mixed=True)
    fused = runner.fused_mixed
    assert fused is not None and runner.compiled_mixed is None  # a step with prefill runs eager
    runner.add_request("r", SamplingParams(temperature=0.0))
    runner.add_request("q", SamplingParams(temperature=0.0))
    first = runner.submit(_decode(0, 17))
    built, add_norm = [], fused.add_norm
    fused.add_norm = lambda *args: built.append(1) or add_norm(*args)  # two a layer
    seen, read = [], []

    def midway():
        seen.append(len(built))
        read.append(runner.collect(first))

    prompt = prompt_of(20, seed=8)
    lanes = (Lane("r", LaneKind.DECODE, (PENDING_TOKEN,), 1, (0, 1), True),
             Lane("q", LaneKind.PREFILL, tuple(prompt), 0, (2, 3), True))  # fmt: skip
    second = runner.submit(StepPlan(1, lanes, 20, "t", None, True), first, midway)
    layers = len(fused.layers)
    assert layers >= 2 and seen == [2 * (layers // 2)] and len(built) == 2 * layers
    samples = runner.collect(second).samples
    assert [read[0].samples["r"].token_id, samples["r"].token_id] == reference_tokens(tiny_qwen3, [17], 2)
    assert samples["q"].token_id == reference_tokens(tiny_qwen3, prompt, 1)[0]


def test_a_step_with_logprobs_is_not_read_midway(tiny_qwen3):
    """Gathering a logprob builds a new graph, which would queue behind the next step's first half: the runner
    leaves such a step for the caller to read after the submission."""
    runner = _runner(tiny_qwen3, compile_decode=True)
    runner.add_request("r", SamplingParams(temperature=0.0, logprobs=2))
    first = runner.submit(_decode(0, 17))
    called = []
    second = runner.submit(_decode(1, PENDING_TOKEN), first, lambda: called.append(1))
    assert not called and second.phases["midway"] == 0.0
    one, two = runner.collect(first).samples["r"], runner.collect(second).samples["r"]
    assert [one.token_id, two.token_id] == reference_tokens(tiny_qwen3, [17], 2)
    assert one.logprob is not None and len(two.top_logprobs) == 2


def _count_midway_reads(engine: Engine) -> list[bool]:
    """Wrap the runner's submit: for each step queued behind one in flight, whether that one was read midway."""
    runner, original = engine.runner, engine.runner.submit
    reads: list[bool] = []

    def submit(plan, previous=None, midway=None):
        called = []
        wrapped = None if midway is None else (lambda: called.append(1) or midway())
        step = original(plan, previous, wrapped)
        if previous is not None:
            reads.append(bool(called))
        return step

    runner.submit = submit
    return reads


@pytest.mark.parametrize("read_midway", [True, False])
def test_the_engine_reads_midway_and_a_stop_found_there_ends_the_request(tiny_qwen3, read_midway):
    """Two streams decode with one step in flight: with `read_midway` every step behind one in flight reads it
    midway, without it none does. One stream's stop token is found in such a read, while the step after it still
    carries its lane: it ends at that token, the other stream keeps mlx-lm's tokens, and every block comes back."""
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=256, read_midway=read_midway))
    try:
        reads = _count_midway_reads(engine)
        long_prompt, short_prompt = prompt_of(20, seed=3), prompt_of(9, seed=4)
        expected_long = reference_tokens(tiny_qwen3, long_prompt, 24)
        expected_short = reference_tokens(tiny_qwen3, short_prompt, 24)
        stop = expected_short[5]
        cut = expected_short.index(stop) + 1
        long_run, short_run = engine.generate([
            GenerationRequest(prompt_ids=tuple(long_prompt), max_tokens=24, ignore_eos=True),
            GenerationRequest(prompt_ids=tuple(short_prompt), max_tokens=24, stop_token_ids=(stop,), ignore_eos=True),
        ])  # fmt: skip
        assert list(long_run.token_ids) == expected_long
        assert list(short_run.token_ids) == expected_short[:cut] and short_run.finish_reason == "stop"
        assert len(reads) >= 20 and all(reads) == read_midway and any(reads) == read_midway
        assert engine.status()["kv"]["blocks_used"] == 0
    finally:
        engine.shutdown()


def test_a_logprob_stream_is_read_after_the_submission(tiny_qwen3):
    """A stream asking for logprobs is never read midway (see above), and still gets mlx-lm's tokens."""
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=256))
    try:
        reads = _count_midway_reads(engine)
        prompt = prompt_of(11, seed=5)
        request = GenerationRequest(prompt_ids=tuple(prompt), max_tokens=12, ignore_eos=True,
                                    sampling=SamplingParams(logprobs=0))  # fmt: skip
        (completion,) = engine.generate([request])
        assert list(completion.token_ids) == reference_tokens(tiny_qwen3, prompt, 12)
        assert len(reads) >= 10 and not any(reads)
    finally:
        engine.shutdown()
