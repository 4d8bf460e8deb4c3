"""Prefix caching, salts, seeded sampling, pool exhaustion, stop strings, cancellation, logprobs, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading

import mlx.core as mx
import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import ContextLengthExceeded, InvalidRequest, QueueFull
from mlx_serve.types import GenerationRequest, SamplingParams
from tests.engine.reference import (
    load_reference,
    prompt_of,
    reference_prompt_logprobs,
    reference_tokens,
    run_staggered,
)


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=256))
    yield engine
    engine.shutdown()


def _generate_as_mlx_lm(path, config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> tuple[list, dict]:
    """Generate the prompts together on a fresh engine; each must give mlx-lm's greedy tokens. Returns the
    completions and the engine's stats after them."""
    engine = Engine.load(config)
    try:
        completions = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=max_tokens) for p in prompts])
        stats = engine.stats()
    finally:
        engine.shutdown()
    for prompt, completion in zip(prompts, completions):
        assert list(completion.token_ids) == reference_tokens(path, prompt, max_tokens)
    return completions, stats


def _run(engine: Engine, prompt: list[int], **kwargs):
    [completion] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), **kwargs)])
    return completion


def test_prefix_hit_gives_cold_tokens_and_computes_only_uncached_rows(engine, tiny_qwen3):
    prompt = prompt_of(83, seed=11)
    cold = _run(engine, prompt, max_tokens=8, cache_salt="prefix-test")
    before = engine.stats()
    warm = _run(engine, prompt, max_tokens=8, cache_salt="prefix-test")
    after = engine.stats()
    assert warm.token_ids == cold.token_ids == tuple(reference_tokens(tiny_qwen3, prompt, 8))
    assert cold.usage.cached_tokens == 0
    assert warm.usage.cached_tokens == 80  # five full blocks of 16; never the last prompt token
    assert after["prefix_hit_tokens_total"] - before["prefix_hit_tokens_total"] == 80
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 83 - 80


def test_a_continuation_copies_the_finished_requests_hashes_and_keeps_its_tokens(engine, tiny_qwen3):
    prefix = prompt_of(600, seed=14)
    _run(engine, [*prefix, 5, 6], max_tokens=4, cache_salt="recall-test")
    before = engine.stats()
    prompt = [*prefix, 7, 8, 9]
    warm = _run(engine, prompt, max_tokens=4, cache_salt="recall-test")
    after = engine.stats()
    assert warm.token_ids == tuple(reference_tokens(tiny_qwen3, prompt, 4))
    assert warm.usage.cached_tokens == 592  # the 37 whole blocks of the shared 600 tokens
    assert after["prefix_hashes_recalled_total"] - before["prefix_hashes_recalled_total"] == 37


@pytest.mark.parametrize("shared", [256, 0])
def test_a_burst_over_one_system_prompt_computes_it_once(tiny_qwen3, shared):
    """Three requests arrive together over a 300-token system prompt: the first computes it, the others wait a
    step and take its 288 whole-block tokens from the cache (off: each computes them). Tokens are mlx-lm's."""
    system = prompt_of(300, seed=15)
    prompts = [[*system, *prompt_of(20, seed=16 + i)] for i in range(3)]
    config = EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=256, shared_prefill_tokens=shared)
    completions, stats = _generate_as_mlx_lm(tiny_qwen3, config, prompts, max_tokens=6)
    cached = sorted(c.usage.cached_tokens for c in completions)
    assert cached == ([0, 288, 288] if shared else [0, 0, 0])
    assert stats["prompt_tokens_total"] == 3 * 320 - sum(cached)
    assert (stats["shared_prefill_waits_total"] == 2) == bool(shared)


