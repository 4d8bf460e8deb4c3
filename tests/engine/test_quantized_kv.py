"""KV stored quantized (`--kv-bits`, mlx-lm's QuantizedKVCache and quantized attention): mlx-lm's greedy tokens with its
quantized caches in the full-attention layers, for several families and both common widths, through compiled decode
steps and across prefix-cache hits; the pool sized from the budget holds several times the tokens; what cannot read
quantized KV is refused with the reason."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.model_loading import kv_pool_size, load_model
from tests.engine.reference import (
    generate_in_cuda_layout,
    prompt_of,
    reference_tokens,
    run_next_turn,
    run_staggered,
)

FAMILIES = ["qwen3", "llama", "mixtral", "gemma3", "gemma4"]  # gemma3, gemma4: windowed layers stay in the model's dtype


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized-kv")
    return {family: make_checkpoint(root / family, arch=family, seed=5) for family in FAMILIES}


def quantized(path: Path, bits: int, **settings) -> EngineConfig:
    base = dict(model=str(path), block_size=16, kv_blocks=64, row_ceiling=24, row_floor=4, kv_bits=bits,
                kv_group_size=32, warm_up=False)  # fmt: skip
    return EngineConfig(**(base | settings))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_kv_gives_mlx_lms_tokens_with_its_quantized_caches(checkpoints, family, bits):
    path = checkpoints[family]
    prompts = [prompt_of(n, seed=800 + i) for i, n in enumerate((30, 75, 50))]
    engine = Engine.load(quantized(path, bits))
    try:
        assert engine.pool.layout.bits == bits
        tokens = run_staggered(engine, prompts, first=1, max_tokens=20)
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert tokens[i] == reference_tokens(path, prompt, 20, kv_bits=bits, kv_group_size=32), f"prompt {i}"


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_compiled_decode_steps_over_quantized_kv(checkpoints, family):
    """As on CUDA (history padded to buckets, decode steps replaying a compiled graph): the fused forward and the paged
    kernels read KV in the model's dtype, so quantized KV takes mlx-lm's attention through the block tables."""
    path = checkpoints[family]
    prompts = [prompt_of(n, seed=810 + i) for i, n in enumerate((40, 21, 66))]
    engine = Engine.load(quantized(path, 8, kv_blocks=None, compile_decode="on", row_ceiling=16))
    assert engine.runner.compiled is not None and engine.runner.prefill_gather is None
    tokens = generate_in_cuda_layout(engine, prompts, 12)
    assert engine.runner.compiled.shapes, "no decode step replayed a compiled graph"
    for prompt, got in zip(prompts, tokens):
        assert got == reference_tokens(path, prompt, 12, kv_bits=8, kv_group_size=32)


def test_a_continuation_reads_its_quantized_prefix_from_the_cache(checkpoints):
    path = checkpoints["qwen3"]
    engine = Engine.load(quantized(path, 8))
    follow, tokens, hits = run_next_turn(engine, prompt_of(70, seed=820), prompt_of(20, seed=821))
    assert hits >= 64
    assert tokens == reference_tokens(path, follow, 8, kv_bits=8, kv_group_size=32)


def test_the_budget_holds_several_times_the_tokens(checkpoints):
    config = EngineConfig(model=str(checkpoints["qwen3"]), memory_budget_gb=0.05, max_running=1024, warm_up=False)
    loaded = load_model(config)
    plain = kv_pool_size(config, loaded).blocks
    eight = kv_pool_size(replace(config, kv_bits=8, kv_group_size=32), replace(loaded, layout=replace(
        loaded.layout, bits=8, group_size=32))).blocks  # fmt: skip
    # float32 heads of 32: 128 bytes a head, against 32 packed + a float32 scale and bias (40)
    assert eight >= 3 * plain
    engine = Engine.load(quantized(checkpoints["qwen3"], 8, kv_blocks=8))
    try:
        assert engine.pool.nbytes == 9 * 16 * loaded.layout.num_layers * 2 * loaded.layout.num_kv_heads * 40
        assert "8-bit KV" in engine.allocation_summary()
        kv = engine.status()["kv"]
        assert (kv["bits"], kv["group_size"], kv["bytes_per_token"]) == (8, 32, loaded.layout.num_layers * 2 * 2 * 40)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_attention_that_cannot_read_quantized_kv_is_refused(tmp_path, family):
    path = make_checkpoint(tmp_path / family, arch=family, seed=0)
    with pytest.raises(InvalidRequest, match="cannot read quantized KV"):
        Engine.load(quantized(path, 8))


def test_bad_quantization_settings_are_refused(checkpoints):
    path = checkpoints["qwen3"]
    with pytest.raises(InvalidRequest, match="does not divide the head size 32"):
        Engine.load(quantized(path, 8, kv_group_size=64))
    with pytest.raises(InvalidRequest, match="kv_bits must be one of"):
        Engine.load(quantized(path, 7))
    with pytest.raises(InvalidRequest, match="cannot take the fused forward: its KV is quantized"):
        Engine.load(quantized(path, 8, compile_decode="on", fuse_decode="on"))
    with pytest.raises(InvalidRequest, match="--kv-bits cannot run with --ane-lane"):
        Engine.load(quantized(path, 8, ane_lane="cpu"))


def test_layers_that_read_another_layers_kv_are_refused_quantized_kv(tmp_path):
    path = make_checkpoint(tmp_path / "gemma4_text", arch="gemma4_text", seed=0)
    with pytest.raises(InvalidRequest, match="another layer's K/V") as caught:
        Engine.load(quantized(path, 8))
    assert caught.value.param == "kv_bits"
