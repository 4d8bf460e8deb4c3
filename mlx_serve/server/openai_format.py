"""OpenAI response bodies: per-choice accumulation of engine events, logprobs, usage, chunks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mlx_serve.errors import MlxServeError
from mlx_serve.server.reasoning import ReasoningSplitter
from mlx_serve.server.tools import ToolCallSplitter, parse_tool_calls
from mlx_serve.types import PromptLogprob, TokenEvent, Usage


class GenerationFailed(MlxServeError):
    """The engine ended a request with an error."""


@dataclass(frozen=True, slots=True)
class Delta:
    """What one event adds to a choice: visible text, finished tool calls, logprob entries, reasoning text."""

    text: str
    tool_calls: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]
    reasoning: str = ""

    @property
    def empty(self) -> bool:
        return not (self.text or self.tool_calls or self.logprobs or self.reasoning)


@dataclass(slots=True)
class ChoiceState:
    """One choice of a request, built up event by event (streaming and not)."""

    index: int
    tokenizer: Any
    want_logprobs: bool
    splitter: ToolCallSplitter | None = None
    tools: list[dict[str, Any]] | None = None
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    counts_prompt: bool = True  # the first choice of its prompt: usage counts the prompt once
    echo: str | None = None  # the prompt's text, put before the answer (completions' `echo`)
    echo_only: bool = False  # the answer is the echoed prompt alone (the token made with it is dropped)
    entry_chars: int = 0  # characters of the logprob entries' tokens so far: the next entry's text offset
    reasoner: ReasoningSplitter | None = None  # a thinking model's reasoning goes apart from its answer
    reasoning: str = ""
    echo_top: int = 0  # alternatives each echoed prompt token lists (completions' `logprobs`)
    prompt_top: int | None = None  # vLLM's `prompt_logprobs`: alternatives each prompt token lists; None: not asked
    prompt_scores: tuple[PromptLogprob, ...] = ()  # the prompt's tokens scored, once the engine sent them

    def add(self, event: TokenEvent) -> Delta:
        if event.finish_reason == "error":
            raise GenerationFailed(f"generation failed: {event.error or 'unknown engine error'}")
        reasoning, text = self._reason(event)
        text, call_texts = self._split(text, event.finish_reason is not None)
        if event.prompt_logprobs is not None and not self.prompt_scores:
            self.prompt_scores = event.prompt_logprobs
        calls = parse_tool_calls(self.tokenizer, call_texts, self.tools, len(self.tool_calls))
        wants_entry = self.want_logprobs and event.token_id is not None and event.logprob is not None
        entries = [logprob_entry(self.tokenizer, event)] if wants_entry else []
        if self.echo_only:
            text, entries = "", []
        if self.echo is not None and event.token_id is not None:
            text, entries = self.echo + text, self._prompt_entries(event) + entries
            self.echo = None
        self.text += text
        self.reasoning += reasoning
        self.tool_calls += calls
        self.logprobs += entries
        self.entry_chars += sum(len(entry["token"]) for entry in entries)
        if event.finish_reason is not None:
            self.finish_reason = _finish_reason(event.finish_reason, bool(self.tool_calls))
            self.usage = replace(event.usage, completion_tokens=0) if self.echo_only and event.usage else event.usage
        return Delta(text, calls, entries, reasoning)

    def _prompt_entries(self, event: TokenEvent) -> list[dict[str, Any]]:
        """The echoed prompt's entries: from the event's scores, or those of another choice of the same prompt."""
        scores = event.prompt_logprobs if event.prompt_logprobs is not None else self.prompt_scores
        if not self.want_logprobs or not scores:
            return []
        return [prompt_entry(self.tokenizer, entry, self.echo_top) for entry in scores]

    def _reason(self, event: TokenEvent) -> tuple[str, str]:
        """The event's reasoning text and the rest (all the rest when the model does not think aloud)."""
        if self.reasoner is None:
            return "", event.text
        answer, reasoning = self.reasoner.feed(event.text)
        if event.finish_reason is not None:
            tail, last = self.reasoner.finish()
            answer, reasoning = answer + tail, reasoning + last
        return reasoning, answer

    def _split(self, text: str, last: bool) -> tuple[str, list[str]]:
        """Visible text and finished tool-call texts (everything is text when no tools were offered)."""
        if self.splitter is None:
            return text, []
        text, call_texts = self.splitter.feed(text)
        if last:
            tail, last_calls = self.splitter.finish()
            text, call_texts = text + tail, call_texts + last_calls
        return text, call_texts


