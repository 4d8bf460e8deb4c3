"""Speculative decoding with a draft model (`draft_model`, mlx-lm's --draft-model): a small model of the same
vocabulary drafts the tokens each decode lane verifies. Greedy answers stay mlx-lm's own, token for token, whatever
the draft says; a draft that agrees with the served model saves most steps; long prompts are read by the draft a
piece a step; its caches stay within the tokens kept for them and go with their requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.types import GenerationRequest, SamplingParams
from tests.engine.reference import prompt_of, reference_tokens, run_staggered, run_staggered_counted

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny qwen3 (its own weights, the same vocabulary): it seldom agrees with the served one."""
    return make_checkpoint(tmp_path_factory.mktemp("draft") / "q", arch="qwen3", seed=11)


def drafting_engine(model: Path, draft: Path, **settings) -> Engine:
    config = dict(kv_blocks=256, row_ceiling=32, row_floor=4, draft_model=str(draft))
    return Engine.load(EngineConfig(model=str(model), **{**config, **settings}))


@pytest.mark.parametrize("compile_decode", ["off", "on"])
def test_a_draft_of_the_same_weights_saves_steps_and_keeps_mlx_lms_tokens(tiny_qwen3, compile_decode):
    prompts = [prompt_of(n, seed=90 + i) for i, n in enumerate((30, 75, 12, 50))]
    engine = drafting_engine(tiny_qwen3, tiny_qwen3, compile_decode=compile_decode)
    try:
        tokens = run_staggered(engine, prompts, first=2, max_tokens=MAX_TOKENS)
        status, stats = engine.status(), engine.stats()
        counters, held = status["counters"], engine.drafter.held_tokens
    finally:
        engine.shutdown()
    assert status["draft_model"] == {"model": str(tiny_qwen3), "tokens_held": 0, "tokens_limit": 16384}
    assert (stats["draft_tokens_held"], stats["draft_tokens_limit"]) == (0, 16384)  # /metrics' gauges
    for i, prompt in enumerate(prompts):
        assert tokens[i] == reference_tokens(tiny_qwen3, prompt, MAX_TOKENS), f"prompt {i}"
    # the draft is the served model: (nearly) every draft is kept, 3 a step (mlx-lm's server default)
    assert counters["accepted_draft_tokens"] >= 0.9 * counters["draft_tokens"] > 0
    assert counters["decode_rows"] - counters["draft_tokens"] < 0.5 * sum(len(t) for t in tokens.values())
    assert held == 0  # every request's draft cache went with it


