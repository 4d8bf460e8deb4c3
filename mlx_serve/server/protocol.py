"""Request-body parsing shared by the OpenAI and Anthropic routes, and the error bodies of both APIs.

Everything here is plain Python: it reads a JSON body, checks types and ranges, and builds the engine's
`GenerationRequest`s. Bad input raises `InvalidRequest` naming the offending field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from mlx_serve.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    MlxServeError,
    ModelNotFound,
    Unauthorized,
    parse_client_json,
)
from mlx_serve.types import GenerationRequest, SamplingParams

MAX_CHOICES = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions call (a batch: lm-eval's, for one)
MAX_STOP_STRINGS = 16


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the routes need to know about the served model (read once from the engine)."""

    model_id: str
    aliases: frozenset[str]
    context_length: int
    vocab_size: int
    kv_capacity: int  # tokens the KV pool holds: a request can never use more
    split_reasoning: bool = True  # chat answers put a thinking model's reasoning apart (`--reasoning split`)
    pooling: str = "last"  # how /v1/embeddings pools a prompt's hidden states (`--pooling`)
    # the LoRA adapters served now beside the base model, each a `model` name of its own (they may be loaded later)
    adapter_names: Callable[[], tuple[str, ...]] = tuple

    @property
    def adapters(self) -> tuple[str, ...]:
        return self.adapter_names()

    def check_name(self, name: object) -> None:
        self.adapter_for(name)

    def adapter_for(self, name: object) -> str | None:
        """The adapter a request's `model` names; None for the base model (its id, an alias, or no name)."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise InvalidRequest(f"model must be a string, got {type(name).__name__}", param="model")
        if name in self.adapters:
            return name
        if name != self.model_id and name not in self.aliases:
            also = f" and the adapters {', '.join(self.adapters)}" if self.adapters else ""
            raise ModelNotFound(f"The model '{name}' does not exist; this server serves '{self.model_id}'{also}",
                                param="model")
        return None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or `InvalidRequest`."""
    body = parse_client_json(raw, "The request body")
    if not isinstance(body, dict):
        raise InvalidRequest(f"The request body must be a JSON object, got {type(body).__name__}")
    return body


def _type_error(name: str, expected: str, value: object) -> InvalidRequest:
    return InvalidRequest(f"{name} must be {expected}, got {json.dumps(value)[:80]}", param=name)


def read_number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, "a finite number", value)
    return float(value)


def read_int(body: Mapping[str, Any], name: str, default: Any = None, *, low: int | None = None,
             high: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise InvalidRequest(f"{name} must be in {bounds}, got {value}", param=name)
    return value


def read_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def read_str(body: Mapping[str, Any], name: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return value


def read_stop(body: Mapping[str, Any], name: str = "stop") -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _type_error(name, "a non-empty string or a list of non-empty strings", value)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"{name} takes at most {MAX_STOP_STRINGS} strings", param=name)
    return tuple(stops)


def read_logit_bias(body: Mapping[str, Any]) -> dict[int, float] | None:
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error("logit_bias", "an object mapping token ids to biases", value)
    bias: dict[int, float] = {}
    for key, amount in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise _type_error("logit_bias", "an object of numbers", value)
        bias[token] = float(amount)
    return bias


def read_sampling(body: Mapping[str, Any], logprobs: int | None) -> SamplingParams:
    """The sampling fields both APIs share (OpenAI names; Anthropic's are the same where they exist)."""
    return SamplingParams(
        temperature=read_number(body, "temperature", 1.0),
        top_p=read_number(body, "top_p", 1.0),
        top_k=read_int(body, "top_k", 0),
        min_p=read_number(body, "min_p", 0.0),
        repetition_penalty=read_number(body, "repetition_penalty", 1.0),
        presence_penalty=read_number(body, "presence_penalty", 0.0),
        frequency_penalty=read_number(body, "frequency_penalty", 0.0),
        logit_bias=read_logit_bias(body),
        seed=read_int(body, "seed"),
        logprobs=logprobs,
        min_tokens=read_int(body, "min_tokens", 0, low=0),  # vLLM's extension
    )


def read_max_tokens(body: Mapping[str, Any], prompt_len: int, model: ModelInfo, names: tuple[str, ...],
                    prompt_param: str = "messages") -> int:
    """The caller's output limit, or whatever room the context (and KV pool) leaves after the prompt."""
    limit = min(model.context_length, model.kv_capacity)
    if prompt_len >= limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens, but the prompt has {prompt_len} tokens",
            param=prompt_param)
    for name in names:
        value = read_int(body, name, low=1)
        if value is not None:
            return value
    return limit - prompt_len


