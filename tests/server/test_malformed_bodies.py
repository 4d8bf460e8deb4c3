"""Property: whatever a client puts in a request body, the server answers with a result or its API's 4xx error body,
never a 500, and keeps serving. Bodies are valid requests with one to three fields swapped for odd JSON values."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from mlx_serve.server import ServerMetrics, create_app
from tests.server.fake_engine import FakeEngine

MODEL = "fake-model"
DELETED = object()
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                         "properties": {"a": {"type": "string"}}}}}]
VALID = {
    "/v1/chat/completions": {
        "model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "stop": ["x"], "n": 1, "logprobs": True,
        "top_logprobs": 2, "seed": 1, "stream": False, "tools": TOOLS, "tool_choice": "auto", "logit_bias": {"5": 1},
        "response_format": {"type": "text"}},
    "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 3, "echo": True, "logprobs": 2, "n": 1,
                        "stop": "\n", "stream": False, "seed": 3},
    "/v1/responses": {"model": MODEL, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 3,
                      "instructions": "x", "stream": False, "store": False, "text": {"format": {"type": "text"}}},
    "/v1/messages": {"model": MODEL, "max_tokens": 3, "system": "s", "stop_sequences": ["z"], "stream": False,
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                                     "input": {"a": "b"}}]},
                                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                "content": "ok"}]}],
                     "tools": [{"name": "f", "input_schema": {"type": "object"}}], "temperature": 0.3, "top_k": 5},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"model": MODEL, "prompt": "hi there"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
}
ODD = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, 2**63, -(2**70), 10**6, 0.5, -0.0, 1e308]),
    st.sampled_from(["", "x", "user", "assistant", "text", "\x00", "auto", "none", "required"]),
    st.sampled_from([[], {}, [None], [[]], {"type": None}, {"role": "user"}, [{"type": "text"}], [1, 2]]),
)


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every place in a JSON value where a field or an item could be swapped."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


def _swapped(body: dict, path: tuple, new: Any) -> dict:
    body = copy.deepcopy(body)
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    if new is DELETED:  # a field left out, or a list one item shorter
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return body


@st.composite
def malformed_requests(draw: st.DrawFn) -> tuple[str, dict]:
    route = draw(st.sampled_from(sorted(VALID)))
    body = VALID[route]
    for _ in range(draw(st.integers(1, 3))):
        if not (paths := list(_paths(body))):
            break
        body = _swapped(body, draw(st.sampled_from(paths)), draw(st.one_of(ODD, st.just(DELETED))))
    if "stream" in VALID[route] and draw(st.booleans()):
        body["stream"] = True
    return route, body


@pytest.fixture(scope="module")
def client(tiny_tokenizer: Any) -> Iterator[TestClient]:
    with TestClient(create_app(FakeEngine(tiny_tokenizer), ServerMetrics()), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("route", sorted(VALID))
def test_the_valid_bodies_are_served(client, route):
    assert client.post(route, json=VALID[route]).status_code == 200


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=malformed_requests())
def test_a_malformed_body_gets_a_result_or_a_client_error_never_a_500(client, request):
    route, body = request
    response = client.post(route, json=body)
    assert response.status_code == 200 or 400 <= response.status_code < 500, (response.status_code, response.text)
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error, dict) and error["message"] and error["type"]
    elif "text/event-stream" in response.headers["content-type"]:  # a stream ends, in an answer or an error event
        assert any(end in response.text for end in ("[DONE]", "message_stop", "response.completed", '"error"'))


HUGE_NUMBER = "1" * 5000  # past Python's 4,300-digit limit on int(): json.loads raises a plain ValueError
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": f'{{"a": {HUGE_NUMBER}}}'}}]}


@pytest.mark.parametrize(("route", "raw", "param", "message"), [
    ("/v1/chat/completions", "[" * 100_000 + "]" * 100_000, None, "nested too deeply"),
    ("/v1/chat/completions", f'{{"model": "{MODEL}", "max_tokens": {HUGE_NUMBER}}}', None, "not valid JSON"),
    ("/v1/chat/completions", json.dumps({**VALID["/v1/chat/completions"], "messages": [CALL]}),
     "messages[0].tool_calls", "tool-call arguments is not valid JSON"),
    ("/v1/chat/completions", json.dumps({**VALID["/v1/chat/completions"], "guided_json": "[" * 100_000}),
     "guided_json", "nested too deeply"),
    ("/v1/chat/completions", json.dumps({**VALID["/v1/chat/completions"], "messages": [{"role": {}, "content": "x"}]}),
     "messages[0]", "role in"),
    ("/v1/messages", json.dumps({**VALID["/v1/messages"], "messages": [{"role": "user", "content": []}]}),
     "messages[0].content", "must not be empty"),
    ("/v1/messages/count_tokens", json.dumps({"messages": [{"role": "user", "content": []}]}),
     "messages[0].content", "must not be empty"),
    ("/v1/messages/count_tokens", json.dumps({"messages": [{"role": "user", "content": [
        {"type": "redacted_thinking", "data": "x"}]}]}), "messages", "at least one message with content"),
])
def test_bodies_that_broke_the_parser_get_a_400(client, route, raw, param, message):
    response = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    if route.startswith("/v1/chat"):
        assert error["param"] == param


def test_a_final_empty_assistant_message_is_a_prefill_not_an_error(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}]
    response = client.post("/v1/messages/count_tokens", json={"messages": messages})
    alone = client.post("/v1/messages/count_tokens", json={"messages": messages[:1]})
    assert response.status_code == 200 and response.json() == alone.json()
