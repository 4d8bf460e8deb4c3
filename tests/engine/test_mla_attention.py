"""Multi-head latent attention (`mla_attention`: DeepSeek-V3, Kimi K2, GLM-4.7-Flash): the module's own forward per
lane group over the pool's latents and RoPE keys gives mlx-lm's tokens after preemption, with drafted rows and from a
prefix hit; the pool holds what mlx-lm's cache holds a token; what the lane-grouped forward cannot take is refused."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.types import GenerationRequest
from tests.engine.reference import load_reference, prompt_of, reference_tokens, run_next_turn


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mla") / "deepseek_v3", arch="deepseek_v3", seed=5)


def _load(path: Path, **options) -> Engine:
    defaults = dict(model=str(path), block_size=16, kv_blocks=64, row_ceiling=24, row_floor=4, warm_up=False)
    return Engine.load(EngineConfig(**{**defaults, **options}))


def test_preempted_requests_read_their_latents_again_and_give_mlx_lms_tokens(deepseek):
    prompts = [prompt_of(30 + 3 * i, seed=700 + i) for i in range(6)]
    engine = _load(deepseek, kv_blocks=10)  # 160 tokens of KV for 6 requests of 60-75
    try:
        completions = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=30) for p in prompts])
        preemptions = engine.stats()["preemptions_total"]
    finally:
        engine.shutdown()
    assert preemptions > 0
    for prompt, completion in zip(prompts, completions):
        assert list(completion.token_ids) == reference_tokens(deepseek, prompt, 30)


def test_drafted_rows_attend_as_a_lane_of_their_own_and_keep_mlx_lms_tokens(deepseek):
    prompt = prompt_of(12, seed=710) * 4  # repeats: prompt lookup finds drafts
    engine = _load(deepseek, speculative_tokens=3)
    try:
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=24)])
        drafted = engine.stats()["draft_tokens_total"]
    finally:
        engine.shutdown()
    assert drafted > 0
    assert list(done.token_ids) == reference_tokens(deepseek, prompt, 24)


def test_a_steps_latent_slot_table_is_built_once_for_all_its_layers(deepseek, monkeypatch):
    """Every latent layer of a step reads the decode lanes' histories through the same slots: built once a step."""
    from mlx_serve import mla_attention

    built = []
    real = mla_attention._decode_reads
    monkeypatch.setattr(mla_attention, "_decode_reads", lambda rows: built.append(rows) or real(rows))
    prompts = [prompt_of(n, seed=730 + i) for i, n in enumerate((20, 35))]
    engine = _load(deepseek)
    try:
        completions = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=6) for p in prompts])
    finally:
        engine.shutdown()
    assert list(completions[0].token_ids) == reference_tokens(deepseek, prompts[0], 6)
    assert built and len({id(rows) for rows in built}) == len(built), "a step built its slot table more than once"


def test_a_chats_next_turn_reads_its_cached_latents(deepseek):
    follow, tokens, hits = run_next_turn(_load(deepseek), prompt_of(40, seed=720), prompt_of(9, seed=721))
    assert hits >= 32
    assert tokens == reference_tokens(deepseek, follow, 8)


def test_a_token_holds_what_mlx_lms_latent_cache_holds(deepseek):
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load_reference(str(deepseek))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt_of(7, seed=730))[None], cache=cache))
    per_token = sum(c.keys[..., :7, :].nbytes + c.values[..., :7, :].nbytes for c in cache) // 7
    engine = _load(deepseek)
    try:
        layout = engine.pool.layout
        assert (layout.num_kv_heads, layout.head_dim, layout.value_dim) == (1, 32, 16)  # the latent, the RoPE key
        assert layout.bytes_per_token() == per_token
        assert engine.runner.kv_bucket == 0 and engine.runner.compiled is None
    finally:
        engine.shutdown()


@pytest.mark.parametrize("option", [dict(compile_decode="on"), dict(ane_lane="cpu"), dict(kv_bits=8),
                                    dict(adapter_memory_gb=1.0)],
                         ids=["compile_decode", "ane_lane", "kv_bits", "lora"])  # fmt: skip