def _finish_reason(engine_reason: str, made_tool_calls: bool) -> str:
    if engine_reason == "stop" and made_tool_calls:
        return "tool_calls"
    return engine_reason


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def logprob_entry(tokenizer: Any, event: TokenEvent) -> dict[str, Any]:
    """A chat-style logprob entry for the event's token, with its top alternatives."""
    token = token_text(tokenizer, event.token_id)
    top = [{"token": (alt := token_text(tokenizer, t.token_id)), "logprob": t.logprob,
            "bytes": list(alt.encode())} for t in (event.top_logprobs or ())]
    return {"token": token, "logprob": event.logprob, "bytes": list(token.encode()), "top_logprobs": top}


def prompt_entry(tokenizer: Any, entry: PromptLogprob, top_k: int) -> dict[str, Any]:
    """A logprob entry for a prompt token with its `top_k` alternatives (the first token has neither a logprob nor
    alternatives)."""
    token = token_text(tokenizer, entry.token_id)
    top = None if entry.logprob is None else [
        {"token": (alt := token_text(tokenizer, t.token_id)), "logprob": t.logprob, "bytes": list(alt.encode())}
        for t in (entry.top_logprobs or ())[:top_k]
    ]  # fmt: skip
    return {"token": token, "logprob": entry.logprob, "bytes": list(token.encode()), "top_logprobs": top}


def vllm_prompt_logprobs(choice: ChoiceState) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), the token itself and the top alternatives by
    token id, each with its log-probability, its rank (1: the likeliest) and its text."""
    if choice.prompt_top is None:
        return None

    def logprob(token_id: int, value: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": value, "rank": rank, "decoded_token": token_text(choice.tokenizer, token_id)}

    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in choice.prompt_scores:
        if entry.logprob is None:
            out.append(None)
            continue
        alternatives = (entry.top_logprobs or ())[: choice.prompt_top]
        scored = {str(t.token_id): logprob(t.token_id, t.logprob, rank) for rank, t in enumerate(alternatives, 1)}
        out.append({str(entry.token_id): logprob(entry.token_id, entry.logprob, entry.rank), **scored})
    return out


def completion_logprobs(entries: Sequence[dict[str, Any]], text_offset: int = 0) -> dict[str, Any]:
    """The legacy completions logprobs object from chat-style entries."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                         for e in entries],
        "text_offset": offsets,
    }


def usage_body(choices: Sequence[ChoiceState]) -> dict[str, Any]:
    """Usage over all choices: each prompt is counted once (as OpenAI does for n > 1)."""
    usages = [c.usage for c in choices if c.usage is not None]
    firsts = [c.usage for c in choices if c.usage is not None and c.counts_prompt]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages)
    cached = sum(u.cached_tokens for u in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def reasoning_fields(text: str) -> dict[str, str]:
    """A message's or delta's reasoning, under the name DeepSeek's API and vLLM use and the one mlx-lm's server
    uses (clients read one or the other)."""
    return {"reasoning_content": text, "reasoning": text} if text else {}


def chat_message(choice: ChoiceState) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text or None, **reasoning_fields(choice.reasoning)}
    if choice.tool_calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in choice.tool_calls]
    elif message["content"] is None:
        message["content"] = ""
    return message


def chat_response(job_id: str, model: str, created: int, choices: Sequence[ChoiceState],
                  with_logprobs: bool) -> dict[str, Any]:
    response = {
        "id": job_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": c.index, "message": chat_message(c), "finish_reason": c.finish_reason,
                     "logprobs": {"content": c.logprobs} if with_logprobs else None} for c in choices],
        "usage": usage_body(choices),
    }
    if choices and choices[0].prompt_top is not None:  # one prompt for every choice: vLLM puts it on the response
        response["prompt_logprobs"] = vllm_prompt_logprobs(choices[0])
    return response


def completion_response(job_id: str, model: str, created: int, choices: Sequence[ChoiceState],
                        with_logprobs: bool) -> dict[str, Any]:
    return {
        "id": job_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": completion_logprobs(c.logprobs) if with_logprobs else None,
                     **({"prompt_logprobs": vllm_prompt_logprobs(c)} if c.prompt_top is not None else {})}
                    for c in choices],
        "usage": usage_body(choices),
    }


def chat_chunk(job_id: str, model: str, created: int, index: int, delta: dict[str, Any],
               finish_reason: str | None = None, logprobs: list[dict[str, Any]] | None = None,
               include_usage: bool = False) -> dict[str, Any]:
    chunk = {"id": job_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason,
                          "logprobs": {"content": logprobs} if logprobs else None}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk(job_id: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
                     include_usage: bool = False) -> dict[str, Any]:
    chunk = {"id": job_id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(job_id: str, model: str, created: int, obj: str, choices: Sequence[ChoiceState]) -> dict[str, Any]:
    return {"id": job_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_body(choices)}
