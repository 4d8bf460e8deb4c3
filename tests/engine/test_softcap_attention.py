"""Gemma 2's soft-capped attention on ragged steps (`mlx_serve.softcap_attention`): mlx-lm's own Attention module
through a `RaggedLayerCache` gives what it gives through mlx-lm's KVCache, and the dummy checkpoint's caps are low
enough that dropping either one changes what the family test compares (tokens, log-probabilities)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gemma2
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlx_serve import ragged
from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.checkpoints.presets import model_config
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.kernels.paged_gather import table_gather
from mlx_serve.kv_pool import KVLayout, KVPool, slot_array
from mlx_serve.ragged import (
    DecodeRows,
    LaneRows,
    PagedChunkAttention,
    RaggedLayerCache,
    StepLayout,
    softcapped_attention,
)
from mlx_serve.softcap_attention import install_softcapped_forwards
from mlx_serve.types import GenerationRequest, SamplingParams
from tests.engine.reference import prompt_of, reference_prompt_logprobs, reference_tokens

BLOCK = 4


def _refuse(*args, **kwargs):
    raise AssertionError("soft-capped attention took a path without the cap")


# the step's fast paths (paged decode, paged or fused chunk attention) have no cap: a soft-capped layer never calls them
FAST_PATHS = dict(decode_attention=_refuse, chunk_attention=PagedChunkAttention(_refuse, lambda *a: True, _refuse))


def _attention(seed: int = 0) -> gemma2.Attention:
    mx.random.seed(seed)
    attn = gemma2.Attention(gemma2.ModelArgs.from_dict(model_config("gemma2", "tiny")))
    assert install_softcapped_forwards(attn)
    mx.eval(attn.parameters())
    return attn


def _mlx_lm(attn: gemma2.Attention, x: mx.array, splits: list[int]) -> mx.array:
    """mlx-lm's forward of one request's rows `[n, D]` in calls of `splits` rows over its KVCache, as GemmaModel
    masks them."""
    cache, outputs, start = KVCache(), [], 0
    for rows in splits:
        h = x[None, start : start + rows]
        outputs.append(attn(h, create_attention_mask(h, cache, return_array=True), cache)[0])
        start += rows
    return mx.concatenate(outputs)


def _slots(blocks: list[int], start: int, end: int) -> mx.array:
    return mx.array(slot_array(blocks, start, end, BLOCK))


def _ragged(attn: gemma2.Attention, a: mx.array, b: mx.array, fast_paths: dict) -> tuple[mx.array, mx.array]:
    """Two ragged steps over one pool: A's 9 rows and B's 3 as exact-slot lanes (a "causal" mask); then A's 10th row
    as a decode row read through its block table, beside B's next 6 rows bucketed (16 KV behind a mask, 8 query
    rows) and read through theirs; `fast_paths`: the steps' decode and chunk attention. Returns each request's
    outputs `[n, D]`."""
    pool = KVPool(KVLayout(1, attn.n_kv_heads, attn.head_dim, mx.float32), 8, BLOCK)
    blocks_a, blocks_b = [0, 1, 2], [3, 4, 5]
    step1 = StepLayout(
        positions=mx.concatenate([mx.arange(9), mx.arange(3)]).astype(mx.int32),
        write_slots=mx.concatenate([_slots(blocks_a, 0, 9), _slots(blocks_b, 0, 3)]),
        decode=None,
        lanes=(LaneRows(0, 9, _slots(blocks_a, 0, 9)), LaneRows(9, 3, _slots(blocks_b, 0, 3))),
        **fast_paths,
    )
    out1 = attn(mx.concatenate([a[:9], b[:3]])[:, None], None, RaggedLayerCache(pool, 0, step1))[:, 0]
    padded, queries = 16, 8
    query_pos = mx.minimum(mx.arange(3, 3 + queries, dtype=mx.int32), 8)
    visible = mx.arange(padded)[None, :] <= query_pos[:, None]
    mask = mx.where(visible, mx.array(0.0), mx.array(mx.finfo(mx.float32).min))[None, None]
    lane_b = LaneRows(1, 6, _slots(blocks_b, 0, 9), mask, mx.array(blocks_b, dtype=mx.int32),
                      mx.array([9, padded], dtype=mx.int32), padded, queries, query_pos)  # fmt: skip
    decode = DecodeRows(1, mx.array([blocks_a], dtype=mx.int32), mx.array([10], dtype=mx.int32), BLOCK,
                        (LaneRows(0, 1, _slots(blocks_a, 0, 10)),))  # fmt: skip
    step2 = StepLayout(
        positions=mx.concatenate([mx.array([9]), mx.arange(3, 9)]).astype(mx.int32),
        write_slots=mx.concatenate([_slots(blocks_a, 9, 10), _slots(blocks_b, 3, 9)]),
        decode=decode,
        lanes=(lane_b,),
        prefill_gather=table_gather,
        **fast_paths,
    )
    out2 = attn(mx.concatenate([a[9:], b[3:]])[:, None], None, RaggedLayerCache(pool, 0, step2))[:, 0]
    return mx.concatenate([out1[:9], out2[:1]]), mx.concatenate([out1[9:], out2[1:]])


def test_gemma2_attention_on_ragged_steps_is_mlx_lms():
    """Decode rows and prefill lanes (exact and bucketed) through the ragged forward give mlx-lm's own outputs,
    never touching the uncapped fast paths."""
    attn = _attention()
    rng = np.random.default_rng(0)
    # scaled so scores reach the cap (3), as a real layer's do
    a, b = (mx.array(3 * rng.standard_normal((n, 128)).astype(np.float32)) for n in (10, 9))
    got_a, got_b = _ragged(attn, a, b, FAST_PATHS)
    want_a, want_b = _mlx_lm(attn, a, [9, 1]), _mlx_lm(attn, b, [3, 6])
    np.testing.assert_allclose(np.array(got_a), np.array(want_a), atol=1e-5)
    np.testing.assert_allclose(np.array(got_b), np.array(want_b), atol=1e-5)
    # the same steps without the cap (plain attention, the paged path's form) are far from mlx-lm's
    attn.attn_logit_softcapping = None
    plain_a, plain_b = _ragged(attn, a, b, {})
    assert np.abs(np.array(plain_a) - np.array(want_a)).max() > 1e-2
    assert np.abs(np.array(plain_b) - np.array(want_b)).max() > 1e-2


@pytest.mark.parametrize("mask", ["causal", "bool", "additive"])
def test_softcapped_attention_is_fused_attention_with_scores_capped(mask):
    """With a cap far above every score it is MLX's fused attention (same masks, GQA); with a low one it is not."""
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((2, 4, 5, 32)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((2, 2, 12, 32)).astype(np.float32)) for _ in range(2))
    causal = mx.arange(7, 12)[:, None] >= mx.arange(12)[None]
    given = {"causal": "causal", "bool": causal, "additive": mx.where(causal, 0.0, mx.finfo(mx.float32).min)}[mask]
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=given)
    np.testing.assert_allclose(np.array(softcapped_attention(q, k, v, 0.3, 1e4, given)), np.array(fused), atol=1e-5)
    capped = softcapped_attention(q, k, v, 0.3, 1.0, given)
    assert np.abs(np.array(capped) - np.array(fused)).max() > 1e-2


