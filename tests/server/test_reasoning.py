"""A thinking model's reasoning in chat answers: the text between the think markers goes to `reasoning_content` (and
`reasoning`), the rest to `content`, streaming and not, with tool calls parsed from the answer only. The fake engine
emits scripted text; the splitter is checked against an independent split for any chunking."""

from __future__ import annotations

import json
import re

from anthropic.types import Message
from hypothesis import example, given
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from mlx_serve.server.reasoning import ReasoningSplitter, make_reasoning_splitter
from tests.server.test_tool_calls import TOOLS

THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 200}


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _split(text: str, start: str = "<think>", end: str = "</think>", opened: bool = False) -> tuple[str, str]:
    """(answer, reasoning) of a whole text, by regular expression."""
    text = start + text if opened else text
    blocks = re.findall(re.escape(start) + "(.*?)(?:" + re.escape(end) + r"|\Z)", text, flags=re.S)
    answer = re.sub(re.escape(start) + ".*?(?:" + re.escape(end) + r"|\Z)", "", text, flags=re.S)
    return answer, "".join(blocks)


def test_a_chat_answer_puts_the_thinking_apart(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(THOUGHT + "Sunny in Paris.")
    reply = fake_client.post("/v1/chat/completions", json=CHAT).json()
    message = ChatCompletion.model_validate(reply).choices[0].message
    assert message.content == "\n\nSunny in Paris."
    body = reply["choices"][0]["message"]
    assert body["reasoning_content"] == body["reasoning"] == "\nThe user wants the weather.\n"


def test_streamed_thinking_comes_as_reasoning_deltas(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(THOUGHT + "Sunny in Paris.")
    chunks = _sse(fake_client.post("/v1/chat/completions", json={**CHAT, "stream": True}).text)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nThe user wants the weather.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nSunny in Paris."
    assert not any("<think>" in (d.get("content") or "") for d in deltas)


def test_a_tool_call_after_the_thinking_is_parsed_and_one_inside_it_is_not(fake_engine, fake_client, tiny_tokenizer):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    fake_engine.script = tiny_tokenizer.encode("<think>maybe " + call + "</think>" + call)
    reply = fake_client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS}).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "maybe " + call
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert reply["choices"][0]["finish_reason"] == "tool_calls"


def test_a_text_completion_is_left_alone(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(THOUGHT + "Sunny.")
    reply = fake_client.post("/v1/completions", json={"prompt": "weather?", "max_tokens": 200}).json()
    assert reply["choices"][0]["text"] == THOUGHT + "Sunny."


def test_a_prompt_that_opened_a_think_block_starts_in_reasoning(tiny_tokenizer):
    opened = tiny_tokenizer.encode("<|im_start|>assistant\n<think>\n")
    closed = tiny_tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert make_reasoning_splitter(tiny_tokenizer, opened, True).in_reasoning
    assert not make_reasoning_splitter(tiny_tokenizer, closed, True).in_reasoning
    assert make_reasoning_splitter(tiny_tokenizer, opened, False) is None  # --reasoning raw


PIECES = ["a", "b", "\n", "<", ">", "/", "<think>", "</think>", "<th", "ink>", "</"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)


@given(TEXT, st.lists(st.integers(min_value=0, max_value=200), max_size=8), st.booleans())
@example("\n", [], True)  # reasoning that ends in a newline (a regular expression's `$` once stopped before it)
@example("<th", [2], False)  # a marker's start that never completes
def test_any_chunking_splits_as_the_whole_text_does(text, cuts, opened):
    splitter = ReasoningSplitter("<think>", "</think>", in_reasoning=opened)
    answer, reasoning = "", ""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for lo, hi in zip(bounds, bounds[1:]):
        a, r = splitter.feed(text[lo:hi])
        answer, reasoning = answer + a, reasoning + r
    a, r = splitter.finish()
    assert (answer + a, reasoning + r) == _split(text, opened=opened)


ANTHROPIC = {"model": "fake-model", "max_tokens": 200, "messages": [{"role": "user", "content": "weather?"}]}


def test_an_anthropic_message_leads_with_a_thinking_block(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(THOUGHT + "Sunny in Paris.")
    message = Message.model_validate(fake_client.post("/v1/messages", json=ANTHROPIC).json())
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "\nThe user wants the weather.\n"
    assert message.content[1].text == "\n\nSunny in Paris."


def test_an_anthropic_stream_sends_thinking_then_text_blocks(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(THOUGHT + "Sunny in Paris.")
    events = _sse(fake_client.post("/v1/messages", json={**ANTHROPIC, "stream": True}).text)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "\nThe user wants the weather.\n"
    assert "".join(d.get("text", "") for d in deltas) == "\n\nSunny in Paris."


def test_thinking_blocks_sent_back_reach_the_template(fake_engine, fake_client, tiny_tokenizer):
    """A client replays the last answer with its thinking block: accepted, and given to the chat template as the
    assistant message's reasoning_content (Qwen3's template keeps the last turn's)."""
    fake_engine.script = tiny_tokenizer.encode("ok")
    turn = {"role": "assistant", "content": [{"type": "thinking", "thinking": "it is sunny", "signature": ""},
                                             {"type": "redacted_thinking", "data": "x"},
                                             {"type": "text", "text": "Sunny."}]}  # fmt: skip
    body = {**ANTHROPIC, "messages": [*ANTHROPIC["messages"], turn, {"role": "user", "content": "thanks"}]}
    assert fake_client.post("/v1/messages", json=body).status_code == 200
    from mlx_serve.server.anthropic_routes import _openai_messages

    assert _openai_messages(body["messages"])[1] == {"role": "assistant", "content": "Sunny.",
                                                     "reasoning_content": "it is sunny"}  # fmt: skip
