"""Speculative decoding by prompt lookup: greedy requests verify drafted tokens in their decode lanes, and keep
mlx-lm's greedy tokens exactly, while fewer steps than tokens run (the tiny random model falls into loops, which
its own output's n-grams predict). Stops inside accepted drafts end the answer where mlx-lm's would end."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.types import GenerationRequest, SamplingParams
from tests.engine.reference import prompt_of, reference_tokens, run_staggered_counted

MAX_TOKENS = 80


def speculative_engine(path: Path, **settings) -> Engine:
    config = dict(kv_blocks=256, row_ceiling=32, row_floor=4, speculative_tokens=4)
    return Engine.load(EngineConfig(model=str(path), **{**config, **settings}))


@pytest.mark.parametrize("compile_decode", ["off", "on"])
def test_drafts_keep_mlx_lms_greedy_tokens_in_fewer_steps(tiny_qwen3, compile_decode):
    prompts = [prompt_of(n, seed=40 + i) for i, n in enumerate((30, 75, 12, 50))]
    engine = speculative_engine(tiny_qwen3, compile_decode=compile_decode)
    # staggered: later prompts are read in chunks beside the first ones' drafted decode lanes
    tokens, counters = run_staggered_counted(engine, prompts, first=2, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == reference_tokens(tiny_qwen3, prompt, MAX_TOKENS), f"prompt {i}"
    assert counters["accepted_draft_tokens"] > 0
    # every accepted draft is a token no step of its own had to make
    assert counters["decode_rows"] - counters["draft_tokens"] + counters["accepted_draft_tokens"] >= sum(
        len(t) - 1 for t in tokens.values())


def test_a_stop_token_or_the_length_limit_inside_accepted_drafts_ends_the_answer_there(tiny_qwen3):
    # an answer that loops through a dozen tokens, the loop's start already in the prompt: the answer's tokens are
    # drafted from their first occurrence on, so a stop token can end it inside a step's accepted drafts
    start = prompt_of(30, seed=61)
    prompt = start + reference_tokens(tiny_qwen3, start, 56)
    reference = reference_tokens(tiny_qwen3, prompt, MAX_TOKENS)
    engine = speculative_engine(tiny_qwen3)
    ended_in_drafts = []  # requests whose last step committed accepted drafts as well
    publish = engine._publish

    def recording(request, *committed):
        if request.is_finished and request.new_tokens > 1:
            ended_in_drafts.append(request.finish_reason.value)
        publish(request, *committed)

    engine._publish = recording
    try:
        cut = [GenerationRequest(prompt_ids=tuple(prompt), max_tokens=n) for n in (37, 61)]
        stopped = [GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS, stop_token_ids=(token,))
                   for token in sorted(set(reference))]  # fmt: skip
        done = engine.generate(cut + stopped)
        accepted = engine.status()["counters"]["accepted_draft_tokens"]
    finally:
        engine.shutdown()
    assert [list(c.token_ids) for c in done[:2]] == [reference[:37], reference[:61]]
    assert [c.finish_reason for c in done[:2]] == ["length", "length"]
    for completion, token in zip(done[2:], sorted(set(reference))):
        want = reference[: reference.index(token) + 1]
        assert list(completion.token_ids) == want and completion.finish_reason == "stop"
    assert accepted > 0 and {"stop", "length"} <= set(ended_in_drafts)


def test_a_stop_string_inside_accepted_drafts_cuts_the_text_as_without_drafts(tiny_qwen3):
    prompt = prompt_of(30, seed=42)
    plain = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=256))
    try:
        [whole] = plain.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS)])
        stop = whole.text[len(whole.text) * 2 // 3 :][:3]
        [want] = plain.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS, stop=(stop,))])
    finally:
        plain.shutdown()
    engine = speculative_engine(tiny_qwen3)
    try:
        [got] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS, stop=(stop,))])
    finally:
        engine.shutdown()
    assert (got.text, got.finish_reason) == (want.text, "stop") and stop not in got.text


def test_requests_with_logits_processors_are_never_drafted(tiny_qwen3):
    prompt = tuple(prompt_of(30, seed=61))  # its greedy answer loops: drafts would be proposed
    kinds = [SamplingParams(min_tokens=5), SamplingParams(repetition_penalty=1.2), SamplingParams(logit_bias={5: 2.0}),
             SamplingParams(presence_penalty=0.5)]  # fmt: skip
    engine = speculative_engine(tiny_qwen3)
    try:
        engine.generate([GenerationRequest(prompt_ids=prompt, max_tokens=40, sampling=s) for s in kinds])
        assert engine.status()["counters"]["draft_tokens"] == 0
    finally:
        engine.shutdown()


def test_drafts_under_preemption_keep_the_tokens(tiny_qwen3):
    prompts = [prompt_of(40, seed=50 + i) for i in range(6)]
    engine = speculative_engine(tiny_qwen3, kv_blocks=24, block_size=8, speculative_tokens=6)
    try:
        done = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=MAX_TOKENS) for p in prompts])
        counters = engine.status()["counters"]
    finally:
        engine.shutdown()
    assert counters["preemptions"] > 0 and counters["accepted_draft_tokens"] > 0
    for prompt, completion in zip(prompts, done):
        assert list(completion.token_ids) == reference_tokens(tiny_qwen3, prompt, MAX_TOKENS)


def test_bad_speculative_settings_are_refused():
    with pytest.raises(InvalidRequest, match="speculative_tokens must be a whole number"):
        Engine.load(EngineConfig(model="/nonexistent", speculative_tokens=-1))
    with pytest.raises(InvalidRequest, match="speculative_ngram must be >= 1"):
        Engine.load(EngineConfig(model="/nonexistent", speculative_ngram=0))


def test_drafts_in_the_cuda_layout_keep_the_tokens(tiny_qwen3):
    """As on CUDA: drafted lanes laid out as bucketed chunks reading their history through the block table, decode
    steps without drafts replaying a compiled graph."""
    from mlx_serve.kernels.paged_gather import table_gather
    from tests.engine.reference import generate_in_cuda_layout

    prompts = [prompt_of(30, seed=61), prompt_of(40, seed=49)]  # answers that loop: drafts are accepted
    engine = speculative_engine(tiny_qwen3, compile_decode="on", warm_up=False)
    tokens = generate_in_cuda_layout(engine, prompts, MAX_TOKENS, table_gather)
    assert engine.status()["counters"]["accepted_draft_tokens"] > 0
    for prompt, got in zip(prompts, tokens):
        assert got == reference_tokens(tiny_qwen3, prompt, MAX_TOKENS)


def test_accepted_drafts_carry_the_log_probabilities_a_plain_step_gives(tiny_qwen3):
    prompts = [prompt_of(30, seed=61), prompt_of(40, seed=49)]
    requests = [GenerationRequest(prompt_ids=tuple(p), max_tokens=MAX_TOKENS, sampling=SamplingParams(logprobs=3))
                for p in prompts]  # fmt: skip
    results = {}
    for drafts in (0, 4):
        engine = speculative_engine(tiny_qwen3, speculative_tokens=drafts)
        try:
            handles = [engine.submit(r) for r in requests]
            results[drafts] = [[e for e in h if e.token_id is not None] for h in handles]
            accepted = engine.status()["counters"]["accepted_draft_tokens"]
        finally:
            engine.shutdown()
    assert accepted > 0
    for plain, drafted in zip(results[0], results[4]):
        assert [e.token_id for e in drafted] == [e.token_id for e in plain]
        np.testing.assert_allclose([e.logprob for e in drafted], [e.logprob for e in plain], atol=1e-5)
        for a, b in zip(drafted, plain):
            assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=0.9,
                                                                                                  top_p=0.8)])
@pytest.mark.parametrize("draft", [0, 3, 7])
def test_a_sampled_drafts_verdict_leaves_each_token_distributed_as_the_target(params, draft):
    """Monte Carlo over 40,000 verdicts of one row: the emitted token (the draft where kept, else the replacement)
    follows the request's own target distribution, whether the draft is likely, unlikely or filtered out."""
    from mlx_serve.sampling import RequestSampler, _target, draft_verdict

    mx.random.seed(0)
    logits = mx.random.normal((1, 8)) * 2
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampler = RequestSampler.create(SamplingParams(seed=11, **params))
    rows = mx.broadcast_to(logprobs, (40_000, 8))
    kept, tokens = draft_verdict(sampler, rows, mx.full((40_000,), draft, dtype=mx.int32))
    emitted = np.array(mx.where(kept, draft, tokens))
    target = np.array(mx.softmax(_target(sampler.params, logprobs), axis=-1))[0]
    np.testing.assert_allclose(np.bincount(emitted, minlength=8) / 40_000, target, atol=0.012)


def test_sampled_requests_draft_too_deterministically_and_as_greedy_at_a_tiny_temperature(tiny_qwen3):
    prompt = prompt_of(30, seed=61)
    near_greedy = GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS,
                                    sampling=SamplingParams(temperature=1e-4, seed=3))  # fmt: skip
    sampled = GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS,
                                sampling=SamplingParams(temperature=0.3, seed=5))  # fmt: skip
    runs = []
    for _ in range(2):
        engine = speculative_engine(tiny_qwen3)
        try:
            runs.append([list(c.token_ids) for c in engine.generate([near_greedy, sampled])])
            accepted = engine.status()["counters"]["accepted_draft_tokens"]
        finally:
            engine.shutdown()
        assert accepted > 0
    assert runs[0] == runs[1]  # a seed gives the same answer, drafts and all
    assert runs[0][0] == reference_tokens(tiny_qwen3, prompt, MAX_TOKENS)
