"""Constrained decoding: OpenAI's `response_format` (and vLLM's guided decoding: a schema, a regular expression, a
choice of strings, a lark grammar) as a grammar that masks every sampled token (llguidance).

The HTTP layer turns `response_format` into an llguidance grammar (`grammar_for_response_format`); the engine
checks it against the tokenizer when the request is submitted (`Grammars.check`, a 400 for what cannot compile)
and gives the runner one `Constraint` per constrained request. Before each of its samples the constraint's
matcher yields the allowed tokens, applied as an additive mask on the device; after it, the sampled token
advances the matcher. A constrained request's steps are never left in flight: the next mask needs this token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.hf import from_tokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mlx_serve.errors import InvalidRequest, parse_client_json

# JSON as people read it, with whitespace fixed: "flexible" whitespace lets a weak model pad forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_TOOL_PARSER = "mlx_lm.tool_parsers.json_tools"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call>


def grammar_for_response_format(response_format: object) -> str | None:
    """The llguidance grammar of an OpenAI `response_format` (None: unconstrained text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidRequest("response_format must be an object", param="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise InvalidRequest(
                "response_format.json_schema must be an object with a `schema` object", param="response_format"
            )
        return _json_grammar(dict(spec.get("schema", {})))
    raise InvalidRequest(
        f"response_format.type must be text, json_object or json_schema, not {kind!r}", param="response_format"
    )


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's extensions
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")  # vLLM's newer `structured_outputs` object, the same four


def grammar_for_guided(body: Mapping[str, Any]) -> str | None:
    """vLLM's guided decoding: `guided_json` (a JSON schema), `guided_regex`, `guided_choice` (one of the strings)
    or `guided_grammar` (lark), or the same as `structured_outputs: {json | regex | choice | grammar}`; at most one.
    None where none is given."""
    given = {name.removeprefix("guided_"): (name, body[name]) for name in GUIDED_FIELDS if body.get(name) is not None}
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, Mapping):
            raise InvalidRequest("structured_outputs must be an object", param="structured_outputs")
        for kind in STRUCTURED_KINDS:
            if structured.get(kind) is not None:
                given.setdefault(kind, ("structured_outputs", structured[kind]))
    if len(given) > 1:
        raise InvalidRequest(f"give one kind of guided decoding, not {', '.join(sorted(given))}",
                             param=next(iter(given.values()))[0])  # fmt: skip
    if not given:
        return None
    kind, (param, value) = next(iter(given.items()))
    if kind == "json":
        if isinstance(value, str):
            value = parse_client_json(value, param, param)
        if not isinstance(value, Mapping):
            raise InvalidRequest(f"{param} must be a JSON schema object", param=param)
        return _json_grammar(dict(value), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest(f"{param} must be a list of non-empty strings", param=param)
        lark = "start: " + " | ".join(json.dumps(choice) for choice in value) + "\n"
        return _validated(LLMatcher.grammar_from_lark(lark), param, "the choices")
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} must be a non-empty string", param=param)
    if kind == "regex":
        return _validated(LLMatcher.grammar_from_regex(value), param, "the regular expression")
    return _validated(LLMatcher.grammar_from_lark(value), param, "the lark grammar")


def grammar_for_tool_choice(
    tool_choice: object, tools: list[dict[str, Any]] | None, tokenizer: Any, parallel: bool = True
) -> str | None:
    """`tool_choice` "required" or a named function: the answer is tool calls only, each a JSON call of an offered
    tool (name and schema-valid arguments) between the model's markers; one call unless `parallel` and required.
    None for "auto" / "none" / absent."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        chosen, several = tools or [], parallel
    elif isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen, several = [t for t in tools or [] if t["function"]["name"] == name], False
        if not chosen:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    else:
        raise InvalidRequest(
            "tool_choice must be none, auto, required or {type: function, function: {name}}", param="tool_choice"
        )
    if not chosen:
        raise InvalidRequest("tool_choice required needs tools", param="tool_choice")
    parser = getattr(tokenizer, "tool_parser", None)
    if getattr(parser, "__module__", "") != JSON_TOOL_PARSER:
        raise InvalidRequest(
            "tool_choice required or a named function is enforced only for models whose tool calls are JSON between "
            "markers (Qwen3, Hermes); use auto", param="tool_choice",
        )  # fmt: skip
    call = {"anyOf": [_call_schema(t["function"]) for t in chosen], "x-guidance": JSON_OPTIONS}
    start, end = _marker(tokenizer, tokenizer.tool_call_start), _marker(tokenizer, tokenizer.tool_call_end)
    repeat = ' ("\\n" call)*' if several else ""
    lark = f'%llguidance {{}}\nstart: call{repeat}\ncall: {start} "\\n" %json {json.dumps(call)} "\\n" {end}\n'
    return _validated(LLMatcher.grammar_from_lark(lark), "tools", "a tool's parameters schema")


def _call_schema(function: Mapping[str, Any]) -> dict:
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _marker(tokenizer: Any, text: str) -> str:
    """A tool-call marker in lark: the token itself when it is one added token (llguidance treats those as special,
    never spelled out by text), else the literal text."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = {token.content for token in getattr(hf, "added_tokens_decoder", {}).values()}
    return text if text in added else json.dumps(text)


def _json_grammar(schema: dict, param: str = "response_format") -> str:
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"{param}: the JSON schema cannot be used: {exc}", param=param) from exc
    return _validated(grammar, param, "the JSON schema")


def _validated(grammar: str, param: str, what: str) -> str:
    """The grammar, compiled once without a tokenizer so that a bad schema is a 400 naming the field to blame."""
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if failed:
        raise InvalidRequest(f"{param}: {what} cannot be enforced: {'; '.join(messages)}", param=param)
    return grammar


class Constraint:
    """One request's grammar state: the mask of its next token, and advancing past the sampled one."""

    def __init__(self, matcher: LLMatcher, tokenizer: LLTokenizer, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.eos_token = tokenizer.eos_token
        self._bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)

    def mask(self) -> np.ndarray:
        """Additive float32 mask `[vocab]`: 0 where the grammar allows the token, -inf elsewhere."""
        fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        allowed = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little").astype(bool)
        mask = np.full(self.vocab_size, -np.inf, dtype=np.float32)
        n = min(self.vocab_size, allowed.size)
        mask[:n][allowed[:n]] = 0.0
        if not np.isfinite(mask).any():  # the grammar has ended or failed: only end-of-sequence remains
            mask[self.eos_token] = 0.0
        return mask

    def advance(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)


class Grammars:
    """The engine's grammar side: the llguidance tokenizer (built on first use) and per-request constraints."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the HF tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: LLTokenizer | None = None

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = from_tokenizer(self._hf)
        return self._tokenizer

    def check(self, grammar: str) -> None:
        """Refuse (400) a grammar this tokenizer cannot run."""
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            # what the HTTP layer could not see: this tokenizer (a schema error is caught there, with its field)
            raise InvalidRequest(f"the output format cannot be enforced: {'; '.join(messages)}", param="response_format")

    def constraint(self, grammar: str) -> Constraint:
        matcher = LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise InvalidRequest(f"response_format cannot be enforced: {matcher.get_error()}", param="response_format")
        return Constraint(matcher, self.tokenizer, self.vocab_size)
