"""Chat prompts and tool calls: messages go through the model's chat template, and generated tool-call
text is split out and parsed by mlx-lm's tool parser for the model (`tokenizer.tool_parser`)."""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlx_serve.errors import InvalidRequest, parse_client_json

log = logging.getLogger(__name__)

ROLES = {"system", "developer", "user", "assistant", "tool"}


def normalize_messages(messages: object) -> list[dict[str, Any]]:
    """OpenAI chat messages as chat templates expect them: string content, tool-call arguments as dicts."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    return [_normalize_message(m, i) for i, m in enumerate(messages)]


def _normalize_message(message: object, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or message["role"] not in ROLES:
        raise InvalidRequest(f"{param} must be an object with a role in {sorted(ROLES)}", param=param)
    out = dict(message)
    if out["role"] == "developer":
        out["role"] = "system"
    out["content"] = _content_text(message.get("content"), param)
    if message.get("tool_calls") is not None:
        out["tool_calls"] = [_template_tool_call(call, param) for call in _as_list(message["tool_calls"], param)]
    return out


def _content_text(content: object, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidRequest(f"{param}.content must be a string or a list of text parts", param=f"{param}.content")


def _as_list(value: object, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidRequest(f"{param}.tool_calls must be a list", param=f"{param}.tool_calls")
    return value


def _template_tool_call(call: object, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequest(f"{param}.tool_calls entries need function.name", param=f"{param}.tool_calls")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        arguments = parse_client_json(arguments, f"{param} tool-call arguments", f"{param}.tool_calls")
    return {**call, "function": {**function, "arguments": arguments}}


def validate_tools(tools: object) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise InvalidRequest("tools must be a list of {type: function, function: {name, ...}}", param="tools")
    return tools or None


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                template_kwargs: dict[str, Any] | None = None, continue_final: bool = False) -> list[int]:
    """Token ids of the conversation plus the assistant's generation prompt; with `continue_final`, the last
    (assistant) message left open instead, for the answer to continue it (a prefilled answer)."""
    if continue_final and messages[-1]["role"] != "assistant":
        raise InvalidRequest("continuing the final message needs the last message to be the assistant's",
                             param="messages")
    if not getattr(tokenizer, "has_chat_template", False):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return list(tokenizer.encode(text[:-1] if continue_final else text + "assistant: "))
    try:
        return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=not continue_final,
                                                  continue_final_message=continue_final, tokenize=True,
                                                  **(template_kwargs or {})))
    except Exception as exc:  # jinja raises its own errors (raise_exception in templates)
        raise InvalidRequest(f"The chat template rejected the messages: {exc}", param="messages") from None


@dataclass(slots=True)
class ToolCallSplitter:
    """Splits streamed text into plain text and complete tool-call texts between the model's markers."""

    start: str
    end: str
    _held: str = ""
    _in_call: bool = False
    calls: list[str] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[str]]:
        """Plain text safe to show now, and tool-call texts completed by this piece."""
        self._held += text
        plain, done = "", []
        while True:
            marker = self.end if self._in_call else self.start
            at = self._held.find(marker)
            if at < 0:
                break
            if self._in_call:
                done.append(self._held[:at])
            else:
                plain += self._held[:at]
            self._held = self._held[at + len(marker):]
            self._in_call = not self._in_call
        if not self._in_call:
            keep = partial_suffix(self._held, self.start)
            plain += self._held[: len(self._held) - keep]
            self._held = self._held[len(self._held) - keep:]
        self.calls.extend(done)
        return plain, done

    def finish(self) -> tuple[str, list[str]]:
        """At the end of output an unterminated call still counts as a call (as in mlx-lm's server)."""
        held, self._held = self._held, ""
        if self._in_call and held.strip():
            self.calls.append(held)
            return "", [held]
        return ("" if self._in_call else held), []


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def make_splitter(tokenizer: Any, tools: list[dict[str, Any]] | None) -> ToolCallSplitter | None:
    if not tools or not getattr(tokenizer, "has_tool_calling", False):
        return None
    return ToolCallSplitter(tokenizer.tool_call_start, tokenizer.tool_call_end)


def parse_tool_calls(tokenizer: Any, call_texts: list[str], tools: list[dict[str, Any]] | None,
                     first_index: int = 0) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` entries; a call the parser rejects is logged and dropped."""
    calls = []
    for text in call_texts:
        try:
            parsed = tokenizer.tool_parser(text, tools)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:  # json errors are ValueErrors
            log.warning("dropping an unparsable tool call (%s: %s)", type(exc).__name__, exc)
            continue
        for call in parsed if isinstance(parsed, list) else [parsed]:
            calls.append(_openai_tool_call(call, first_index + len(calls)))
    return calls


def _openai_tool_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    arguments = call.get("arguments", {})
    return {
        "index": index,
        "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"],
                     "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
    }