def test_a_draft_that_disagrees_changes_nothing_but_the_steps(tiny_qwen3, other_draft):
    prompts = [prompt_of(n, seed=100 + i) for i, n in enumerate((20, 64, 33))]
    engine = drafting_engine(tiny_qwen3, other_draft, speculative_tokens=5)
    engine.drafter.feed_per_step = 16  # the prompts are read a piece a step, beside the others' drafted lanes
    tokens, counters = run_staggered_counted(engine, prompts, first=1, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == reference_tokens(tiny_qwen3, prompt, MAX_TOKENS), f"prompt {i}"
    assert counters["draft_tokens"] > 0


def test_sampled_requests_draft_deterministically_with_a_seed(tiny_qwen3):
    engine = drafting_engine(tiny_qwen3, tiny_qwen3)
    request = GenerationRequest(prompt_ids=tuple(prompt_of(25, seed=110)), max_tokens=MAX_TOKENS,
                                sampling=SamplingParams(temperature=0.05, seed=7))  # fmt: skip
    try:
        first, second = (engine.generate([request])[0] for _ in range(2))
        counters = engine.status()["counters"]
    finally:
        engine.shutdown()
    assert first.token_ids == second.token_ids and len(first.token_ids) > 0
    # the random model's distributions are flat: only near greedy does a draft keep much of the target's mass
    assert counters["accepted_draft_tokens"] > 0


def test_requests_past_the_draft_caches_room_do_not_draft(tiny_qwen3):
    engine = drafting_engine(tiny_qwen3, tiny_qwen3, draft_kv_tokens=60)
    prompt = prompt_of(70, seed=120)
    done, counters, _ = _generate_one(engine, prompt)
    assert counters["draft_tokens"] == 0
    assert list(done.token_ids) == reference_tokens(tiny_qwen3, prompt, MAX_TOKENS)


def test_the_draft_and_its_caches_come_out_of_the_kv_pool(tiny_qwen3):
    from mlx_serve.model_loading import kv_pool_blocks

    engine = drafting_engine(tiny_qwen3, tiny_qwen3, kv_blocks=16, warm_up=False)
    engine.shutdown()
    loaded = engine.loaded
    block_bytes = loaded.layout.bytes_per_token() * 16

    def blocks(**settings) -> int:
        return kv_pool_blocks(EngineConfig(memory_budget_gb=0.25, max_running=10**6, **settings), loaded)

    # the draft is the served model's twin: its weights and a token of its caches cost what the served model's do
    assert loaded.draft_bytes_per_token == loaded.layout.bytes_per_token()
    assert blocks() - blocks(draft_model=str(tiny_qwen3), draft_kv_tokens=1) == pytest.approx(
        (loaded.weight_bytes + loaded.draft_bytes_per_token) * 0.9 / block_bytes, abs=1)
    assert blocks(draft_model=str(tiny_qwen3), draft_kv_tokens=1) - blocks(draft_model=str(tiny_qwen3),
                                                                           draft_kv_tokens=1000) == pytest.approx(
        999 * loaded.draft_bytes_per_token * 0.9 / block_bytes, abs=1)  # fmt: skip


def test_a_draft_the_engine_cannot_use_is_refused(tiny_qwen3, tmp_path):
    from mlx_serve.draft_model import check_draft_model
    from mlx_serve.model_loading import load_draft

    with pytest.raises(InvalidRequest, match="a draft must share the tokenizer"):
        check_draft_model(_model_of(tiny_qwen3), 7, tiny_qwen3)
    with pytest.raises(InvalidRequest, match="a draft must share the tokenizer"):
        load_draft(str(tiny_qwen3), 7)
    gemma = make_checkpoint(tmp_path / "g", arch="gemma3_text", seed=1)
    windowed = _model_of(gemma)
    with pytest.raises(InvalidRequest, match="cannot be cut back"):
        check_draft_model(windowed, int(windowed.args.vocab_size), gemma)
    with pytest.raises(InvalidRequest, match="draft_kv_tokens"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), draft_model=str(tiny_qwen3), draft_kv_tokens=-1))


def _generate_one(engine, prompt: list[int]):
    """One greedy request of MAX_TOKENS; its completion, the engine's counters and the tokens the draft caches still
    hold afterwards. Shuts the engine down."""
    try:
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS)])
        return done, engine.status()["counters"], engine.drafter.held_tokens
    finally:
        engine.shutdown()


def _model_of(path: Path):
    import mlx_lm

    return mlx_lm.load(str(path))[0]


def test_a_request_that_outgrows_the_draft_caches_room_stops_drafting(tiny_qwen3):
    engine = drafting_engine(tiny_qwen3, tiny_qwen3, draft_kv_tokens=50)
    prompt = prompt_of(20, seed=121)
    done, counters, held = _generate_one(engine, prompt)
    assert list(done.token_ids) == reference_tokens(tiny_qwen3, prompt, MAX_TOKENS)
    assert 0 < counters["draft_tokens"] and counters["decode_rows"] - counters["draft_tokens"] > 5  # drafted, then not
    assert held == 0


def test_a_failing_draft_model_costs_the_drafts_not_the_requests(tiny_qwen3):
    engine = drafting_engine(tiny_qwen3, tiny_qwen3)
    prompts = [prompt_of(20, seed=122), prompt_of(35, seed=123)]

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    engine.drafter.model = broken
    try:
        done = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=MAX_TOKENS) for p in prompts])
        counters, failure = engine.status()["counters"], engine.failure
    finally:
        engine.shutdown()
    assert failure is None and counters["draft_tokens"] == 0
    for prompt, completion in zip(prompts, done):
        assert list(completion.token_ids) == reference_tokens(tiny_qwen3, prompt, MAX_TOKENS)
    assert engine.drafter._failed == set()  # forgotten with their requests
