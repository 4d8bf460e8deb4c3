"""Sliding-window layers' KV in the pool's window space (each request holds only the blocks its windows reach): mlx-lm's
tokens for every windowed family, with a space far smaller than the prompts (so blocks are freed and reused while
requests run, and requests are preempted for room), through compiled decode steps, and across prefix-cache hits; the
pool sized from the budget gives the full-attention layers what the window space saves."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.kernels.paged_gather import table_gather
from mlx_serve.model_loading import kv_pool_size, load_model
from mlx_serve.types import GenerationRequest
from tests.engine.reference import (
    generate_in_cuda_layout,
    prompt_of,
    reference_tokens,
    run_next_turn,
    run_staggered,
    run_staggered_counted,
)

WINDOWED = ["gemma3", "olmo3", "cohere2", "gpt_oss", "ministral3", "llama4", "gemma4_text", "gemma3n"]  # every preset's window: 16 tokens


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {family: make_checkpoint(root / family, arch=family, seed=3) for family in WINDOWED}


def tight(path: Path, **settings) -> EngineConfig:
    """A window space of 4 blocks: two requests' windows, so three prompts of 30-75 tokens take turns in it."""
    base = dict(model=str(path), block_size=16, kv_blocks=64, window_kv_tokens=64, row_ceiling=24, row_floor=4,
                warm_up=False)  # fmt: skip
    return EngineConfig(**(base | settings))


@pytest.mark.parametrize("family", WINDOWED)
def test_a_small_window_space_serves_mlx_lms_tokens(checkpoints, family):
    path = checkpoints[family]
    prompts = [prompt_of(n, seed=600 + i) for i, n in enumerate((30, 75, 50))]
    engine = Engine.load(tight(path))
    try:
        assert engine.pool.window_blocks == 4
        # the windowed layers' arrays hold the window space's blocks (and its scratch block), the others the pool's
        shapes = {engine.pool.keys[layer].shape[0] for layer in range(len(engine.pool.keys))}
        assert shapes == {5 * 16, 65 * 16}
        tokens = run_staggered(engine, prompts, first=1, max_tokens=24)
        status, stats = engine.status(), engine.stats()
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert tokens[i] == reference_tokens(path, prompt, 24), f"prompt {i}"
    assert status["kv"]["window_blocks_total"] == 4 and status["kv"]["window_blocks_used"] == 0
    assert stats["window_blocks_total"] == 4 and stats["window_blocks_cached"] > 0  # /metrics' gauges


@pytest.mark.parametrize("family", ["cohere2", "gpt_oss"])
def test_drafted_rows_in_a_window_space_of_three_blocks_keep_mlx_lms_tokens(checkpoints, family):
    """Speculative decoding's drafted rows take window-space blocks too, and a rejected draft's rows are written over:
    four requests in a space of three blocks (they take turns, one is preempted for room), mlx-lm's tokens."""
    path = checkpoints[family]
    prompts = [prompt_of(n, seed=40 + i) for i, n in enumerate((30, 75, 12, 50))]
    engine = Engine.load(tight(path, window_kv_tokens=48, speculative_tokens=4, row_ceiling=32))
    tokens, counters = run_staggered_counted(engine, prompts, first=2, max_tokens=80)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == reference_tokens(path, prompt, 80), f"prompt {i}"
    assert counters["accepted_draft_tokens"] > 0


def test_compiled_decode_steps_read_the_window_space(checkpoints):
    path = checkpoints["gemma3"]
    prompts = [prompt_of(n, seed=610 + i) for i, n in enumerate((40, 21, 66))]
    engine = Engine.load(tight(path, compile_decode="on", window_kv_tokens=96, row_ceiling=16))
    assert engine.runner.compiled is not None and engine.pool.window_blocks == 6
    tokens = generate_in_cuda_layout(engine, prompts, 12, table_gather)
    assert engine.runner.compiled.shapes, "no decode step replayed a compiled graph"
    for prompt, got in zip(prompts, tokens):
        assert got == reference_tokens(path, prompt, 12)


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "llama4", "gemma4_text"])
def test_a_continuation_reads_its_cached_prefix_from_both_spaces(checkpoints, family):
    """A chat's next turn repeats the last one's tokens: the prefix comes from the cache (the full layers' blocks and
    the window's last blocks), and the tokens are still mlx-lm's."""
    path = checkpoints[family]
    engine = Engine.load(tight(path, window_kv_tokens=160))
    follow, tokens, hits = run_next_turn(engine, prompt_of(70, seed=620), prompt_of(20, seed=621))
    assert hits >= 64, "the continuation computed its cached prefix again"
    assert tokens == reference_tokens(path, follow, 8)