def test_different_salts_never_share_blocks(engine):
    prompt = prompt_of(64, seed=12)
    _run(engine, prompt, max_tokens=2, cache_salt="tenant-a")
    other = _run(engine, prompt, max_tokens=2, cache_salt="tenant-b")
    unsalted = _run(engine, prompt, max_tokens=2)
    same = _run(engine, prompt, max_tokens=2, cache_salt="tenant-a")
    assert other.usage.cached_tokens == 0
    assert unsalted.usage.cached_tokens == 0
    assert same.usage.cached_tokens == 48  # the last block holds the last prompt token: recomputed


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = prompt_of(21, seed=13)
    alone = _run(engine, prompt, max_tokens=20, sampling=params)
    busy = [GenerationRequest(prompt_ids=tuple(prompt_of(5 + 9 * i, seed=30 + i)), max_tokens=25,
                              sampling=SamplingParams(temperature=1.0 + 0.1 * i)) for i in range(7)]
    busy.insert(3, GenerationRequest(prompt_ids=tuple(prompt), max_tokens=20, sampling=params))
    completions = engine.generate(busy)
    assert completions[3].token_ids == alone.token_ids
    assert len(set(alone.token_ids)) > 1  # it really sampled
    reseeded = _run(engine, prompt, max_tokens=20, sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99))
    assert reseeded.token_ids != alone.token_ids


def test_any_integer_seed_samples_and_wraps_to_64_bits(engine):
    """OpenAI's seeds are signed and choice i of n takes seed + i; MLX's keys are uint64 (a seed of -1 or 2**64
    stopped the engine for every request)."""
    prompt = prompt_of(15, seed=14)

    def sampled(seed: int) -> tuple[int, ...]:
        params = SamplingParams(temperature=1.0, seed=seed)
        return tuple(_run(engine, prompt, max_tokens=12, sampling=params).token_ids)

    assert sampled(-1) == sampled(2**64 - 1)
    assert sampled(2**64 + 1234) == sampled(1234) == sampled(-(2**64) + 1234)
    assert sampled(-1) != sampled(1234)


def test_a_request_whose_sampler_cannot_be_built_fails_alone(tiny_qwen3, monkeypatch):
    """An error building one request's sampling state fails that request; the scheduler lets it go (no KV, no
    queue place) and the engine serves the others."""
    from mlx_serve.sampling import RequestSampler

    original = RequestSampler.create.__func__

    def create(cls, params, *args, **kwargs):
        if params.seed == 666:
            raise RuntimeError("injected sampler failure")
        return original(cls, params, *args, **kwargs)

    monkeypatch.setattr(RequestSampler, "create", classmethod(create))
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=256))
    try:
        good, bad = prompt_of(20, seed=15), prompt_of(30, seed=16)
        completions = engine.generate([GenerationRequest(prompt_ids=tuple(good), max_tokens=6),
                                       GenerationRequest(prompt_ids=tuple(bad), max_tokens=6,
                                                         sampling=SamplingParams(seed=666))])
        assert list(completions[0].token_ids) == reference_tokens(tiny_qwen3, good, 6)
        assert completions[1].finish_reason == "error" and not completions[1].token_ids
        stats = engine.stats()
        assert (stats["queue_depth"], stats["running"], stats["kv_blocks_used"]) == (0, 0, 0)
        assert list(_run(engine, bad, max_tokens=4).token_ids) == reference_tokens(tiny_qwen3, bad, 4)
    finally:
        engine.shutdown()


def test_pool_exhaustion_waits_or_preempts_and_keeps_reference_tokens(tiny_qwen3):
    # 10 blocks of 16 = 160 tokens of KV for 6 requests needing 64 each
    config = EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=10, enable_prefix_cache=False)
    prompts = [prompt_of(30 + 3 * i, seed=40 + i) for i in range(6)]
    _, stats = _generate_as_mlx_lm(tiny_qwen3, config, prompts, max_tokens=30)
    assert stats["kv_blocks_used"] == 0
    assert stats["preemptions_total"] > 0  # the pool really ran out


def test_stop_string_cuts_the_text(engine):
    prompt = prompt_of(19, seed=14)
    full = _run(engine, prompt, max_tokens=24)
    assert len(full.text) > 6, full.text
    stop = full.text[4:7]
    stopped = _run(engine, prompt, max_tokens=24, stop=(stop,))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]


def test_cancel_frees_kv_at_once(engine):
    handle = engine.submit(GenerationRequest(prompt_ids=tuple(prompt_of(50, seed=15)), max_tokens=1000, ignore_eos=True))
    events = []
    for event in handle:
        events.append(event)
        if len(events) == 3:
            handle.cancel()
    assert events[-1].finish_reason == "cancelled"
    assert events[-1].usage is not None
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0


