"""`response_format` through the official `openai` client: every token under the JSON grammar (llguidance),
streamed or not, beside unconstrained requests that still equal mlx-lm; bad formats are 400s."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.server.reference import chat_prompt_ids, greedy_text

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Answer in JSON about item {i}."}]


def _valid(content: str) -> dict:
    value = json.loads(content)
    assert set(value) == {"ok", "color"} and isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
    return value


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_follow_the_schema(served, client, temperature):
    # ignore_eos cannot make a finished grammar run on: its end-of-sequence still ends the answer
    reply = client.chat.completions.create(model=served.engine.model_id, messages=_messages(0), max_tokens=60,
                                           temperature=temperature, seed=3, response_format=FORMAT,
                                           extra_body={"ignore_eos": temperature > 0})
    assert reply.choices[0].finish_reason == "stop"
    _valid(reply.choices[0].message.content)


def test_streamed_json_follows_the_schema_and_free_text_beside_it_equals_mlx_lm(served, client):
    free = [{"role": "user", "content": "Say something free."}]
    ids = chat_prompt_ids(served.engine.tokenizer, free, None)
    expected, _, _ = greedy_text(served.model_path, served.engine.tokenizer, ids, 12)

    def constrained(i: int) -> str:
        chunks = client.chat.completions.create(model=served.engine.model_id, messages=_messages(i), max_tokens=60,
                                                temperature=0, response_format=FORMAT, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def unconstrained() -> str:
        reply = client.chat.completions.create(model=served.engine.model_id, messages=free, max_tokens=12,
                                               temperature=0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(constrained, i) for i in range(3)]
        free_text = pool.submit(unconstrained)
        for stream in streams:
            _valid(stream.result())
        assert free_text.result() == expected


def test_json_object_is_an_object(served, client):
    reply = client.chat.completions.create(model=served.engine.model_id, messages=_messages(1), max_tokens=40,
                                           temperature=0, response_format={"type": "json_object"})
    content, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert content.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert reason == "length"


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        ({"type": "xml"}, "response_format.type must be"),
        ({"type": "json_schema"}, "must be an object with a `schema`"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "objectx"),
    ],
)
def test_bad_response_formats_are_400s(served, client, response_format, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=served.engine.model_id, messages=_messages(2), max_tokens=4,
                                       response_format=response_format)
    assert message in str(info.value)
    assert info.value.body["param"] == "response_format"
