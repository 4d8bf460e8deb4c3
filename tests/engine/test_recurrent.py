"""Models with recurrent layers beside attention (`mlx_serve.recurrent`): Qwen3-Next, Qwen3.5 (dense and MoE) and OLMo
Hybrid (gated delta nets), LFM2 (dense and MoE: short convolutions), Granite 4 and Nemotron-H (Mamba-2: Nemotron-H's
MLP and MoE blocks take no cache, so caches and layers are counted apart) and Jamba (Mamba). Every
request's state lives in a slot of the state pool and its rows reach the mixers lane by lane: tokens and their
log-probabilities are mlx-lm's, with prompts read in chunks beside decoding streams, a one-token prompt among the
decode lanes, preemption, cancellations, slots reused and a prefix hit that starts from a state snapshot; what such a
model cannot do is refused at load, with the reason."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.kernels.paged_gather import table_gather
from mlx_serve.model_loading import kept_bytes
from mlx_serve.recurrent import StatePool, recurrent_layers, state_shapes
from mlx_serve.server.metrics import EngineStatsCollector
from mlx_serve.types import GenerationRequest, SamplingParams
from scheduler.plan import Lane, LaneKind, SnapshotPoint
from tests.engine.reference import (
    generate_in_cuda_layout,
    load_reference,
    prompt_of,
    reference_tokens,
    run_next_turn,
)

FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "granitemoehybrid", "olmo_hybrid", "nemotron_h",
            "falcon_h1", "mamba", "mamba2", "jamba", "rwkv7"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recurrent")
    return {family: make_checkpoint(root / family, arch=family, seed=3) for family in FAMILIES}


def reference_run(path: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy tokens and each one's log-probability (its generate_step, one request alone)."""
    from mlx_lm.generate import generate_step

    model, _ = load_reference(str(path))
    tokens, logprobs = [], []
    for token, row in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(int(token))
        logprobs.append(float(row[int(token)]))
    return tokens, logprobs


def _load(path: Path, **options) -> Engine:
    defaults = dict(model=str(path), block_size=16, kv_blocks=64, row_ceiling=24, row_floor=4, warm_up=False)
    return Engine.load(EngineConfig(**{**defaults, **options}))


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_and_their_log_probabilities_are_mlx_lms_beside_each_other(checkpoints, family):
    """Prompts of 1 (read among the decode lanes), 9, 40 and 75 tokens (read 24 rows a step beside the others'
    decoding): each one's tokens and log-probabilities are mlx-lm's for it alone."""
    path = checkpoints[family]
    prompts = [prompt_of(n, seed=600 + i) for i, n in enumerate((9, 75, 1, 40))]
    engine = _load(path, max_running=4)
    try:
        requests = [GenerationRequest(prompt_ids=tuple(p), max_tokens=12, ignore_eos=True,
                                      sampling=SamplingParams(logprobs=0)) for p in prompts]  # fmt: skip
        completions = engine.generate(requests)
        assert engine.status()["recurrent_state"]["slots_in_use"] == 0
    finally:
        engine.shutdown()
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        tokens, logprobs = reference_run(path, prompt, 12)
        assert list(completion.token_ids) == tokens, f"prompt {i}"
        np.testing.assert_allclose(completion.logprobs, logprobs, atol=2e-5, err_msg=f"prompt {i}")


def test_a_preempted_request_reads_its_prompt_again_from_a_fresh_state(checkpoints):
    # 10 blocks of 16 = 160 tokens of KV for 6 requests needing 60-75 each: some are preempted and recomputed
    path = checkpoints["qwen3_next"]
    prompts = [prompt_of(30 + 3 * i, seed=610 + i) for i in range(6)]
    engine = _load(path, kv_blocks=10)
    try:
        completions = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=30) for p in prompts])
        counters = engine.stats()
    finally:
        engine.shutdown()
    assert counters["preemptions_total"] > 0  # the pool really ran out
    for prompt, completion in zip(prompts, completions):
        assert list(completion.token_ids) == reference_tokens(path, prompt, 30)


