"""The official `anthropic` client against a real server: a streaming and a non-streaming message."""

from __future__ import annotations

import anthropic
import pytest

from mlx_serve.server.tools import normalize_messages, render_chat
from tests.server.reference import chat_prompt_ids, greedy_text

MAX_TOKENS = 8
SYSTEM = "You are terse."
GREEDY = {"temperature": 0}  # this client version has no temperature argument; the API still takes the field
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]


@pytest.fixture(scope="module")
def client(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(served) -> tuple[str, int, str, int]:
    ids = chat_prompt_ids(served.engine.tokenizer, [{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": "Name a colour."}])
    return (*greedy_text(served.model_path, served.engine.tokenizer, ids, MAX_TOKENS), len(ids))


def test_non_streaming_message_matches_mlx_lm(served, client, expected):
    text, n_tokens, reason, n_prompt = expected
    message = client.messages.create(model=served.engine.model_id, system=SYSTEM, messages=MESSAGES,
                                     max_tokens=MAX_TOKENS, extra_body=GREEDY)
    assert message.role == "assistant" and message.type == "message"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == text
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reason]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (n_prompt, n_tokens)


def test_streaming_message_matches_mlx_lm(served, client, expected):
    text, n_tokens, reason, _ = expected
    with client.messages.stream(model=served.engine.model_id, system=SYSTEM, messages=MESSAGES,
                                max_tokens=MAX_TOKENS, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.content[0].text == text
    assert final.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reason]
    assert final.usage.output_tokens == n_tokens


def test_stop_sequence_is_reported(served, client, expected):
    text = expected[0]
    stop = text[2:4]
    message = client.messages.create(model=served.engine.model_id, system=SYSTEM, messages=MESSAGES,
                                     max_tokens=MAX_TOKENS, stop_sequences=[stop], extra_body=GREEDY)
    assert message.content[0].text == text[: text.find(stop)]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def test_count_tokens_is_the_prompt_a_message_would_take(served, client, expected):
    counted = client.messages.count_tokens(model=served.engine.model_id, system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == expected[3]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=served.engine.model_id, messages=[{"role": "wizard", "content": "x"}])


def test_a_prefilled_assistant_turn_is_continued(served, client):
    """Anthropic's prefill: a last assistant message is the start of the answer; the reply holds what follows."""
    messages = [*MESSAGES, {"role": "assistant", "content": "My colour is"}]
    openai_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."},
                       {"role": "assistant", "content": "My colour is"}]  # fmt: skip
    ids = render_chat(served.engine.tokenizer, normalize_messages(openai_messages), None, continue_final=True)
    text, n_tokens, _ = greedy_text(served.model_path, served.engine.tokenizer, ids, MAX_TOKENS)
    message = client.messages.create(model=served.engine.model_id, system=SYSTEM, messages=messages,
                                     max_tokens=MAX_TOKENS, extra_body=GREEDY)  # fmt: skip
    assert message.content[0].text == text
    assert (message.usage.input_tokens, message.usage.output_tokens) == (len(ids), n_tokens)
