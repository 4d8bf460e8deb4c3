"""The grammar side of response_format: masks as wide as the model's logits, only end-of-sequence once the
JSON is complete, and clear refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mlx_lm import load

from mlx_serve.errors import InvalidRequest
from mlx_serve.grammar import Grammars, grammar_for_response_format

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return load(str(tiny_qwen3))[1]


def test_text_formats_are_unconstrained():
    assert grammar_for_response_format(None) is None
    assert grammar_for_response_format({"type": "text"}) is None


def test_a_constraint_walks_its_grammar_to_the_end(tokenizer):
    width = 2100  # wider than the tokenizer's 2,048: padded logits rows are never allowed
    grammars = Grammars(tokenizer, width)
    grammar = grammar_for_response_format({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    grammars.check(grammar)
    constraint = grammars.constraint(grammar)
    rng = np.random.default_rng(0)
    tokens = []
    for _ in range(64):
        mask = constraint.mask()
        assert mask.shape == (width,) and not np.isfinite(mask[grammars.tokenizer.vocab_size :]).any()
        allowed = np.flatnonzero(np.isfinite(mask))
        token = int(rng.choice(allowed))
        if token == constraint.eos_token:
            break
        tokens.append(token)
        constraint.advance(token)
    assert json.loads(tokenizer.decode(tokens)) in ({"ok": True}, {"ok": False})
    assert np.flatnonzero(np.isfinite(constraint.mask())).tolist() == [constraint.eos_token]


@pytest.mark.parametrize(
    "response_format",
    ["json", {"type": "yaml"}, {"type": "json_schema", "json_schema": "x"},
     {"type": "json_schema", "json_schema": {"schema": {"type": "number", "minimum": "a lot"}}}],
)  # fmt: skip
def test_unusable_formats_are_refused(tokenizer, response_format):
    with pytest.raises(InvalidRequest) as info:
        Grammars(tokenizer, 2048).check(grammar_for_response_format(response_format))
    assert info.value.param == "response_format"