def test_cancelled_requests_give_their_slots_back(checkpoints):
    """Two slots; ten requests cancelled after their first token or while queued, then two more: every slot comes
    back, and the last two still get mlx-lm's tokens (a reused slot starts from zeros)."""
    path = checkpoints["lfm2"]
    engine = _load(path, max_running=2)
    try:
        assert engine.status()["recurrent_state"]["slots"] == 2
        for round_ in range(5):
            handles = [engine.submit(GenerationRequest(prompt_ids=tuple(prompt_of(30, seed=620 + 2 * round_ + i)),
                                                       max_tokens=100, ignore_eos=True)) for i in range(2)]  # fmt: skip
            next(iter(handles[0]))
            for handle in handles:
                handle.cancel()
        prompts = [prompt_of(n, seed=630 + i) for i, n in enumerate((33, 18))]
        completions = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=10) for p in prompts])
        assert engine.status()["recurrent_state"]["slots_in_use"] == 0
        gauges = {m.name: m.samples[0].value for m in EngineStatsCollector(engine.stats).collect()}
        assert gauges["mlx_serve_recurrent_state_slots"] == 2 and gauges["mlx_serve_recurrent_state_slots_used"] == 0
    finally:
        engine.shutdown()
    for prompt, completion in zip(prompts, completions):
        assert list(completion.token_ids) == reference_tokens(path, prompt, 10)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_longer_prompt_over_the_same_start_restores_a_snapshot_and_gives_mlx_lms_tokens(checkpoints, family):
    """The first prompt's chunks (24 rows) leave snapshots at 16 and 32 (its last full block): the second, its 37
    tokens and 23 more, hits 32 tokens of KV and starts from the snapshot there."""
    path = checkpoints[family]
    first = prompt_of(37, seed=640)
    longer = first + prompt_of(23, seed=641)
    engine = _load(path)
    try:
        [_] = engine.generate([GenerationRequest(prompt_ids=tuple(first), max_tokens=4)])
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(longer), max_tokens=10, ignore_eos=True,
                                                    sampling=SamplingParams(logprobs=0))])  # fmt: skip
        stats, status = engine.stats(), engine.status()["recurrent_state"]
    finally:
        engine.shutdown()
    assert stats["prefix_hit_tokens_total"] == 32
    assert status["snapshots"] == 64 and status["snapshots_kept"] == stats["recurrent_snapshots_kept"] >= 3
    tokens, logprobs = reference_run(path, longer, 10)
    assert list(done.token_ids) == tokens
    np.testing.assert_allclose(done.logprobs, logprobs, atol=2e-5)


def test_a_chats_next_turn_reads_only_past_its_last_snapshot(checkpoints):
    path = checkpoints["qwen3_next"]
    follow, tokens, hits = run_next_turn(_load(path), prompt_of(70, seed=642), prompt_of(12, seed=643))
    assert hits == 64  # the first turn's prompt up to its last full block
    assert tokens == reference_tokens(path, follow, 8)


@pytest.mark.parametrize("family", ["qwen3_next", "falcon_h1"])
def test_a_chats_next_turn_goes_on_from_the_snapshot_its_answer_left(checkpoints, family):
    """The first turn's 40-token prompt leaves a snapshot at 32; its 30-token answer's decode rows leave one where they
    end a block (48, then 64, which replaces it): the next turn (the prompt, the answer, 9 more) reads from 64."""
    path = checkpoints[family]
    first = prompt_of(40, seed=680)
    engine = _load(path)
    try:
        [answer] = engine.generate([GenerationRequest(prompt_ids=tuple(first), max_tokens=30, ignore_eos=True)])
        follow = first + list(answer.token_ids) + prompt_of(9, seed=681)
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(follow), max_tokens=8, ignore_eos=True,
                                                    sampling=SamplingParams(logprobs=0))])  # fmt: skip
        hits = engine.stats()["prefix_hit_tokens_total"]
    finally:
        engine.shutdown()
    assert hits == 64
    tokens, logprobs = reference_run(path, follow, 8)
    assert list(done.token_ids) == tokens
    np.testing.assert_allclose(done.logprobs, logprobs, atol=2e-5)


def test_without_snapshots_a_repeated_prompt_is_read_again(checkpoints):
    """A state is not paged by position: without a snapshot a cached prefix's blocks cannot give it."""
    path = checkpoints["lfm2"]
    prompt = prompt_of(50, seed=644)
    engine = _load(path, state_snapshots=0)
    try:
        assert engine.runner.states.snapshots == 0
        first, second = (engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=8)])[0]
                         for _ in range(2))  # fmt: skip
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats["prefix_hit_tokens_total"] == 0
    assert stats["prompt_tokens_total"] == 2 * len(prompt)
    assert list(first.token_ids) == list(second.token_ids) == reference_tokens(path, prompt, 8)


