"""The fused decode forward: mlx-lm's tokens on quantized checkpoints, weights held once, clear refusals."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm import load

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.fused_decode import FusedDecode, unsupported_reason
from mlx_serve.kernels.decode_qkv import plain_qkv_rows
from mlx_serve.kernels.paged_attention import batched_decode_attention
from tests.engine.reference import prompt_of, reference_tokens, run_staggered


@pytest.mark.parametrize("fixture", ["tiny_qwen3_4bit", "tiny_qwen3_8bit", "tiny_qwen3_moe_4bit"])
def test_fused_decode_matches_mlx_lm_on_quantized_checkpoints(fixture, request):
    path = request.getfixturevalue(fixture)
    prompts = [prompt_of(n, seed=70 + n) for n in (23, 7, 41, 16, 30)]
    config = EngineConfig(model=str(path), row_ceiling=24, row_floor=1, compile_decode="on", fuse_decode="on")
    engine = Engine.load(config)
    try:
        assert engine.runner.compiled.fused is not None
        results = run_staggered(engine, prompts, first=2, max_tokens=12)
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_tokens(path, prompt, 12), f"request {i}"


def test_fusing_keeps_one_copy_of_the_weights_and_the_modules_outputs(tiny_qwen3):
    model, _ = load(str(tiny_qwen3))
    x = mx.random.normal((3, 1, model.args.hidden_size), key=mx.random.key(0))
    block = model.model.layers[0]
    before = [block.self_attn.k_proj(x), block.mlp.up_proj(x), model(mx.array([[1, 2, 3]]))]
    mx.eval(before)
    gc.collect()
    active = mx.get_active_memory()
    fused = FusedDecode(model, batched_decode_attention, plain_qkv_rows)
    gc.collect()
    weights = sum(layer.qkv.weight.nbytes + layer.gate_up.weight.nbytes for layer in fused.layers)
    # the projections are views of the fused arrays: what was freed pays for them
    assert mx.get_active_memory() - active < weights / 4
    after = [block.self_attn.k_proj(x), block.mlp.up_proj(x), model(mx.array([[1, 2, 3]]))]
    for a, b in zip(before, after):
        assert mx.array_equal(a, b).item()


def test_unknown_families_are_refused_with_the_reason(tiny_qwen2):
    model, _ = load(str(tiny_qwen2))
    assert "qwen2" in unsupported_reason(model)
    with pytest.raises(InvalidRequest, match="cannot take the fused forward.*qwen2"):
        Engine.load(EngineConfig(model=str(tiny_qwen2), compile_decode="on", fuse_decode="on"))
    # auto quietly keeps mlx-lm's modules
    engine = Engine.load(EngineConfig(model=str(tiny_qwen2), compile_decode="on", fuse_decode="auto"))
    try:
        assert engine.runner.compiled.fused is None
    finally:
        engine.shutdown()


def test_fused_decode_needs_compiled_steps(tiny_qwen3):
    with pytest.raises(InvalidRequest, match="compile"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), compile_decode="off", fuse_decode="on"))
