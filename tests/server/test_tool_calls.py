"""Tool calls, deterministically: a fake engine emits a scripted tool-call text, the server parses it with
mlx-lm's parser for the model and answers in OpenAI and Anthropic shapes (streaming and not)."""

from __future__ import annotations

import json

from anthropic.types import Message
from hypothesis import given
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from mlx_serve.server.tools import ToolCallSplitter, parse_tool_calls

CALL_TEXT = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
        "max_tokens": 200}


def _sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_non_streaming_chat_returns_parsed_tool_calls(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(CALL_TEXT)
    reply = ChatCompletion.model_validate(fake_client.post("/v1/chat/completions", json=CHAT).json())
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")


def test_streaming_chat_sends_tool_calls_as_deltas(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(CALL_TEXT)
    response = fake_client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    chunks = [ChatCompletionChunk.model_validate(c) for c in _sse_data(response.text)]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check."
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_text_is_left_alone(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(CALL_TEXT)
    body = {k: v for k, v in CHAT.items() if k != "tools"}
    reply = fake_client.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["message"]["content"] == CALL_TEXT
    assert reply["choices"][0]["finish_reason"] == "stop"


ANTHROPIC = {"model": "fake-model", "max_tokens": 200, "messages": [{"role": "user", "content": "weather?"}],
             "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}


def test_anthropic_message_returns_tool_use_blocks(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(CALL_TEXT)
    message = Message.model_validate(fake_client.post("/v1/messages", json=ANTHROPIC).json())
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[1].name == "get_weather" and message.content[1].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"


def test_anthropic_stream_sends_a_tool_use_block(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(CALL_TEXT)
    events = _sse_data(fake_client.post("/v1/messages", json={**ANTHROPIC, "stream": True}).text)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    json_deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta"]
    assert starts == ["text", "tool_use"]
    assert json.loads("".join(json_deltas)) == {"city": "Paris"}
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["tool_use"]
    assert events[-1]["type"] == "message_stop"


def test_anthropic_tool_use_and_result_are_rendered_through_the_template(fake_engine, fake_client, tiny_tokenizer):
    body = {**ANTHROPIC, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}]},
    ]}
    assert fake_client.post("/v1/messages", json=body).status_code == 200
    prompt = tiny_tokenizer.decode(list(fake_engine.submitted[-1].prompt_ids))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nSunny\n</tool_response>" in prompt


def test_an_unparsable_call_is_dropped(tiny_tokenizer):
    assert parse_tool_calls(tiny_tokenizer, ["{not json"], None) == []
    # a model's output, as deep or as long as it likes: json.loads fails with RecursionError or a plain ValueError
    deep = '{"name": "get_weather", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"
    long = '{"name": "get_weather", "arguments": {"n": ' + "1" * 5000 + "}}"
    assert parse_tool_calls(tiny_tokenizer, [deep, long], None) == []


@given(st.lists(st.integers(min_value=1, max_value=len(CALL_TEXT) - 1), max_size=12, unique=True))
def test_splitter_gives_the_same_result_for_any_chunking(cuts):
    points = [0, *sorted(cuts), len(CALL_TEXT)]
    splitter = ToolCallSplitter("<tool_call>", "</tool_call>")
    plain = "".join(splitter.feed(CALL_TEXT[a:b])[0] for a, b in zip(points, points[1:]))
    plain += splitter.finish()[0]
    assert plain == "Let me check."
    assert [json.loads(c) for c in splitter.calls] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]


def test_splitter_keeps_text_that_only_looks_like_a_marker_start():
    splitter = ToolCallSplitter("<tool_call>", "</tool_call>")
    assert splitter.feed("a <tool") == ("a ", [])
    assert splitter.feed("box>") == ("<toolbox>", [])
    assert splitter.feed("<tool_call>{\"name\": \"f\"") == ("", [])
    assert splitter.finish() == ("", ['{"name": "f"'])  # unterminated at the end still counts as a call