def test_in_the_cuda_layout_attention_layers_read_bucketed_history_beside_the_states(checkpoints):
    """As on CUDA (prefill history padded to buckets, read through the block table); decode steps stay eager."""
    path = checkpoints["granitemoehybrid"]
    prompts = [prompt_of(n, seed=650 + i) for i, n in enumerate((20, 41, 7))]
    engine = _load(path, row_ceiling=16)
    assert engine.runner.compiled is None
    for prompt, got in zip(prompts, generate_in_cuda_layout(engine, prompts, 10, table_gather)):
        assert got == reference_tokens(path, prompt, 10)


@pytest.mark.parametrize("option", [dict(speculative_tokens=2), dict(adapter_memory_gb=1.0),
                                    dict(compile_decode="on"), dict(ane_lane="cpu")],
                         ids=["speculative_tokens", "lora", "compile_decode", "ane_lane"])  # fmt: skip
def test_what_a_recurrent_model_cannot_do_is_refused_at_load(checkpoints, option):
    param = {"adapter_memory_gb": "lora"}.get(next(iter(option)), next(iter(option)))
    with pytest.raises(InvalidRequest, match="not with a model of recurrent layers") as caught:
        _load(checkpoints["qwen3_next"], **option)
    assert caught.value.param == param


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_a_model_of_recurrent_layers_only_holds_no_kv_and_fills_its_contexts(checkpoints, family):
    """No layer keeps K/V: the pool's arrays are empty, its blocks (which still count positions for the scheduler)
    cost nothing, so every running request may fill its context; only the states come out of the budget."""
    engine = _load(checkpoints[family], kv_blocks=None, memory_budget_gb=0.25, max_running=3)
    try:
        assert engine.pool.layout.bytes_per_token() == 0 and engine.pool.nbytes == 0
        assert engine.pool.num_blocks == 3 * engine.context_length // 16
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_requests_state_is_what_mlx_lms_caches_hold_and_the_budget_keeps_it(checkpoints, family):
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    path = checkpoints[family]
    model, _ = load_reference(str(path))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt_of(5, seed=660))[None], cache=cache))
    parts = [part for c in cache for part in getattr(c, "caches", (c,))]  # Falcon-H1: a state and K/V a layer
    held = sum(a.nbytes for c in parts if type(c) is ArraysCache for a in c.cache if a is not None)
    engine = _load(path, max_running=3)
    try:
        assert engine.loaded.state_bytes == held
        assert engine.runner.states.nbytes == (3 + 3) * held  # 3 running requests' states, 3 snapshots
        assert kept_bytes(engine.config, engine.loaded) == 6 * held
        assert engine.pool.layout.recurrent == recurrent_layers(model)
        assert f"recurrent state {6 * held / (1 << 20):.1f} MiB = (3 requests + 3 snapshots)" in engine.allocation_summary()
    finally:
        engine.shutdown()


def test_the_state_pool_hands_out_slots_and_refuses_a_continuation_without_one(checkpoints):
    model, _ = load_reference(str(checkpoints["lfm2"]))
    pool = StatePool(state_shapes(model, recurrent_layers(model)), slots=2, snapshots=4)

    def lane(request_id: str, start: int, rows: int, **kwargs) -> Lane:
        return Lane(request_id, LaneKind.PREFILL, (5,) * rows, start, (), False, **kwargs)

    rows = pool.rows([lane("a", 0, 1), lane("b", 0, 20, snapshot=SnapshotPoint(16, 3, b"h"))], num_single=1)
    # b is read in two calls, split where it leaves its snapshot (snapshot slot 3: after the 2 running slots)
    assert [(g.row_start, g.lanes, g.rows) for g in rows.groups] == [(0, 1, 1), (1, 1, 16), (17, 1, 4)]
    assert rows.groups[1].snapshot_slots.tolist() == [2 + 3] and rows.groups[2].snapshot_slots is None
    assert sorted(rows.fresh.tolist()) == [0, 1] and rows.restore_to is None
    assert pool.rows([lane("b", 20, 3)], num_single=0).fresh is None  # b goes on from its state
    with pytest.raises(RuntimeError, match="every one of the 2 recurrent state slots is taken"):
        pool.slot("c", 0)
    with pytest.raises(RuntimeError, match="continues at position 7 with no recurrent state"):
        pool.slot("d", 7)
    pool.release("a")
    restored = pool.rows([lane("e", 32, 4, restore_slot=1)], num_single=0)  # a prefix hit starts e from snapshot 1
    assert restored.restore_to.tolist() == rows.groups[0].slots.tolist() and restored.restore_from.tolist() == [2 + 1]


