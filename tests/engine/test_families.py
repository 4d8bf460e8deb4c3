"""The mlx-lm families served beyond the five with real-size presets: on a dummy checkpoint of each (mlx-lm's layout,
written by `make_checkpoint`), staggered prompts read in chunks beside decoding streams give mlx-lm's greedy tokens,
and a scored prompt gives mlx-lm's log-probabilities (so each family's own head: Granite's logit scaling, MiniCPM's
hidden scaling, Cohere's logit scale, Gemma 2's logit soft-cap, tied embeddings). What the engine cannot serve is
refused at load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.checkpoints.presets import ARCHS, HF_ARCHS, MLX_FAMILIES
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import UnsupportedModel
from mlx_serve.kernels.paged_gather import table_gather
from mlx_serve.model_source import SUPPORTED_MODEL_TYPES, layer_windows
from mlx_serve.types import GenerationRequest, SamplingParams
from tests.engine.reference import (
    generate_in_cuda_layout,
    load_reference,
    prompt_of,
    reference_prompt_logprobs,
    reference_tokens,
    run_staggered,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_checkpoint(root / family, arch=family, seed=1) for family in MLX_FAMILIES}


def test_every_served_family_has_a_dummy_checkpoint_and_back():
    assert set(SUPPORTED_MODEL_TYPES) == set(ARCHS) == set(HF_ARCHS) | set(MLX_FAMILIES)


@pytest.mark.parametrize("family", list(MLX_FAMILIES))
def test_a_family_serves_mlx_lms_tokens_and_log_probabilities(checkpoints, family):
    path = checkpoints[family]
    prompts = [prompt_of(n, seed=500 + i) for i, n in enumerate((9, 70, 33))]
    engine = Engine.load(EngineConfig(model=str(path), block_size=16, kv_blocks=128, row_ceiling=24, row_floor=4))
    try:
        tokens = run_staggered(engine, prompts, first=1, max_tokens=10)
        scored = prompt_of(45, seed=510)
        request = GenerationRequest(prompt_ids=tuple(scored), max_tokens=1, sampling=SamplingParams(prompt_logprobs=0))
        [completion] = engine.generate([request])
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert tokens[i] == reference_tokens(path, prompt, 10), f"prompt {i}"
    reference = reference_prompt_logprobs(path, scored)
    want = reference[np.arange(len(scored) - 1), scored[1:]]
    np.testing.assert_allclose([e.logprob for e in completion.prompt_logprobs[1:]], want, atol=2e-5)


# the quantized products as CUDA runs them (K-split, dense from 16 rows, the tile and GEMV forms' CPU stand-ins)
CUDA_QUANTIZED = dict(split_quantized_k="on", dequantize_rows=16, compile_decode="on", quantized_tiles="on",
                      quantized_gemv="on")  # fmt: skip


@pytest.mark.parametrize("family", ["mixtral", "gemma3", "granite", "gemma2", "glm4_moe", "llama4"])
@pytest.mark.parametrize("options", [{}, CUDA_QUANTIZED], ids=["default", "cuda-quantized"])
def test_a_4_bit_family_matches_mlx_lm(tmp_path, family, options):
    path = make_checkpoint(tmp_path / f"{family}-4bit", arch=family, seed=2, quantize_bits=4, group_size=32)
    prompts = [prompt_of(n, seed=520 + i) for i, n in enumerate((12, 50))]
    engine = Engine.load(EngineConfig(model=str(path), block_size=16, kv_blocks=64, row_ceiling=16, row_floor=4,
                                      warm_up=False, **options))  # fmt: skip
    try:
        completions = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=8) for p in prompts])
    finally:
        engine.shutdown()
    for prompt, completion in zip(prompts, completions):
        assert list(completion.token_ids) == reference_tokens(path, prompt, 8)


def test_a_llama_config_with_sliding_window_layers_matches_mlx_lm(tmp_path):
    """Llama's `layer_types` (mlx-lm gives its sliding layers rotating caches of `sliding_window` tokens): prompts
    longer than the window, read in chunks beside a decoding stream, give mlx-lm's tokens."""
    path = make_checkpoint(tmp_path / "llama", arch="llama", seed=0)
    config = json.loads((path / "config.json").read_text())
    config.update(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    (path / "config.json").write_text(json.dumps(config))
    prompts = [prompt_of(n, seed=540 + i) for i, n in enumerate((30, 75))]
    engine = Engine.load(EngineConfig(model=str(path), block_size=16, kv_blocks=64, row_ceiling=24, row_floor=4))
    try:
        assert engine.pool.layout.windows == (16, None)
        tokens = run_staggered(engine, prompts, first=1, max_tokens=24)
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert tokens[i] == reference_tokens(path, prompt, 24)


def test_gemma4s_pool_holds_each_layers_own_heads_and_only_the_layers_that_keep_kv(checkpoints):
    """Gemma 4's full-attention layers keep wider heads (in the 26B form one, its keys also its values), and in the
    E2B form its last two layers read an earlier layer's K/V: the pool holds what mlx-lm's caches hold a token."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    for family, heads in [("gemma4_text", [(2, 32), (2, 32), (2, 64), (2, 32)]),
                          ("gemma4", [(2, 32), (2, 32), (1, 64), (2, 32), (2, 32), (1, 64)])]:
        heads = [(kv, size, size) for kv, size in heads]
        path = checkpoints[family]
        model, _ = load_reference(str(path))
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(prompt_of(7, seed=545))[None], cache=cache))
        per_token = sum(c.keys[..., :7, :].nbytes + c.values[..., :7, :].nbytes for c in cache) // 7
        engine = Engine.load(EngineConfig(model=str(path), block_size=16, kv_blocks=32, warm_up=False))
        try:
            layout = engine.pool.layout
            assert len(cache) == layout.num_layers == len(heads)
            assert [(*k.shape[1:], v.shape[2]) for k, v in zip(engine.pool.keys, engine.pool.values)] == heads
            assert heads == list(layout.layer_heads)
            assert layout.bytes_per_token() == per_token
        finally:
            engine.shutdown()


def test_caches_other_than_full_sliding_or_recurrent_are_refused():
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    class TwoCachesALayer:  # two K/V caches a layer (only a state beside K/V is served: Falcon-H1)
        def make_cache(self):
            return [KVCache(), CacheList(KVCache(), KVCache()), CacheList(ArraysCache(2), KVCache())]

    class KeepsSinks:
        def make_cache(self):
            return [RotatingKVCache(max_size=64, keep=4)]

    for model in (TwoCachesALayer(), KeepsSinks()):
        with pytest.raises(UnsupportedModel, match="engine does not serve"):
            layer_windows(model)


def test_an_unserved_family_is_refused_with_the_list(tmp_path):
    path = make_checkpoint(tmp_path / "qwen3", arch="qwen3", seed=0)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "bloom"}))
    with pytest.raises(UnsupportedModel, match="'bloom' is not supported; supported model types: llama"):
        Engine.load(EngineConfig(model=str(path), kv_blocks=16))


@pytest.mark.parametrize("family", ["granite", "cohere", "internlm2", "mixtral", "gemma3", "cohere2", "gpt_oss", "minimax",
                                    "gemma2", "llama4", "deepseek_v2", "minicpm3", "gemma4", "gemma3n", "exaone4", "gpt_neox"])
def test_a_family_in_the_cuda_layout_with_compiled_decode_steps(checkpoints, family):
    """As on CUDA: decode steps replay one compiled graph (the family's head traced in it), prefill history in
    buckets read through the block table. mlx-lm's tokens."""
    path = checkpoints[family]
    prompts = [prompt_of(n, seed=530 + i) for i, n in enumerate((20, 41, 7))]
    engine = Engine.load(EngineConfig(model=str(path), row_ceiling=16, row_floor=4, compile_decode="on",
                                      warm_up=False))  # fmt: skip
    assert engine.runner.compiled is not None
    tokens = generate_in_cuda_layout(engine, prompts, 10, table_gather)
    assert engine.runner.compiled.shapes, "no decode step replayed a compiled graph"
    for prompt, got in zip(prompts, tokens):
        assert got == reference_tokens(path, prompt, 10)


def test_a_multimodal_checkpoint_takes_its_text_models_context(tmp_path):
    """Gemma 3's multimodal config keeps max_position_embeddings in text_config: the context is that one."""
    path = make_checkpoint(tmp_path / "gemma3", arch="gemma3", seed=0)
    config = json.loads((path / "config.json").read_text())
    assert "max_position_embeddings" not in config
    config["text_config"]["max_position_embeddings"] = 3000
    (path / "config.json").write_text(json.dumps(config))
    engine = Engine.load(EngineConfig(model=str(path), kv_blocks=16))
    try:
        assert engine.context_length == 3000
    finally:
        engine.shutdown()

