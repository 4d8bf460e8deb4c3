"""vLLM's /tokenize and /detokenize against a real server: a prompt's ids as the completion and chat routes make
them, and back to text; bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.server.reference import chat_prompt_ids


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


def test_a_prompt_and_messages_tokenize_as_the_routes_render_them(http, served):
    tokenizer = served.engine.tokenizer
    reply = http.post("/tokenize", json={"prompt": "hello there"}).json()
    assert reply["tokens"] == tokenizer.encode("hello there")
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == served.engine.context_length
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = http.post("/tokenize", json={"messages": messages}).json()
    assert reply["tokens"] == chat_prompt_ids(tokenizer, messages)
    assert http.post("/tokenize", json={"prompt": [5, 6, 7]}).json()["tokens"] == [5, 6, 7]


def test_detokenize_gives_the_text_back(http, served):
    ids = served.engine.tokenizer.encode("hello there")
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "hello there"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code in (400, 404)
    assert response.json()["error"]["param"] == param
