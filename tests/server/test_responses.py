"""OpenAI's Responses API: text answers equal the chat route's for the same conversation (a real engine, the
official client, streamed and not); tool calls and the typed stream events checked against the `openai` package's
own models with a scripted fake engine; what is not served is a 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.test_tool_calls import CALL_TEXT, _sse_data

WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)


def test_a_text_answer_equals_the_chat_routes_streamed_and_not(served, client):
    chat = client.chat.completions.create(
        model="default", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}])
    reply = client.responses.create(model="default", instructions="Be brief.", input="Name a colour.",
                                    max_output_tokens=12, temperature=0)  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                      chat.usage.completion_tokens)  # fmt: skip
    assert reply.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(model="default", instructions="Be brief.", input="Name a colour.",
                                          max_output_tokens=12, temperature=0, stream=True))  # fmt: skip
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    assert events[-1].response.output_text == reply.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_conversation_with_a_function_call_and_its_output_is_the_chat_routes(served, client):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}, call,
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]  # fmt: skip
    reply = client.responses.create(model="default", input=items, tools=[WEATHER], max_output_tokens=10,
                                    temperature=0)  # fmt: skip
    chat = client.chat.completions.create(model="default", max_tokens=10, temperature=0, tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])  # fmt: skip
    assert reply.output_text == (chat.choices[0].message.content or "")


def test_tool_calls_become_function_call_items_and_stream_as_typed_events(fake_engine, fake_client, tiny_tokenizer):
    fake_engine.script = tiny_tokenizer.encode(CALL_TEXT)
    body = {"model": "fake-model", "input": "weather?", "tools": [WEATHER], "max_output_tokens": 200}
    reply = Response.model_validate(fake_client.post("/v1/responses", json=body).json())
    message, function_call = reply.output
    assert message.type == "message" and message.content[0].text == "Let me check."
    assert function_call.type == "function_call" and function_call.name == "get_weather"
    assert json.loads(function_call.arguments) == {"city": "Paris"} and function_call.call_id.startswith("call_")
    fake_engine.script = tiny_tokenizer.encode(CALL_TEXT)
    events = [EVENTS.validate_python(e) for e in _sse_data(fake_client.post("/v1/responses",
                                                                            json={**body, "stream": True}).text)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me check."
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == {"city": "Paris"}
    assert [item.type for item in events[-1].response.output] == ["message", "function_call"]


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": [{"type": "image_generation_call"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text"),
])  # fmt: skip
def test_what_is_not_served_is_a_400_naming_the_field(fake_client, body, param):
    response = fake_client.post("/v1/responses", json={"model": "fake-model", **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_a_thinking_models_reasoning_is_a_reasoning_item_before_the_message(fake_engine, fake_client, tiny_tokenizer):
    from tests.server.test_reasoning import THOUGHT

    body = {"model": "fake-model", "input": "weather?", "max_output_tokens": 200}
    fake_engine.script = tiny_tokenizer.encode(THOUGHT + "Sunny in Paris.")
    reply = Response.model_validate(fake_client.post("/v1/responses", json=body).json())
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "\nThe user wants the weather.\n"
    assert message.content[0].text == "\n\nSunny in Paris." and reply.output_text == "\n\nSunny in Paris."
    fake_engine.script = tiny_tokenizer.encode(THOUGHT + "Sunny in Paris.")
    events = [EVENTS.validate_python(e) for e in _sse_data(fake_client.post("/v1/responses",
                                                                            json={**body, "stream": True}).text)]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert [e.output_index for e in events if e.type == "response.output_text.delta"][0] == 1
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


def test_a_stored_response_is_continued_retrieved_and_deleted(served, client):
    first = client.responses.create(model="default", input="Name a colour.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model="default", input="And another?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)  # fmt: skip
    chat = client.chat.completions.create(model="default", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"}])  # fmt: skip
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id and second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="default", input="hi", previous_response_id=first.id, max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="default", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_streamed_response_is_stored_when_it_completes(served, client):
    events = list(client.responses.create(model="default", input="Name a fruit.", max_output_tokens=6,
                                          temperature=0, stream=True))  # fmt: skip
    done = events[-1].response
    assert client.responses.retrieve(done.id).output_text == done.output_text


def test_errors_name_the_responses_fields(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="default", input="x " * 100_000, max_output_tokens=4)
    assert caught.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="default", input="hi", text={"format": {"type": "json_schema", "name": "a",
                                                                              "schema": {"type": "nonsense"}}})
    assert caught.value.body["param"] == "text"
