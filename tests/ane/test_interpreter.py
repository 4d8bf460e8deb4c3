"""The SAVED package's numerics, interpreted in NumPy, against mlx-lm's own layers, chunk after chunk.

Tolerance: every tensor (final-normed hidden states, each layer's new K and V) within 1% of its own peak
magnitude (max |err| <= 0.01 * max |ref|). The program computes in fp16 (10-bit mantissa, ~5e-4 relative per
op) against the float32 checkpoint; measured errors are ~0.2-0.4%, so 1% leaves headroom without hiding a
wrong op (a wrong RoPE, mask or GQA grouping gives errors of order 100%).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from ane_reference import build, load, mlx_forward, prompt

from mlx_serve.ane import host
from mlx_serve.ane.check import TOLERANCE, interpret_prompt, mlx_prompt, worst_errors


def assert_matches(model, package: Path, tokens: list[int], chunk: int) -> None:
    actual = interpret_prompt(model, package, tokens, chunk)
    expected = mlx_prompt(model, tokens)
    assert actual.hidden.shape == expected.hidden.shape
    errors = worst_errors(actual, expected)
    assert max(errors.values()) < TOLERANCE, errors


def test_qwen3_package_matches_mlx_chunk_after_chunk(qwen3_model, qwen3_package: Path) -> None:
    # 45 tokens in chunks of 20, 20, 5: calls of 32 (padded), 32 (padded), 16 (padded); KV carried across
    tokens = prompt(45, qwen3_model.args.vocab_size, seed=1)
    assert_matches(qwen3_model, qwen3_package, tokens, chunk=20)


def test_long_chunk_is_cut_into_package_calls(qwen3_model, qwen3_package: Path) -> None:
    # one 70-row chunk -> calls of 32, 32 and 16 (6 real rows), each seeing the earlier calls' K/V
    tokens = prompt(70, qwen3_model.args.vocab_size, seed=2)
    assert_matches(qwen3_model, qwen3_package, tokens, chunk=70)


@pytest.mark.parametrize("arch_fixture", ["tiny_llama", "tiny_qwen2"])
def test_other_families_match(arch_fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    # llama: no q/k norm, rope_theta 5e5; qwen2: q/k/v biases
    model = load(request.getfixturevalue(arch_fixture))
    package = build(model, tmp_path / "model.mlpackage", chunk_sizes=(16,))
    tokens = prompt(24, model.args.vocab_size, seed=3)
    assert_matches(model, package, tokens, chunk=16)


def test_interpreted_logits_pick_the_same_tokens(qwen3_model, qwen3_package: Path) -> None:
    tokens = prompt(33, qwen3_model.args.vocab_size, seed=4)
    expected = mlx_forward(qwen3_model, tokens)
    hidden = interpret_prompt(qwen3_model, qwen3_package, tokens, chunk=32).hidden
    logits = np.array(host.lm_head(qwen3_model, mx.array(hidden)))
    agree = (logits.argmax(-1) == expected.logits.argmax(-1)).mean()
    # fp16 can flip a near-tie on a random model; nearly every row must agree
    assert agree >= 0.95