def read_bad_words(body: Mapping[str, Any], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` as token sequences: each word as it starts a text and after a space (the model has both
    spellings), without duplicates."""
    words = body.get("bad_words")
    if words is None:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise _type_error("bad_words", "a list of non-empty strings", words)
    sequences: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return tuple(sequences)


def truncated_prompt(body: Mapping[str, Any], prompt_ids: list[int], model: ModelInfo) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: as many as the context holds)."""
    keep = read_int(body, "truncate_prompt_tokens", low=-1)
    if keep is None:
        return prompt_ids
    if keep == 0:
        raise InvalidRequest("truncate_prompt_tokens must be -1 or at least 1, got 0", param="truncate_prompt_tokens")
    limit = min(model.context_length, model.kv_capacity) - 1  # room for one answer token
    keep = limit if keep == -1 else keep
    if keep > limit:
        raise InvalidRequest(f"truncate_prompt_tokens ({keep}) must be below the context length ({limit + 1})",
                             param="truncate_prompt_tokens")  # fmt: skip
    return prompt_ids[-keep:]


def build_requests(body: Mapping[str, Any], prompt_ids: list[int], model: ModelInfo, *,
                   logprobs: int | None, max_token_fields: tuple[str, ...], stop_field: str = "stop",
                   n: int = 1, prompt_param: str = "messages", grammar: str | None = None,
                   prompt_logprobs: int | None = None,
                   bad_words: tuple[tuple[int, ...], ...] = ()) -> tuple[GenerationRequest, ...]:
    """One `GenerationRequest` per choice; a given seed becomes seed + i for choice i. `grammar`: what every
    token must follow (`mlx_serve.grammar`); `prompt_logprobs`: score the prompt's tokens too (top k); `bad_words`:
    token sequences never generated. The prompt is cut to `truncate_prompt_tokens` where the body asks."""
    prompt_ids = truncated_prompt(body, prompt_ids, model)
    if not prompt_ids:
        raise InvalidRequest("The prompt is empty", param=prompt_param)
    sampling = replace(read_sampling(body, logprobs), grammar=grammar, prompt_logprobs=prompt_logprobs,
                       bad_words=bad_words)  # fmt: skip
    sampling.validate(model.vocab_size)
    max_tokens = read_max_tokens(body, len(prompt_ids), model, max_token_fields, prompt_param)
    if sampling.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({sampling.min_tokens}) must be at most max_tokens ({max_tokens})",
                             param="min_tokens")  # fmt: skip
    base = GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        max_tokens=max_tokens,
        sampling=sampling,
        stop=read_stop(body, stop_field),
        stop_token_ids=tuple(_read_token_ids(body, "stop_token_ids", model.vocab_size)),
        ignore_eos=read_bool(body, "ignore_eos"),
        include_stop_str_in_output=read_bool(body, "include_stop_str_in_output"),
        priority=read_int(body, "priority", 1, low=0, high=2),
        cache_salt=read_str(body, "cache_salt"),
        adapter=model.adapter_for(body.get("model")),
    )
    if sampling.seed is None:
        return (base,) * n
    return tuple(replace(base, sampling=replace(sampling, seed=sampling.seed + i)) for i in range(n))


def _read_token_ids(body: Mapping[str, Any], name: str, vocab_size: int) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_token_id(t, vocab_size) for t in value):
        raise _type_error(name, f"a list of token ids in [0, {vocab_size})", value)
    return value


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a completions call: its token ids and its text (as given, or decoded from the ids)."""

    ids: list[int]
    text: str


def read_prompts(value: object, tokenizer: Any, vocab_size: int, param: str = "prompt",
                 most: int = MAX_PROMPTS) -> list[Prompt]:  # fmt: skip
    """A completions `prompt` (or an embeddings `input`): a string, a list of token ids, or a list of either (a
    batch of at most `most` prompts)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(p, (str, list)) for p in value):
        raise _type_error(param, "a string, a list of token ids, or a list of either", value)
    if len(value) > most:
        raise InvalidRequest(f"{param} takes at most {most} prompts, got {len(value)}", param=param)
    return [_read_prompt(p, tokenizer, vocab_size, param) for p in value]


def _read_prompt(value: str | list, tokenizer: Any, vocab_size: int, param: str) -> Prompt:
    if isinstance(value, str):
        return Prompt(list(tokenizer.encode(value)), value)
    if not value or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise _type_error(param, "a non-empty list of integer token ids", value)
    outside = [t for t in value if not _is_token_id(t, vocab_size)]
    if outside:
        raise InvalidRequest(f"{param} token ids outside the vocabulary (0..{vocab_size - 1}): {outside[:5]}",
                             param=param)
    return Prompt(list(value), tokenizer.decode(value))


def openai_error_body(exc: MlxServeError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param,
                      "code": _error_code(exc)}}


def _error_code(exc: MlxServeError) -> str | None:
    if isinstance(exc, ContextLengthExceeded):
        return "context_length_exceeded"
    if isinstance(exc, ModelNotFound):
        return "model_not_found"
    if isinstance(exc, Unauthorized):
        return "invalid_api_key"
    return None


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_error_body(exc: MlxServeError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(exc.status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


@dataclass(frozen=True, slots=True)
class Job:
    """A parsed API call: one engine request per choice and how the answer should be shaped."""

    requests: tuple[GenerationRequest, ...]
    stream: bool = False
    include_usage: bool = False
    want_logprobs: bool = False
    tools: list[dict[str, Any]] | None = None
    n: int = 1  # choices a prompt: requests i * n ... i * n + n - 1 share prompt i
    echo: tuple[str, ...] | None = None  # completions with `echo`: each request's prompt text, put before its answer
    echo_only: bool = False  # `echo` with max_tokens 0: the answer is the prompt alone (one token is made, dropped)
    split_reasoning: bool = False  # a thinking model's reasoning goes to `reasoning_content` (chat answers)
    echo_top: int = 0  # completions' `logprobs` with `echo`: alternatives each echoed prompt token lists
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-probability and top k, in the response


def read_prompt_logprobs(body: Mapping[str, Any], stream: bool) -> int | None:
    """vLLM's `prompt_logprobs` (top k, 0-20): not with a stream, as vLLM refuses it."""
    top = read_int(body, "prompt_logprobs", low=0, high=20)
    if top is not None and stream:
        raise InvalidRequest("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
    return top


def read_stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    """Whether the caller asked for a final usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    return read_bool(options, "include_usage")