def test_logprobs_match_mlx_lm(engine, tiny_qwen3):
    from mlx_lm.generate import generate_step

    prompt = prompt_of(12, seed=16)
    handle = engine.submit(GenerationRequest(prompt_ids=tuple(prompt), max_tokens=5, sampling=SamplingParams(logprobs=3)))
    events = [e for e in handle if e.token_id is not None]
    model, _ = load_reference(str(tiny_qwen3))
    for event, (token, logprobs) in zip(events, generate_step(mx.array(prompt), model, max_tokens=5)):
        assert event.token_id == int(token)
        assert event.logprob == pytest.approx(logprobs[int(token)].item(), abs=1e-5)
        assert len(event.top_logprobs) == 3
        assert event.top_logprobs[0].token_id == event.token_id
        values = [t.logprob for t in event.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_bad_requests_are_refused_and_the_engine_carries_on(engine):
    with pytest.raises(InvalidRequest):
        engine.submit(GenerationRequest(prompt_ids=()))
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.submit(GenerationRequest(prompt_ids=(1, 2), sampling=SamplingParams(temperature=-1)))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.submit(GenerationRequest(prompt_ids=(1, 10**9)))
    with pytest.raises(ContextLengthExceeded, match="maximum context length"):
        engine.submit(GenerationRequest(prompt_ids=(1, 2), max_tokens=engine.context_length))
    assert _run(engine, prompt_of(5, seed=17), max_tokens=3).finish_reason in ("length", "stop")


def test_a_refused_batch_is_withdrawn_before_any_of_it_runs(engine):
    """submit_all is all or none: the valid requests queued before the refused one are cancelled, and the engine
    takes their cancellations with them, so none computes a row or samples a token."""
    valid = GenerationRequest(prompt_ids=tuple(prompt_of(40, seed=19)), max_tokens=50, ignore_eos=True)
    before = engine.stats()
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.submit_all([valid, valid, GenerationRequest(prompt_ids=(1, 10**9))])
    probe = _run(engine, prompt_of(7, seed=20), max_tokens=2)  # queued after the batch; shorter than a block
    after = engine.stats()
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 7
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == len(probe.token_ids)
    assert (after["queue_depth"], after["running"]) == (0, 0)


def test_full_queue_is_refused(tiny_qwen3):
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), queue_limit=1, max_running=1, kv_blocks=64))
    try:
        long = GenerationRequest(prompt_ids=tuple(prompt_of(10, seed=18)), max_tokens=500, ignore_eos=True)
        handles = [engine.submit(long), engine.submit(long)]
        with pytest.raises(QueueFull):
            engine.submit(long)
        for h in handles:
            h.cancel()
        assert {list(h)[-1].finish_reason for h in handles} <= {"cancelled", "length"}
        short = GenerationRequest(prompt_ids=(5, 6, 7), max_tokens=2)
        assert list(engine.submit(short))[-1].finish_reason in ("length", "stop")  # room again
    finally:
        engine.shutdown()


def test_generate_cli_json(tiny_qwen3):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_serve", "generate", "--model", str(tiny_qwen3), "--prompt", "hello there",
         "--max-tokens", "6", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    _, tokenizer = load_reference(str(tiny_qwen3))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True)
    assert result["token_ids"] == reference_tokens(tiny_qwen3, prompt, 6)
    assert result["finish_reason"] in ("length", "stop")
    assert set(result["timings"]) >= {"ttft_s", "total_s"}


