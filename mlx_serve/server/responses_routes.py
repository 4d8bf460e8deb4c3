"""OpenAI's Responses API (`POST /v1/responses`), over the chat route's machinery.

The input (a string, or message, function-call and function-call-output items), `instructions`, function `tools`,
`tool_choice`, `text.format` (JSON schema) and the sampling fields become a chat request (`parse_chat`), so the
template, tool parsing, grammar and reasoning split are the chat route's own. The answer comes back as output
items: a reasoning item (a thinking model's reasoning), a message with its output text, then function calls;
streamed as the API's typed events. With `store` (the API's default) the last `MAX_STORED` responses are kept in
memory, so `previous_response_id` continues a conversation and `GET /v1/responses/{id}` returns one; a restart
forgets them.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_serve.errors import InvalidRequest, MlxServeError, NotFound
from mlx_serve.server import openai_format as fmt
from mlx_serve.server.openai_routes import choice_states, parse_chat
from mlx_serve.server.protocol import Job, ModelInfo, openai_error_body, parse_json_object
from mlx_serve.server.streaming import EventStreamResponse, collect_events, merge_events, sse

PASSED_ON = ("temperature", "top_p", "top_k", "min_p", "seed", "stream", "parallel_tool_calls", "priority",
             "cache_salt", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "chat_template_kwargs", "min_tokens")  # fmt: skip


MAX_STORED = 1024  # responses kept for `previous_response_id` and GET


@dataclass(frozen=True, slots=True)
class StoredResponse:
    conversation: list[dict[str, Any]]  # its input and answer as chat messages (instructions are not carried on)
    body: dict[str, Any]  # the response object as it was returned


class ResponseStore:
    """The last `most` stored responses, oldest forgotten first; shared by the event loop and worker threads."""

    def __init__(self, most: int = MAX_STORED) -> None:
        self._most = most
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            while len(self._items) > self._most:
                self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        with self._lock:
            stored = self._items.get(response_id)
        if stored is None:
            raise NotFound(f"no stored response {response_id!r} (responses are kept in memory, the last "
                           f"{self._most})", param=param)  # fmt: skip
        return stored

    def delete(self, response_id: str) -> None:
        with self._lock:
            if self._items.pop(response_id, None) is None:
                raise NotFound(f"no stored response {response_id!r}", param="response_id")


def chat_body(body: dict[str, Any], store: ResponseStore | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat-completions request a Responses request asks for, and its conversation so far (without the
    instructions): the previous response's, where `previous_response_id` names one, then this input."""
    if "input" not in body:
        raise InvalidRequest("input is required", param="input")
    earlier: list[dict[str, Any]] = []
    if (previous := body.get("previous_response_id")) is not None:
        if not isinstance(previous, str) or store is None:
            raise InvalidRequest("previous_response_id must name a stored response", param="previous_response_id")
        earlier = store.get(previous, param="previous_response_id").conversation
    conversation = [*earlier, *_messages(body["input"])]
    messages = list(conversation)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("instructions must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat = {name: body[name] for name in PASSED_ON if name in body}
    chat.update(model=body.get("model"), messages=messages)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if (formatted := _response_format(body.get("text"))) is not None:
        chat["response_format"] = formatted
    return chat, conversation


def _messages(value: object) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}  # fmt: skip
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})  # fmt: skip
        elif kind != "reasoning":  # earlier reasoning is not fed back (the chat templates drop it too)
            raise InvalidRequest(f"input[{i}]: unsupported item type {kind!r}", param="input")
    return messages


def _text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        kinds = {p.get("type") for p in content} - {"input_text", "output_text", "text"}
        if kinds:
            raise InvalidRequest(f"input[{index}]: unsupported content part {sorted(map(str, kinds))}", param="input")
        return "".join(str(p.get("text", "")) for p in content)
    raise InvalidRequest(f"input[{index}].content must be a string or a list of text parts", param="input")


def _tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", param="tools")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest("only function tools are served", param="tools")
        spec = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
        out.append({"type": "function", "function": spec})
    return out


def _tool_choice(choice: object) -> object:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: object) -> dict[str, Any] | None:
    if text is None:
        return None
    form = text.get("format") if isinstance(text, dict) else None
    if form is None or (isinstance(form, dict) and form.get("type") == "text"):
        return None
    if not isinstance(form, dict) or form.get("type") not in ("json_schema", "json_object"):
        raise InvalidRequest("text.format.type must be text, json_schema or json_object", param="text")
    if form["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": form.get("name", "answer"), "schema": form.get("schema", {})}}


