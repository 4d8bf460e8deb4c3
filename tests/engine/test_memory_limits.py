"""An explicit memory budget holds MLX's allocator to it: its memory limit is the budget, and its cache of freed
buffers is what the budget leaves after the weights and the KV pool; without one only the cache is bounded; shutting
the engine down puts MLX's own limits back (they are process-wide)."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.memory_limits import UNBUDGETED_CACHE_SHARE
from mlx_serve.model_loading import GIB
from mlx_serve.types import GenerationRequest
from tests.engine.reference import prompt_of, reference_tokens


@pytest.fixture(autouse=True)
def _engines_of_other_tests_collected():
    """Engines other tests never shut down give MLX's limits back when collected: these tests start from MLX's own."""
    gc.collect()


def limits() -> tuple[int, int]:
    """MLX's memory and cache limits now (each read by setting it and putting it back)."""
    memory = mx.set_memory_limit(1 << 30)
    mx.set_memory_limit(memory)
    cache = mx.set_cache_limit(1 << 30)
    mx.set_cache_limit(cache)
    return memory, cache


def test_a_budget_holds_mlx_to_it_until_shutdown(tiny_qwen3):
    original_cache = mx.set_cache_limit(4 * GIB)  # as MLX's GPU backends keep it: as much as the memory limit
    before = limits()
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), memory_budget_gb=0.5, max_running=4))
    prompt = prompt_of(30, seed=130)
    try:
        memory, cache = limits()
        held = engine.loaded.weight_bytes + engine.pool.nbytes
        assert (memory, cache) == (GIB // 2, min(GIB // 2 - held, before[1]))  # never more cache than MLX kept
        assert "MLX memory limit 0.50 GiB, buffer cache" in engine.allocation_summary()
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=16)])
    finally:
        engine.shutdown()
        after = limits()
        mx.set_cache_limit(original_cache)
    assert list(done.token_ids) == reference_tokens(tiny_qwen3, prompt, 16)
    assert after == before


def test_without_a_budget_only_mlxs_buffer_cache_is_bounded(tiny_qwen3):
    """MLX's memory limit stands; its cache (as large as that limit on its GPU backends) gets half of what the limit
    leaves after the weights and the pool, so cached buffers never crowd the steps in flight out of the device."""
    original = limits()
    mx.set_memory_limit(2 * GIB)
    mx.set_cache_limit(2 * GIB)  # as MLX's GPU backends keep it
    before = limits()
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=32))
    prompt = prompt_of(30, seed=131)
    try:
        held = engine.loaded.weight_bytes + engine.pool.nbytes
        assert limits() == (2 * GIB, int((2 * GIB - held) * UNBUDGETED_CACHE_SHARE))
        assert "buffer cache" in engine.allocation_summary() and "memory limit" not in engine.allocation_summary()
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=16)])
    finally:
        engine.shutdown()
        after = limits()
        mx.set_memory_limit(original[0])
        mx.set_cache_limit(original[1])
    assert list(done.token_ids) == reference_tokens(tiny_qwen3, prompt, 16)
    assert after == before


def test_without_a_budget_a_smaller_mlx_cache_limit_stands(tiny_qwen3):
    """MLX's CPU backend keeps 32 MiB of cache: the bound never raises it."""
    original = limits()
    mx.set_cache_limit(32 << 20)
    before = limits()
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=32))
    try:
        assert limits() == before
    finally:
        engine.shutdown()
        mx.set_cache_limit(original[1])
    assert limits() == original


def test_an_engine_refused_or_never_shut_down_holds_no_limits(tiny_qwen3):
    before = limits()
    with pytest.raises(InvalidRequest, match="compile_mixed on needs fuse_mixed"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), memory_budget_gb=0.5, fuse_mixed="off", compile_mixed="on"))
    assert limits() == before  # refused after the model loaded: nothing held
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), memory_budget_gb=0.5, max_running=4, warm_up=False))
    assert limits()[0] == GIB // 2
    engine._stopping = True  # its thread ends; the engine itself is dropped without a shutdown
    engine._wakeup.set()
    engine._thread.join(5.0)
    del engine
    gc.collect()
    assert limits() == before


def test_engines_in_one_process_take_turns_with_mlxs_limits(tiny_qwen3):
    """MLX's limits are process-wide: the newest engine's hold, and the older one's shutdown does not undo them."""
    before = limits()
    first = Engine.load(EngineConfig(model=str(tiny_qwen3), memory_budget_gb=0.5, max_running=4, warm_up=False))
    second = Engine.load(EngineConfig(model=str(tiny_qwen3), memory_budget_gb=0.25, max_running=4, warm_up=False))
    try:
        assert limits()[0] == GIB // 4
        first.shutdown()
        assert limits()[0] == GIB // 4  # still the live engine's
    finally:
        first.shutdown()
        second.shutdown()
    assert limits() == before