def test_the_budget_gives_the_full_layers_what_the_window_space_saves(checkpoints):
    config = EngineConfig(model=str(checkpoints["gemma3"]), memory_budget_gb=0.05, max_running=32, warm_up=False)
    loaded = load_model(config)
    whole = kv_pool_size(replace(config, window_kv_tokens=0), loaded)
    auto = kv_pool_size(config, loaded)
    assert whole.window_blocks == 0
    # auto: every running request's window twice over and a chunk, 2 x 32 x (16 + 16) + 2,048 tokens
    assert auto.window_blocks == (2 * 32 * 32 + 2048) // 16
    # half the layers are windowed: the full ones get nearly twice the blocks the pool had for all of them
    assert auto.blocks > 1.8 * whole.blocks
    layout = loaded.layout
    spent = auto.blocks * (layout.bytes_per_token() - layout.windowed_bytes_per_token()) \
        + auto.window_blocks * layout.windowed_bytes_per_token()
    assert spent <= whole.blocks * layout.bytes_per_token() + layout.bytes_per_token(), "over the budget"
    # where twice every running request's window is more than the pool would give those layers, once; past that, none
    single = whole.blocks * 16  # the pool's tokens without a window space
    once = replace(config, max_running=(single - 2048) // 32 - 1)  # its windows fit once, not twice
    assert kv_pool_size(once, loaded).window_blocks == -(-(once.max_running * 32 + 2048) // 16)
    assert kv_pool_size(replace(config, max_running=single // 32), loaded).window_blocks == 0
    with pytest.raises(InvalidRequest, match="cannot hold one request's window of 16 tokens"):
        kv_pool_size(replace(config, window_kv_tokens=8), loaded)
    engine = Engine.load(replace(config, window_kv_tokens=0))
    try:  # off: serve says so, and how to turn it on
        assert "sliding-window layers keep every token's KV (--window-kv-tokens N" in engine.allocation_summary()
    finally:
        engine.shutdown()


def test_a_model_without_windows_has_no_window_space(tmp_path):
    path = make_checkpoint(tmp_path / "qwen3", arch="qwen3", seed=0)
    engine = Engine.load(EngineConfig(model=str(path), kv_blocks=32, window_kv_tokens=64, warm_up=False))
    try:
        assert engine.pool.window_blocks == 0 and engine.scheduler.window_space is None
        assert "window" not in str(engine.status()["kv"])
    finally:
        engine.shutdown()


def test_a_steps_window_reads_and_masks_are_built_once_for_all_its_windowed_layers(checkpoints, monkeypatch):
    """Llama 4's three chunked layers read the same positions a step: the slots and masks are built by the first and
    shared (on CUDA each one built again is a few more kernels a layer to launch)."""
    from mlx_serve import ragged

    built: dict[str, list] = {"decode": [], "lane": []}
    real_reads, real_mask = ragged.decode_reads, ragged.windowed_lane_mask
    monkeypatch.setattr(ragged, "decode_reads", lambda rows, *a: built["decode"].append(rows) or real_reads(rows, *a))
    monkeypatch.setattr(ragged, "windowed_lane_mask", lambda lane, *a: built["lane"].append(lane) or real_mask(lane, *a))
    path = checkpoints["llama4"]
    prompts = [prompt_of(n, seed=630 + i) for i, n in enumerate((40, 21))]
    engine = Engine.load(tight(path))
    try:
        tokens = run_staggered(engine, prompts, first=1, max_tokens=6)
    finally:
        engine.shutdown()
    assert tokens[1] == reference_tokens(path, prompts[1], 6)
    assert "; chunked-attention layers 4 blocks (64 tokens" in engine.allocation_summary()
    for kind, inputs in built.items():
        assert inputs, f"no step built {kind} reads"
        assert len({id(x) for x in inputs}) == len(inputs), f"a step built its {kind} reads more than once"


def test_layers_that_read_another_layers_kv_take_its_gathered_window(checkpoints, monkeypatch):
    """Gemma 4's shared sliding layer attends over its owner's window: the owner's gather serves both, no second
    gather of the same pool array in a step."""
    from mlx_serve import ragged

    gathered = []
    real_take = ragged._take_kv
    def take(keys, values, slots):  # the step's slots are built once a step: (pool array, slots) names one gather
        gathered.append((keys, slots))
        return real_take(keys, values, slots)

    monkeypatch.setattr(ragged, "_take_kv", take)
    path = checkpoints["gemma4_text"]
    prompt = prompt_of(30, seed=640)
    engine = Engine.load(tight(path))
    try:
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=6)])
    finally:
        engine.shutdown()
    assert list(done.token_ids) == reference_tokens(path, prompt, 6)
    assert gathered, "no decode step gathered a window"
    assert len({(id(keys), id(slots)) for keys, slots in gathered}) == len(gathered), "a window was gathered twice"