def test_what_the_lane_grouped_forward_cannot_take_is_refused(deepseek, option):
    with pytest.raises(InvalidRequest, match="latent") as caught:
        _load(deepseek, **option)
    assert caught.value.param == {"adapter_memory_gb": "lora"}.get(next(iter(option)), next(iter(option)))


def test_an_adapter_loaded_while_serving_is_refused_too(deepseek, tmp_path):
    from mlx_serve.adapter_specs import AdapterSpec
    from mlx_serve.checkpoints.adapters import make_adapter

    adapter = make_adapter(deepseek, tmp_path / "adapter", keys=("self_attn.o_proj",))
    engine = _load(deepseek)
    try:
        with pytest.raises(InvalidRequest, match="regrouped by lane") as caught:
            engine.load_adapter(AdapterSpec("a", str(adapter)))
        assert caught.value.param == "lora" and engine.adapters == ()
    finally:
        engine.shutdown()


def test_the_expanded_form_caches_each_heads_key_and_shorter_value_and_refuses_quantized_kv(tmp_path):
    """DeepSeek-V2 up-projects the latent and caches every head's key (no-RoPE and RoPE parts) and value: the pool
    holds exactly that a token, and the layers attend through the dispatcher (compiled decode too, as on CUDA)."""
    from mlx_lm.models.cache import make_prompt_cache

    path = make_checkpoint(tmp_path / "deepseek_v2", arch="deepseek_v2", seed=5)
    model, _ = load_reference(str(path))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt_of(7, seed=740))[None], cache=cache))
    per_token = sum(c.keys[..., :7, :].nbytes + c.values[..., :7, :].nbytes for c in cache) // 7
    engine = _load(path, compile_decode="on")
    try:
        layout = engine.pool.layout
        assert (layout.num_kv_heads, layout.head_dim, layout.value_dim, layout.latent) == (4, 48, 24, False)
        assert layout.bytes_per_token() == per_token
        assert engine.runner.compiled is not None
        prompt = prompt_of(30, seed=741)
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=8)])
        assert engine.runner.compiled.shapes, "no decode step replayed a compiled graph"
    finally:
        engine.shutdown()
    assert list(done.token_ids) == reference_tokens(path, prompt, 8)
    with pytest.raises(InvalidRequest, match="two sizes") as caught:
        _load(path, kv_bits=8)
    assert caught.value.param == "kv_bits"


@pytest.mark.parametrize("family", ["deepseek_v2", "mimo_v2_flash"])
def test_values_of_another_size_attend_through_matmuls_off_the_cpu_and_keep_mlx_lms_tokens(tmp_path, monkeypatch, family):
    """MLX's fused attention failed at launch on CUDA over values shorter than their keys (DeepSeek-V2, thirty-sixth
    run): off the CPU those layers take `ragged.unfused_attention` (MiMo's sliding layers with their sinks too). Here
    the device check answers GPU while MLX still computes on the CPU: mlx-lm's tokens."""
    from mlx_serve import ragged

    path = make_checkpoint(tmp_path / family, arch=family, seed=6)
    prompts = [prompt_of(n, seed=750 + i) for i, n in enumerate((30, 9))]
    want = [reference_tokens(path, p, 8) for p in prompts]
    unfused = []
    real = ragged.unfused_attention
    monkeypatch.setattr(ragged, "unfused_attention", lambda *a, **k: unfused.append(1) or real(*a, **k))
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    engine = _load(path)
    try:
        completions = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=8) for p in prompts])
    finally:
        engine.shutdown()
    assert unfused, "no layer took the matmul form"
    assert [list(c.token_ids) for c in completions] == want


def test_unfused_attention_is_mlxs_fused_attention():
    from mlx_serve.ragged import unfused_attention

    mx.random.seed(0)
    q, k, v = mx.random.normal((1, 8, 5, 48)), mx.random.normal((1, 2, 12, 48)), mx.random.normal((1, 2, 12, 24))
    sinks = mx.random.normal((8,))
    for mask in (None, "causal", mx.random.normal((1, 1, 5, 12)), mx.random.uniform(shape=(1, 1, 5, 12)) > 0.3):
        for with_sinks in (None, sinks):
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask, sinks=with_sinks)
            np.testing.assert_allclose(unfused_attention(q, k, v, 0.2, mask, sinks=with_sinks), want, atol=1e-6)
