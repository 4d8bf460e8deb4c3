"""HTTP-layer behaviour that needs a controllable engine: engine errors, n > 1 fan-out, extension fields."""

from __future__ import annotations

import json

from tests.server.fake_engine import fake_token

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_an_engine_error_is_a_500_body_and_the_next_request_is_served(fake_engine, fake_client):
    fake_engine.fail_with = "kernel exploded"
    response = fake_client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500
    assert "kernel exploded" in response.json()["error"]["message"]
    stream = fake_client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert any("kernel exploded" in c.get("error", {}).get("message", "") for c in _sse_data(stream.text))
    fake_engine.fail_with = None
    assert fake_client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_n_submits_one_request_per_choice_with_seed_plus_i(fake_engine, fake_client, tiny_tokenizer):
    reply = fake_client.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 10, "temperature": 0.8}).json()
    seeds = [r.sampling.seed for r in fake_engine.submitted]
    assert seeds == [10, 11, 12]
    assert len({r.request_id for r in fake_engine.submitted}) == 3
    for choice, request in zip(sorted(reply["choices"], key=lambda c: c["index"]), fake_engine.submitted):
        expected = [fake_token(request, i, fake_engine.vocab_size) for i in range(3)]
        assert choice["message"]["content"] == tiny_tokenizer.decode(expected)
    assert reply["usage"]["completion_tokens"] == 9


def test_streamed_completions_with_n_carry_every_index(fake_client):
    body = {"model": "fake-model", "prompt": "abc", "max_tokens": 2, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = _sse_data(fake_client.post("/v1/completions", json=body).text)
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_a_refused_choice_cancels_the_ones_already_submitted(fake_engine, fake_client):
    fake_engine.queue_limit = 2
    response = fake_client.post("/v1/chat/completions", json={**CHAT, "n": 3, "max_tokens": 50})
    assert response.status_code == 429
    assert sorted(fake_engine.cancelled) == sorted(r.request_id for r in fake_engine.submitted)
    assert fake_engine.active == {}


def test_extension_fields_reach_the_engine(fake_engine, fake_client):
    body = {**CHAT, "priority": 0, "cache_salt": "tenant-a", "top_k": 5, "min_p": 0.1, "stop": "x",
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "logit_bias": {"7": 2.5}, "ignore_eos": True}
    assert fake_client.post("/v1/chat/completions", json=body).status_code == 200
    request = fake_engine.submitted[-1]
    assert (request.priority, request.cache_salt, request.stop, request.ignore_eos) == (0, "tenant-a", ("x",), True)
    sampling = request.sampling
    assert (sampling.top_k, sampling.min_p, sampling.presence_penalty, sampling.frequency_penalty) == \
        (5, 0.1, 0.5, 0.25)
    assert sampling.logit_bias == {7: 2.5}


def test_message_shapes_are_normalised_for_the_template(fake_engine, fake_client, tiny_tokenizer):
    body = {**CHAT, "messages": [{"role": "developer", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}]}
    assert fake_client.post("/v1/chat/completions", json=body).status_code == 200
    prompt = tiny_tokenizer.decode(list(fake_engine.submitted[-1].prompt_ids))
    assert "<|im_start|>system\nbe brief<|im_end|>" in prompt and "<|im_start|>user\nab<|im_end|>" in prompt


def test_stream_options_need_stream(fake_client):
    response = fake_client.post("/v1/chat/completions", json={**CHAT, "stream_options": {"include_usage": True}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"


def test_default_max_tokens_fills_the_context(fake_engine, fake_client):
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    fake_engine.script = [5, 6]
    assert fake_client.post("/v1/chat/completions", json=body).status_code == 200
    request = fake_engine.submitted[-1]
    assert request.max_tokens == fake_engine.context_length - len(request.prompt_ids)
