"""Anthropic Messages API: POST /v1/messages, streaming and not, and POST /v1/messages/count_tokens.

Messages and tools are converted to the OpenAI shapes that chat templates understand, so one rendering
and one tool-call path serve both APIs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_serve.errors import InvalidRequest
from mlx_serve.grammar import grammar_for_tool_choice
from mlx_serve.server.openai_format import ChoiceState, GenerationFailed
from mlx_serve.server.protocol import (
    Job,
    ModelInfo,
    anthropic_error_body,
    build_requests,
    parse_json_object,
    read_bool,
)
from mlx_serve.server.reasoning import make_reasoning_splitter
from mlx_serve.server.streaming import EventStreamResponse, collect_events, merge_events, sse
from mlx_serve.server.tools import make_splitter, normalize_messages, render_chat, validate_tools

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}


def parse_messages(body: dict[str, Any], tokenizer: Any, model: ModelInfo) -> Job:
    model.check_name(body.get("model"))
    if body.get("max_tokens") is None:
        raise InvalidRequest("max_tokens is required", param="max_tokens")
    prompt, tools = _render(body, tokenizer)
    requests = build_requests(body, prompt, model, logprobs=None, max_token_fields=("max_tokens",),
                              stop_field="stop_sequences",
                              grammar=_tool_grammar(body.get("tool_choice"), tools, tokenizer))
    return Job(requests, stream=read_bool(body, "stream"), tools=tools)


def _render(body: dict[str, Any], tokenizer: Any) -> tuple[list[int], list[dict[str, Any]] | None]:
    """The prompt's token ids as the chat template renders system, messages and tools; and the tools."""
    tools = validate_tools(_openai_tools(body.get("tools")))
    messages = _system_messages(body.get("system")) + _openai_messages(body.get("messages"))
    # a last assistant message is a prefilled answer: the model continues it (Anthropic's prefill)
    last = messages[-1]
    prefilled = last["role"] == "assistant" and bool(last["content"]) and not last.get("tool_calls")
    return render_chat(tokenizer, normalize_messages(messages), tools, continue_final=prefilled), tools


def count_prompt_tokens(body: dict[str, Any], tokenizer: Any, model: ModelInfo) -> int:
    model.check_name(body.get("model"))
    return len(_render(body, tokenizer)[0])


async def count_tokens(request: Request) -> Response:
    """The prompt's length as /v1/messages would render it (Anthropic's token-counting endpoint)."""
    engine, model = request.state.engine, request.state.model
    body = parse_json_object(await request.body())
    tokens = await run_in_threadpool(count_prompt_tokens, body, engine.tokenizer, model)
    return JSONResponse({"input_tokens": tokens})


def _tool_grammar(choice: object, tools: list[dict[str, Any]] | None, tokenizer: Any) -> str | None:
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    return grammar_for_tool_choice(_openai_tool_choice(choice), tools, tokenizer, parallel)