@dataclass(slots=True)
class Output:
    """The response being built: its items in order, and ids that stay the same while streaming."""

    response_id: str
    model: str
    created: int
    body: dict[str, Any]
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    reasoning_id: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")

    def items(self, choice: fmt.ChoiceState) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if choice.reasoning:
            items.append(self.reasoning_item(choice.reasoning))
        if choice.text or not choice.tool_calls:
            items.append(self.message_item(choice.text, "completed"))
        items += [function_call_item(call) for call in choice.tool_calls]
        return items

    def reasoning_item(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip

    def message_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def response(self, status: str, items: list[dict[str, Any]], choice: fmt.ChoiceState | None) -> dict[str, Any]:
        usage = choice.usage if choice is not None else None
        incomplete = choice is not None and choice.finish_reason == "length"
        return {
            "id": self.response_id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "output": items, "instructions": self.body.get("instructions"),
            "max_output_tokens": self.body.get("max_output_tokens"), "temperature": self.body.get("temperature"),
            "top_p": self.body.get("top_p"), "tools": self.body.get("tools") or [],
            "tool_choice": self.body.get("tool_choice", "auto"),
            "parallel_tool_calls": self.body.get("parallel_tool_calls", True),
            "previous_response_id": self.body.get("previous_response_id"),
            "text": self.body.get("text") or {"format": {"type": "text"}}, "metadata": {},
            "store": self.body.get("store", True) is not False,
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},  # not counted
                "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            },
        }  # fmt: skip


def function_call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "status": "completed",
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}  # fmt: skip


# chat fields an error may name, and the Responses fields the caller wrote instead
CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format": "text"}  # fmt: skip


def parse_responses(body: dict[str, Any], tokenizer: Any, model: ModelInfo,
                    store: ResponseStore | None = None) -> tuple[Job, list[dict[str, Any]]]:  # fmt: skip
    chat, conversation = chat_body(body, store)
    try:
        job = parse_chat(chat, tokenizer, model)
    except MlxServeError as exc:  # name the field as the caller wrote it
        exc.param = CHAT_FIELDS.get(exc.param, exc.param)
        raise
    if len(job.requests) != 1:
        raise InvalidRequest("a response has one answer", param="n")
    return job, conversation


async def responses(request: Request) -> Response:
    engine, model, store = request.state.engine, request.state.model, request.state.responses
    body = parse_json_object(await request.body())
    job, conversation = await run_in_threadpool(parse_responses, body, engine.tokenizer, model, store)
    response_id = f"resp_{uuid.uuid4().hex}"
    handles = engine.submit_all([replace(job.requests[0], request_id=response_id)])
    output = Output(response_id, job.requests[0].adapter or model.model_id, int(time.time()), body)
    [choice] = choice_states(job, engine.tokenizer)
    keep = store if body.get("store", True) is not False else None

    def finished(response: dict[str, Any]) -> None:
        if keep is not None:
            keep.put(response_id, StoredResponse([*conversation, _answer_message(choice)], response))

    if job.stream:
        return EventStreamResponse(_stream(output, choice, handles, finished), handles)
    for event in (await collect_events(handles, request))[0]:
        choice.add(event)
    response = output.response("completed", output.items(choice), choice)
    finished(response)
    return JSONResponse(response)


async def retrieve_response(request: Request) -> Response:
    return JSONResponse(request.state.responses.get(request.path_params["response_id"]).body)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    request.state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _answer_message(choice: fmt.ChoiceState) -> dict[str, Any]:
    """The answer as the assistant's chat message, for the conversation a later response continues."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    return message


async def _stream(output: Output, choice: fmt.ChoiceState, handles: Sequence[Any],
                  finished: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:  # fmt: skip
    """The API's typed events: created, then each output item added, its deltas, done; then completed."""
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        return sse({"type": kind, "sequence_number": sequence - 1, **fields}, event=kind)

    yield event("response.created", response=output.response("in_progress", [], None))
    yield event("response.in_progress", response=output.response("in_progress", [], None))
    opened: list[str] = []  # "reasoning", "message": the items streamed so far, in order

    def open_item(kind: str) -> list[bytes]:
        index = len(opened)
        opened.append(kind)
        if kind == "reasoning":
            item = {**output.reasoning_item(""), "content": []}
            part = {"type": "reasoning_text", "text": ""}
            item_id = output.reasoning_id
        else:
            item, part, item_id = output.message_item(None, "in_progress"), {"type": "output_text", "text": "",
                                                                              "annotations": []}, output.message_id
        return [event("response.output_item.added", output_index=index, item=item),
                event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                      part=part)]  # fmt: skip

    async for _, token_event in merge_events(handles):
        try:
            delta = choice.add(token_event)
        except fmt.GenerationFailed as exc:
            yield event("error", **openai_error_body(exc)["error"])
            return
        if delta.reasoning:
            if "reasoning" not in opened:
                for chunk in open_item("reasoning"):
                    yield chunk
            yield event("response.reasoning_text.delta", item_id=output.reasoning_id,
                        output_index=opened.index("reasoning"), content_index=0, delta=delta.reasoning)  # fmt: skip
        if delta.text:
            if "message" not in opened:
                for chunk in open_item("message"):
                    yield chunk
            yield event("response.output_text.delta", item_id=output.message_id, output_index=opened.index("message"),
                        content_index=0, delta=delta.text, logprobs=[])  # fmt: skip
    items = output.items(choice)
    for index, item in enumerate(items):
        if item["type"] == "function_call":
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])  # fmt: skip
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])  # fmt: skip
        else:
            if item["type"] not in opened:  # an empty message (the answer was tool calls only, or nothing)
                for chunk in open_item(item["type"]):
                    yield chunk
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            yield event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], **({"logprobs": []} if kind == "output_text" else {}))  # fmt: skip
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part)  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=item)
    response = output.response("completed", items, choice)
    finished(response)
    yield event("response.completed", response=response)