def test_equal_chunks_of_several_prompts_go_through_a_mixer_as_one_batch(checkpoints):
    """Lanes whose chunks have as many rows, one after another, are one call ([lanes, rows]), as mlx-lm's batched
    prefill reads them; a lane split at its snapshot is not joined to its own first part, and the marks follow their
    lanes."""
    model, _ = load_reference(str(checkpoints["lfm2"]))
    pool = StatePool(state_shapes(model, recurrent_layers(model)), slots=7, snapshots=2)

    def lane(request_id: str, rows: int, **kwargs) -> Lane:
        return Lane(request_id, LaneKind.PREFILL, (5,) * rows, 0, (), False, **kwargs)

    lanes = [lane("a", 1), lane("b", 1), lane("c", 16), lane("d", 16, snapshot=SnapshotPoint(16, 1, b"h")),
             lane("e", 32, snapshot=SnapshotPoint(16, 0, b"i")), lane("f", 16), lane("g", 8)]
    rows = pool.rows(lanes, num_single=1)
    # a one-row prompt beside the decode lane; c, d and e's first part; e's rest with f; g alone
    assert [(g.row_start, g.lanes, g.rows) for g in rows.groups] == [(0, 2, 1), (2, 3, 16), (50, 2, 16), (82, 1, 8)]
    assert rows.groups[1].snapshot_lanes.tolist() == [1, 2] and rows.groups[1].snapshot_slots.tolist() == [8, 7]
    assert rows.groups[2].snapshot_lanes is None
    slot = {request: pool.slot(request, 16) for request in "abcdefg"}
    assert rows.groups[1].slots.tolist() == [slot["c"], slot["d"], slot["e"]]
    assert rows.groups[2].slots.tolist() == [slot["e"], slot["f"]]


def test_a_step_whose_submission_failed_leaves_no_snapshot_slot_held(checkpoints, monkeypatch):
    """b restores a's snapshot and is to leave its own; its step fails before it runs. b errors, its state slot and
    the snapshots' pins come back, and c (b's prompt again) restores a's snapshot and gets mlx-lm's tokens."""
    path = checkpoints["qwen3_next"]
    first = prompt_of(37, seed=670)
    longer = first + prompt_of(30, seed=671)
    engine = _load(path)
    try:
        [_] = engine.generate([GenerationRequest(prompt_ids=tuple(first), max_tokens=2)])
        original = engine.runner.submit

        def failing(plan, previous=None):
            if any(lane.restore_slot is not None for lane in plan.lanes):
                monkeypatch.setattr(engine.runner, "submit", original)
                raise RuntimeError("injected device failure")
            return original(plan, previous)

        monkeypatch.setattr(engine.runner, "submit", failing)
        [failed] = engine.generate([GenerationRequest(prompt_ids=tuple(longer), max_tokens=4)])
        assert failed.finish_reason == "error"
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(longer), max_tokens=8)])
        engine.scheduler.snapshots.check_invariants()
        # a's at 16 and 32, c's at 48 and 64 (b's reservation of 48 was dropped with its step)
        assert engine.status()["recurrent_state"]["snapshots_kept"] == 4
        assert engine.status()["recurrent_state"]["slots_in_use"] == 0
        assert engine.stats()["prefix_hit_tokens_total"] == 2 * 32  # b's hit and c's, both on a's snapshot
    finally:
        engine.shutdown()
    assert list(done.token_ids) == reference_tokens(path, longer, 8)


def test_a_budget_the_states_crowd_out_says_which_settings_free_it(checkpoints):
    """2,000 running requests' states and as many snapshots (about 150 MiB of the tiny model's 38 KiB states) leave
    a 0.1 GiB budget no room for KV: the error names the states' share and the two settings that shrink it."""
    from mlx_serve.errors import MlxServeError

    path = checkpoints["qwen3_next"]
    with pytest.raises(MlxServeError, match=r"2000 requests' recurrent states and 2000 snapshots.*--state-snapshots"):
        Engine.load(EngineConfig(model=str(path), memory_budget_gb=0.1, max_running=2000, warm_up=False))
    engine = Engine.load(EngineConfig(model=str(path), memory_budget_gb=0.1, max_running=16, warm_up=False))
    engine.shutdown()