def test_generate_cli_scores_the_prompt_as_mlx_lm(tiny_qwen3):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_serve", "generate", "--model", str(tiny_qwen3), "--prompt", "hello there friend",
         "--raw", "--max-tokens", "2", "--score", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    _, tokenizer = load_reference(str(tiny_qwen3))
    prompt = tokenizer.encode("hello there friend")
    reference = reference_prompt_logprobs(tiny_qwen3, prompt)
    want = [float(reference[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert [t for t, _ in result["prompt_logprobs"]] == prompt
    assert [lp for _, lp in result["prompt_logprobs"]] == pytest.approx([None, *want], abs=2e-5)
    assert result["prompt_logprob"] == pytest.approx(sum(want), abs=1e-4)
    assert result["prompt_perplexity"] == pytest.approx(math.exp(-sum(want) / len(want)), rel=1e-4)


def test_generate_cli_bad_model_exits_non_zero(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_serve", "generate", "--model", str(tmp_path / "nope"), "--prompt", "x"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "nope" in out.stderr


def test_penalties_and_logit_bias_match_mlx_lm_processors(engine, tiny_qwen3):
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    prompt = prompt_of(15, seed=19)
    bias = {prompt[0]: 3.0, 77: -5.0}
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3, logit_bias=bias)
    ours = _run(engine, prompt, max_tokens=12, sampling=params, ignore_eos=True)
    model, _ = load_reference(str(tiny_qwen3))
    processors = make_logits_processors(
        logit_bias=bias, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3
    )
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12, logits_processors=processors)]
    plain = _run(engine, prompt, max_tokens=12, ignore_eos=True)
    assert list(ours.token_ids) == expected
    assert ours.token_ids != plain.token_ids  # the processors really changed something


def test_a_failing_step_in_flight_fails_only_its_requests(tiny_qwen3, monkeypatch):
    """The decode step left in flight fails when it is read back, after a prefill step was queued behind it: its
    request ends with an error, the newcomer gets mlx-lm's tokens, KV is all given back, and the engine serves the
    next request."""
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=256))
    try:
        runner = engine.runner
        victim = engine.submit(GenerationRequest(prompt_ids=tuple(prompt_of(9, seed=40)), max_tokens=200))
        armed, waited = threading.Event(), []
        original_submit, original_collect = runner.submit, runner.collect

        def submit(plan, previous=None):
            if armed.is_set() and not waited and previous is not None and plan.prefill_rows:
                waited.append(previous)  # the step in flight when a prefill step is queued behind it
            return original_submit(plan, previous)

        def collect(step):
            if waited and step is waited[0] and armed.is_set():
                armed.clear()
                raise RuntimeError("injected device failure")
            return original_collect(step)

        monkeypatch.setattr(runner, "submit", submit)
        monkeypatch.setattr(runner, "collect", collect)
        events = iter(victim)
        assert all(next(events).error is None for _ in range(3))
        armed.set()
        newcomer_prompt = prompt_of(30, seed=41)
        newcomer = engine.submit(GenerationRequest(prompt_ids=tuple(newcomer_prompt), max_tokens=8))
        rest = list(events)
        assert waited and not armed.is_set(), "no prefill step was queued behind a step in flight"
        assert rest[-1].finish_reason == "error" and "injected device failure" in rest[-1].error
        tokens = [e.token_id for e in newcomer if e.token_id is not None]
        assert tokens == reference_tokens(tiny_qwen3, newcomer_prompt, 8)
        after = prompt_of(12, seed=42)
        assert list(_run(engine, after, max_tokens=5).token_ids) == reference_tokens(tiny_qwen3, after, 5)
        assert engine.status()["kv"]["blocks_used"] == 0
    finally:
        engine.shutdown()


