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


TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"], "additionalProperties": False}}}]


def _walk(grammars, grammar, seed: int) -> tuple[list[int], object]:
    constraint = grammars.constraint(grammar)
    rng, tokens = np.random.default_rng(seed), []
    for _ in range(200):
        allowed = np.flatnonzero(np.isfinite(constraint.mask()))
        token = int(rng.choice(allowed))
        if token == constraint.eos_token:
            break
        tokens.append(token)
        constraint.advance(token)
    return tokens, constraint


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_tool_calls_are_calls_only(tokenizer, parallel):
    from mlx_serve.grammar import grammar_for_tool_choice

    grammars = Grammars(tokenizer, 2048)
    grammar = grammar_for_tool_choice("required", TOOLS, tokenizer, parallel)
    grammars.check(grammar)
    tokens, constraint = _walk(grammars, grammar, seed=4)
    text = tokenizer.decode(tokens)
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    assert text.startswith(start) and text.endswith(end)
    for call in text.split(end)[:-1]:
        assert json.loads(call.strip().removeprefix(start)) in ({"name": "ping", "arguments": {"n": 1}},
                                                               {"name": "ping", "arguments": {"n": 2}})
    # after a complete call: another one may follow only with parallel calls
    assert (np.isfinite(constraint.mask()).sum() > 1) == parallel
    assert parallel or text.count(start) == 1