def _serve(config: EngineConfig, prompts: list[list[int]], scored: list[int], final_cap: float | None = None):
    """The engine's greedy tokens of `prompts` and its log-probabilities of `scored`'s tokens (with the head's
    final cap replaced by `final_cap` where given)."""
    engine = Engine.load(config)
    try:
        if final_cap is not None:
            engine.runner.model.final_logit_softcapping = final_cap
        requests = [GenerationRequest(prompt_ids=tuple(p), max_tokens=10) for p in prompts]
        sampling = SamplingParams(prompt_logprobs=0)
        *completions, scoring = engine.generate([*requests, GenerationRequest(tuple(scored), 1, sampling=sampling)])
    finally:
        engine.shutdown()
    return [list(c.token_ids) for c in completions], np.array([e.logprob for e in scoring.prompt_logprobs[1:]])


def test_dropping_either_cap_breaks_the_family_test(tmp_path, monkeypatch):
    """The family test's prompts (`test_a_family_serves_mlx_lms_tokens_and_log_probabilities`) on the dummy gemma2:
    without the attention cap the engine's tokens and log-probabilities are not mlx-lm's; without the final cap, its
    log-probabilities are not."""
    path = make_checkpoint(tmp_path / "gemma2", arch="gemma2", seed=1)
    prompts = [prompt_of(n, seed=500 + i) for i, n in enumerate((9, 70, 33))]
    scored = prompt_of(45, seed=510)
    config = EngineConfig(model=str(path), block_size=16, kv_blocks=128, row_ceiling=24, row_floor=4)
    want_tokens = [reference_tokens(path, p, 10) for p in prompts]
    want = reference_prompt_logprobs(path, scored)[np.arange(len(scored) - 1), scored[1:]]

    def uncapped(q, keys, values, scale, softcap, mask):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)

    with monkeypatch.context() as patch:
        patch.setattr(ragged, "softcapped_attention", uncapped)
        tokens, logprobs = _serve(config, prompts, scored)
    assert tokens != want_tokens
    assert np.abs(logprobs - want).max() > 1e-3

    tokens, logprobs = _serve(config, prompts, scored, final_cap=1e6)  # tanh(x / 1e6) * 1e6: no cap
    assert np.abs(logprobs - want).max() > 1e-3
    tokens, logprobs = _serve(config, prompts, scored)  # and with both caps, mlx-lm's
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want, atol=2e-5)


def test_gemma2_takes_no_fused_forward(tmp_path):
    """The fused decode forward computes attention without a cap: `fuse_decode` auto skips gemma2, on refuses it."""
    import mlx_lm

    from mlx_serve.engine_setup import fuse_decode
    from mlx_serve.errors import InvalidRequest
    from mlx_serve.fused_decode import unsupported_reason

    model, _ = mlx_lm.load(str(make_checkpoint(tmp_path / "gemma2", arch="gemma2", seed=0)))
    assert unsupported_reason(model) is not None
    assert not fuse_decode("auto", model, compiled=True)
    with pytest.raises(InvalidRequest, match="cannot take the fused forward"):
        fuse_decode("on", model, compiled=True)
