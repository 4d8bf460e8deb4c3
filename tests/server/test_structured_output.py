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


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}},
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_answers_with_valid_calls(served, client, stream):
    kwargs = {"model": served.engine.model_id, "messages": _messages(3), "max_tokens": 80, "temperature": 1.0,
              "seed": 5, "tools": TOOLS, "tool_choice": "required"}  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        calls = [(tc.function.name, json.loads(tc.function.arguments)) for tc in deltas]
        reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(tc.function.name, json.loads(tc.function.arguments)) for tc in choice.message.tool_calls]
        reason = choice.finish_reason
    assert reason == "tool_calls" and calls
    for name, arguments in calls:
        assert (name, set(arguments)) in (("get_weather", {"city"}), ("get_time", {"utc"}))


def test_a_named_tool_choice_calls_that_tool(served, client):
    choice = client.chat.completions.create(
        model=served.engine.model_id, messages=_messages(4), max_tokens=80, temperature=0, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    ).choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments)["utc"], bool)


def test_anthropic_tool_choice_tool_forces_the_call(served):
    import anthropic

    claude = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    message = claude.messages.create(model=served.engine.model_id, max_tokens=80, tools=tools,
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     messages=[{"role": "user", "content": "weather?"}])
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.name == "get_weather" and use.input["city"] in ("Paris", "Rome")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot both"),
    ],
)
def test_bad_tool_choices_are_400s(served, client, extra, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=served.engine.model_id, messages=_messages(5), max_tokens=4, **extra)
    assert message in str(info.value) and info.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("single", [False, True])
def test_anthropic_any_tool_honours_disable_parallel_tool_use(served, single):
    import anthropic

    claude = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    uses = []
    for seed in range(4):
        message = claude.messages.create(
            model=served.engine.model_id, max_tokens=120, tools=tools,
            tool_choice={"type": "any", "disable_parallel_tool_use": single}, messages=[{"role": "user", "content": "go"}],
            extra_body={"seed": seed, "temperature": 1.0},
        )  # fmt: skip
        assert message.stop_reason == "tool_use"
        uses.append(sum(block.type == "tool_use" for block in message.content))
    assert all(n == 1 for n in uses) if single else max(uses) > 1, uses


def test_a_tool_schema_that_cannot_be_enforced_blames_tools(served, client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=served.engine.model_id, messages=_messages(6), max_tokens=4,
                                       tools=tools, tool_choice="required")
    assert "objectx" in str(info.value) and info.value.body["param"] == "tools"


# vLLM's guided decoding: a regular expression, a choice, a lark grammar, a schema (also as `structured_outputs`)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_regex_choice_grammar_and_json_hold_on_chat_and_completions(served, client, temperature):
    import re

    common = dict(model=served.engine.model_id, max_tokens=40, temperature=temperature, seed=5)
    chat = dict(common, messages=_messages(1))
    reply = client.chat.completions.create(**chat, extra_body={"guided_regex": "[a-z]{3}-[0-9]{2}"})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", reply.choices[0].message.content)
    reply = client.completions.create(**common, prompt="Pick:", extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert reply.choices[0].text in ("yes", "no", "maybe") and reply.choices[0].finish_reason == "stop"
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    reply = client.chat.completions.create(**chat, extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", reply.choices[0].message.content)
    reply = client.completions.create(**common, prompt="JSON:", extra_body={"structured_outputs": {"json": SCHEMA}})
    _valid(reply.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"guided_regex": "(("}, "guided_regex", "the regular expression cannot be enforced"),
        ({"guided_choice": []}, "guided_choice", "a list of non-empty strings"),
        ({"guided_grammar": "start: foo"}, "guided_grammar", "the lark grammar cannot be enforced"),
        ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "one kind of guided decoding"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "response_format and guided decoding cannot both"),
        ({"structured_outputs": "regex"}, "structured_outputs", "must be an object"),
    ],
)  # fmt: skip
def test_bad_guided_decoding_is_a_400_naming_the_field(served, client, extra, param, message):
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        client.chat.completions.create(model=served.engine.model_id, messages=_messages(2), max_tokens=5,
                                       extra_body=extra)  # fmt: skip
    assert caught.value.body["param"] == param