def test_generate_cli_json_schema(tiny_qwen3, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    argv = [sys.executable, "-m", "mlx_serve", "generate", "--model", str(tiny_qwen3), "--prompt", "answer",
            "--max-tokens", "30", "--json", "--json-schema"]  # fmt: skip
    out = subprocess.run([*argv, str(tmp_path / "schema.json")], capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["finish_reason"] == "stop" and set(json.loads(result["text"])) == {"ok"}
    (tmp_path / "bad.json").write_text(json.dumps({"type": "objectx"}))
    for bad in (tmp_path / "bad.json", tmp_path / "missing.json"):
        failed = subprocess.run([*argv, str(bad)], capture_output=True, text=True, timeout=300)
        assert failed.returncode == 1 and failed.stderr.startswith("error:"), failed.stderr


def test_constrained_requests_stay_in_their_grammar_through_preemption(tiny_qwen3):
    """JSON-constrained requests in a pool too small for all of them: preempted and recomputed, every answer is
    still a sequence its grammar accepts from the start (the matcher never missed or repeated a token)."""
    from llguidance import LLMatcher

    from mlx_serve.grammar import grammar_for_response_format

    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=10, enable_prefix_cache=False))
    grammar = grammar_for_response_format({"type": "json_object"})
    sampling = SamplingParams(temperature=1.0, seed=9, grammar=grammar)
    requests = [GenerationRequest(prompt_ids=tuple(prompt_of(30 + 3 * i, seed=60 + i)), max_tokens=30,
                                  sampling=sampling) for i in range(6)]  # fmt: skip
    try:
        completions = engine.generate(requests)
        stats = engine.stats()
        tokenizer = engine.grammars.tokenizer
    finally:
        engine.shutdown()
    assert stats["preemptions_total"] > 0  # the pool really ran out
    for completion in completions:
        tokens = list(completion.token_ids)
        fresh = LLMatcher(tokenizer, grammar)
        assert fresh.validate_tokens(tokens) == len(tokens), completion.text
        assert completion.text.startswith("{")


def test_prefill_chunks_riding_with_decode_lanes_stay_in_flight(tiny_qwen3, monkeypatch):
    """A step with a prefill chunk and decode lanes is left in flight like a decode step (the host builds the next
    step meanwhile); the tokens still equal mlx-lm's, and the cost model learns each such step's measured time
    once it is read back (the update at queuing time has none)."""

    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), row_ceiling=16, row_floor=1, cost_model="affine"))
    try:
        runner, scheduler = engine.runner, engine.scheduler
        left, learned = [], []
        original_stay, original_observe = runner.can_stay_in_flight, scheduler.observe

        def stay(step):
            verdict = original_stay(step)
            if step.plan.prefill_rows and any(lane.kind.value == "decode" for lane in step.plan.lanes):
                left.append(verdict)
            return verdict

        def observe(plan, outcome):
            learned.append(outcome.elapsed_ms)
            original_observe(plan, outcome)

        monkeypatch.setattr(runner, "can_stay_in_flight", stay)
        monkeypatch.setattr(scheduler, "observe", observe)
        prompts = [prompt_of(n, seed=130 + n) for n in (9, 40, 23, 35)]
        results = run_staggered(engine, prompts, first=1, max_tokens=10)
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_tokens(tiny_qwen3, prompt, 10), f"request {i}"
    assert left and all(left), "no mixed step was left in flight"
    assert learned and all(ms > 0 and ms == ms for ms in learned)  # finite, measured


def test_a_fresh_engine_reads_a_prompt_beside_streams_in_untrained_rows_and_keeps_tokens(tiny_qwen3):
    """`untrained_rows`: until the cost model can price a step, a contended step takes at most that many prefill
    rows (not the ceiling); the prompt read so still gives mlx-lm's tokens."""
    from tracing.events import StepPlanned
    from tracing.sink import MemorySink

    sink = MemorySink()
    prompts = [prompt_of(n, seed=90 + n) for n in (5, 6, 600)]  # two streams, then a long prompt beside them
    config = EngineConfig(model=str(tiny_qwen3), row_ceiling=256, row_floor=8, untrained_rows=64,
                          step_target_ms=1e3, cost_model="ema", trace=sink, warm_up=False)  # fmt: skip
    engine = Engine.load(config)
    try:
        outputs = run_staggered(engine, prompts, first=2, max_tokens=16)
    finally:
        engine.shutdown()
    for index, prompt in enumerate(prompts):
        assert outputs[index] == reference_tokens(tiny_qwen3, prompt, 16)
    planned = [e for e in sink.events if isinstance(e, StepPlanned) and e.contended and e.row_budget]
    untrained = [e for e in planned if e.budget_reason.startswith("contended-untrained")]
    assert untrained, "no contended step was planned before the cost model could price one"
    assert all(e.row_budget <= 64 for e in untrained)
    assert any(e.row_budget > 64 for e in planned if e.predicted_ms is not None)  # priced: the cap is gone
