"""On MLX's CUDA backend (the device machine): families whose layers step around the CUDA fast paths (recurrent layers
through regrouped mixers, multi-head latent attention per lane group) give mlx-lm's tokens with every auto setting as
it resolves there (KV buckets, the paged kernels for their attention layers, the table gather, compiled steps where
they apply). Their CPU counterparts are `test_recurrent.py` and `test_mla_attention.py`.

    python -m pytest -q -m device tests/engine/test_device_families.py
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest, SamplingParams
from tests.engine.reference import prompt_of, run_staggered

NEAR_TIE = 0.05  # nats between mlx-lm's top token and ours where the two may part

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend (the device machine)"),
]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "lfm2", "granitemoehybrid", "nemotron_h", "falcon_h1", "jamba",
                                    "deepseek_v3", "glm4_moe_lite", "llama4", "deepseek_v2", "mistral4", "gemma4",
                                    "mimo_v2_flash", "rwkv7", "step3p5", "gemma3n", "gpt2", "gpt_neox", "exaone4",
                                    "gemma3"])  # fmt: skip
def test_a_family_beside_the_cuda_fast_paths_gives_mlx_lms_tokens(tmp_path, family):
    path = make_checkpoint(tmp_path / family, arch=family, seed=6)
    prompts = [prompt_of(n, seed=800 + i) for i, n in enumerate((9, 300, 40, 1))]
    engine = Engine.load(EngineConfig(model=str(path), row_ceiling=128, row_floor=16))
    try:
        tokens = run_staggered(engine, prompts, first=1, max_tokens=12)
        follow = prompts[1] + prompt_of(20, seed=810)  # a prefix hit (a snapshot, for a recurrent model)
        [again] = engine.generate([GenerationRequest(prompt_ids=tuple(follow), max_tokens=8)])
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        _assert_mlx_lms_tokens_or_a_near_tie(path, prompt, tokens[i], 12, f"prompt {i}")
    _assert_mlx_lms_tokens_or_a_near_tie(path, follow, list(again.token_ids), 8, "the prefix hit")


def _assert_mlx_lms_tokens_or_a_near_tie(
    path, prompt: list[int], ours: list[int], max_tokens: int, what: str
) -> list[mx.array]:
    """Our tokens are mlx-lm's, all of them, or up to a step where mlx-lm's own log-probabilities (same prefix) put
    ours within `NEAR_TIE` of its pick: a near-tie of dummy weights that different CUDA kernels may break either way
    (nemotron_h in session 41). A request cut short by a failed step fails here. Returns mlx-lm's log-probability
    rows of the steps the two share (the parting one included)."""
    want, rows = _reference_steps(path, prompt, max_tokens)
    for step, (token, wanted) in enumerate(zip(ours, want)):
        if token != wanted:
            margin = rows[step][wanted].item() - rows[step][token].item()
            assert margin < NEAR_TIE, f"{what} step {step}: mlx-lm's token led ours by {margin:.3f}"
            return rows[: step + 1]
    assert ours == want, f"{what}: {len(ours)} tokens, mlx-lm {len(want)}"
    return rows


def _reference_steps(path, prompt: list[int], max_tokens: int) -> tuple[list[int], list[mx.array]]:
    """mlx-lm's greedy tokens, cut after the first eos as the engine's are, and for each its whole log-probability
    row (generate_step, one request alone)."""
    from mlx_lm.generate import generate_step

    from tests.engine.reference import load_reference

    model, tokenizer = load_reference(str(path))
    tokens, rows = [], []
    for token, row in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(int(token))
        rows.append(row.astype(mx.float32))
        if tokens[-1] in tokenizer.eos_token_ids:
            break
    return tokens, rows


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "nemotron_h", "lfm2"])
def test_where_a_recurrent_familys_tokens_part_from_mlx_lms_the_two_were_at_a_near_tie(tmp_path, family):
    """Tells a numerical near-tie from a wrong state (the thirty-sixth run: qwen3_next, qwen3_5 and nemotron_h parted
    from mlx-lm's greedy tokens after several): every log-probability up to where the tokens part is mlx-lm's for the
    same token, and there mlx-lm's own margin between its token and ours is small."""
    path = make_checkpoint(tmp_path / family, arch=family, seed=6)
    prompts = [prompt_of(n, seed=800 + i) for i, n in enumerate((9, 300, 40, 1))]
    engine = Engine.load(EngineConfig(model=str(path), row_ceiling=128, row_floor=16))
    try:
        requests = [GenerationRequest(prompt_ids=tuple(p), max_tokens=12, sampling=SamplingParams(logprobs=0))
                    for p in prompts]  # fmt: skip
        completions = engine.generate(requests)
    finally:
        engine.shutdown()
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ours = list(completion.token_ids)
        rows = _assert_mlx_lms_tokens_or_a_near_tie(path, prompt, ours, 12, f"prompt {i}")
        for step, (token, logprob, row) in enumerate(zip(ours, completion.logprobs, rows)):
            assert abs(logprob - row[token].item()) < 0.05, f"prompt {i} step {step}: another distribution"