def _openai_tool_choice(choice: object) -> object:
    """Anthropic's {type: auto | any | tool | none} as OpenAI's tool_choice."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequest("tool_choice must be {type: auto | any | tool | none}", param="tool_choice")


def _system_messages(system: object) -> list[dict[str, Any]]:
    if system is None:
        return []
    return [{"role": "system", "content": _text_of(system, "system")}]


def _text_of(content: object, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise InvalidRequest(f"{param} must be a string or a list of text blocks", param=param)


def _openai_messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise InvalidRequest(f"messages[{i}] must have role user or assistant", param=f"messages[{i}]")
        # as Anthropic's API: only a final assistant message (a prefill to continue) may be empty
        if message.get("content") == [] and not (i == len(messages) - 1 and message["role"] == "assistant"):
            raise InvalidRequest(f"messages[{i}].content must not be empty", param=f"messages[{i}].content")
        out += _convert_message(message, f"messages[{i}]")
    if not out:
        raise InvalidRequest("messages must hold at least one message with content", param="messages")
    return out


def _convert_message(message: dict[str, Any], param: str) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": message["role"], "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{param}.content must be a string or a list of blocks", param=f"{param}.content")
    text, thinking, calls, results = "", "", [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text += str(block.get("text", ""))
        elif kind == "thinking":  # an earlier answer's thinking, sent back: the template decides what it keeps
            thinking += str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": block.get("input") or {}}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text_of(block.get("content", ""), f"{param}.content")})
        else:
            raise InvalidRequest(f"{param}: unsupported content block type {kind!r}", param=f"{param}.content")
    own = [{"role": message["role"], "content": text, **({"tool_calls": calls} if calls else {}),
            **({"reasoning_content": thinking} if thinking else {})}]
    return results + (own if text or calls or thinking else [])


def _openai_tools(tools: object) -> object:
    if not isinstance(tools, list):
        return tools
    return [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {})}}
            if isinstance(t, dict) else t for t in tools]


async def messages(request: Request) -> Response:
    engine, model = request.state.engine, request.state.model
    body = parse_json_object(await request.body())
    job = await run_in_threadpool(parse_messages, body, engine.tokenizer, model)
    message_id = f"msg_{uuid.uuid4().hex}"
    handles = engine.submit_all([replace(job.requests[0], request_id=message_id)])
    reasoner = make_reasoning_splitter(engine.tokenizer, job.requests[0].prompt_ids, model.split_reasoning)
    choice = ChoiceState(0, engine.tokenizer, False, make_splitter(engine.tokenizer, job.tools), job.tools,
                         reasoner=reasoner)
    served = job.requests[0].adapter or model.model_id  # an adapter answers under its own name
    if job.stream:
        chunks = _message_stream(handles, choice, job, message_id, served)
        return EventStreamResponse(chunks, handles)
    (events,) = await collect_events(handles, request)
    for event in events:
        choice.add(event)
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": served,
        "content": _content_blocks(choice), **_stop_fields(choice, job, events, engine.tokenizer),
        "usage": _usage(choice, len(job.requests[0].prompt_ids)),
    })


def _content_blocks(choice: ChoiceState) -> list[dict[str, Any]]:
    """A thinking block (a thinking model's reasoning), the text, then tool_use blocks."""
    thinking = [{"type": "thinking", "thinking": choice.reasoning, "signature": ""}] if choice.reasoning else []
    blocks = [{"type": "text", "text": choice.text}] if choice.text or not choice.tool_calls else []
    return thinking + blocks + [_tool_use_block(call) for call in choice.tool_calls]


def _tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"] or "{}")}


def _stop_fields(choice: ChoiceState, job: Job, events: list[Any], tokenizer: Any) -> dict[str, Any]:
    """stop_reason, and which stop sequence ended the text (found again in the decoded output tokens)."""
    reason = STOP_REASONS.get(choice.finish_reason or "", "end_turn")
    stops = job.requests[0].stop
    if reason == "end_turn" and stops:
        full = tokenizer.decode([e.token_id for e in events if e.token_id is not None])
        found = sorted((full.find(s, len(choice.text)), s) for s in stops if full.find(s, len(choice.text)) >= 0)
        if found:
            return {"stop_reason": "stop_sequence", "stop_sequence": found[0][1]}
    return {"stop_reason": reason, "stop_sequence": None}


def _usage(choice: ChoiceState, prompt_tokens: int) -> dict[str, Any]:
    usage = choice.usage
    return {"input_tokens": usage.prompt_tokens if usage else prompt_tokens,
            "output_tokens": usage.completion_tokens if usage else 0,
            "cache_read_input_tokens": usage.cached_tokens if usage else 0}


async def _message_stream(handles: list[Any], choice: ChoiceState, job: Job, message_id: str,
                          model: str) -> AsyncIterator[bytes]:
    """message_start, content blocks (text deltas, whole tool_use blocks), message_delta, message_stop."""
    prompt_tokens = len(job.requests[0].prompt_ids)
    yield sse({"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}},
        "message_start")
    blocks = _BlockWriter()
    events = []
    async for _, event in merge_events(handles):
        events.append(event)
        try:
            delta = choice.add(event)
        except GenerationFailed as exc:
            yield sse(anthropic_error_body(exc), "error")
            return
        chunks = blocks.thinking(delta.reasoning) + blocks.text(delta.text)
        for chunk in chunks + [c for call in delta.tool_calls for c in blocks.tool_use(call)]:
            yield chunk
    for chunk in blocks.close():
        yield chunk
    stop = _stop_fields(choice, job, events, choice.tokenizer)
    yield sse({"type": "message_delta", "delta": stop, "usage": {"output_tokens": _usage(choice, 0)["output_tokens"]}},
              "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")


class _BlockWriter:
    """Numbers content blocks and opens/closes the thinking and text blocks around each other and tool_use blocks."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None  # "thinking" or "text" while such a block is open

    def text(self, text: str) -> list[bytes]:
        return self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": text}, text)

    def thinking(self, text: str) -> list[bytes]:
        block = {"type": "thinking", "thinking": "", "signature": ""}
        return self._delta("thinking", block, {"type": "thinking_delta", "thinking": text}, text)

    def _delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any], text: str) -> list[bytes]:
        if not text:
            return []
        out = [] if self.open_kind == kind else self.close() + self._start(block)
        self.open_kind = kind
        return out + [sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")]

    def tool_use(self, call: dict[str, Any]) -> list[bytes]:
        block = _tool_use_block(call)
        out = self.close() + self._start({**block, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        return out + [sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                          "content_block_delta")] + self.close(force=True)

    def close(self, force: bool = False) -> list[bytes]:
        if not (self.open_kind or force):
            return []
        self.open_kind = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        return [sse({"type": "content_block_start", "index": self.index, "content_block": block},
                    "content_block_start")]
