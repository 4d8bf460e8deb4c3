"""The official `openai` client against a real server (real engine, tiny model, hypercorn on loopback).

Greedy outputs are compared with mlx-lm's own generation on the same prompt token ids.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from mlx_serve.server.tools import normalize_messages, render_chat
from tests.server.reference import chat_prompt_ids, greedy_text

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Tell me something about item number {i}."}]


def _expected(served, messages, max_tokens=MAX_TOKENS, tools=None):
    ids = chat_prompt_ids(served.engine.tokenizer, messages, tools)
    return (*greedy_text(served.model_path, served.engine.tokenizer, ids, max_tokens), len(ids))


def test_chat_non_streaming_matches_mlx_lm(served, client):
    text, n_tokens, reason, n_prompt = _expected(served, _messages(0))
    reply = client.chat.completions.create(model=served.engine.model_id, messages=_messages(0),
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == reason
    assert reply.usage.prompt_tokens == n_prompt
    assert reply.usage.completion_tokens == n_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_with_final_usage_chunk(served, client):
    text, n_tokens, reason, n_prompt = _expected(served, _messages(1))
    chunks = list(client.chat.completions.create(
        model=served.engine.model_id, messages=_messages(1), max_completion_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_tokens
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_with_token_ids_streaming_and_not(served, client):
    prompt = list(range(20, 45))
    text, n_tokens, reason = greedy_text(served.model_path, served.engine.tokenizer, prompt, MAX_TOKENS)
    reply = client.completions.create(model=served.engine.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0)
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (text, reason)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), n_tokens)
    stream = client.completions.create(model=served.engine.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == text


def test_chat_logprobs_are_the_greedy_choice(served, client):
    reply = client.chat.completions.create(model=served.engine.model_id, messages=_messages(2), max_tokens=4,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
        assert entry.logprob <= 0
    assert "".join(e.token for e in content).startswith(reply.choices[0].message.content)


def test_completion_logprobs_legacy_shape(served, client):
    reply = client.completions.create(model=served.engine.model_id, prompt="Hello there", max_tokens=4,
                                      temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_stop_string_cuts_the_output(served, client):
    text, _, _, _ = _expected(served, _messages(3), max_tokens=12)
    stop = text[4:6]
    reply = client.chat.completions.create(model=served.engine.model_id, messages=_messages(3), max_tokens=12,
                                           temperature=0, stop=[stop])
    assert reply.choices[0].message.content == text[: text.find(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible_and_n_uses_seed_plus_i(served, client):
    def sample(seed, n=1):
        reply = client.chat.completions.create(model=served.engine.model_id, messages=_messages(4), n=n,
                                               max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]

    assert sample(7) == sample(7)
    assert sample(7, n=3) == sample(7) + sample(8) + sample(9)


def test_n_greedy_choices_all_match_mlx_lm(served, client):
    text, n_tokens, _, _ = _expected(served, _messages(5))
    reply = client.chat.completions.create(model=served.engine.model_id, messages=_messages(5), n=3,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [text] * 3
    assert reply.usage.completion_tokens == 3 * n_tokens


def test_n_choices_over_a_long_prompt_compute_it_once(served, client):
    """n = 3 over a long system prompt: the choices arrive together, the first computes the prompt and the others
    wait a step and take it from the prefix cache (`shared_prefill_tokens`); every choice is still mlx-lm's."""
    system = " ".join(f"Rule {i}: answer briefly and cite item {i * 7 % 13}." for i in range(40))
    messages = [{"role": "system", "content": system}, *_messages(6)]
    text, n_tokens, _, n_prompt = _expected(served, messages)
    assert n_prompt > 300  # past the 256 tokens a request waits for, and a block more
    before = served.engine.stats()
    reply = client.chat.completions.create(model=served.engine.model_id, messages=messages, n=3,
                                           max_tokens=MAX_TOKENS, temperature=0)
    after = served.engine.stats()
    assert [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)] == [text] * 3
    assert after["shared_prefill_waits_total"] - before["shared_prefill_waits_total"] == 2
    computed = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert computed < 2 * n_prompt  # once, plus the other two's tails past the shared whole blocks


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_call_round_trip_renders_calls_and_results_through_the_template(served, client):
    """The assistant's tool_calls and the tool's result go back through the model's chat template."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    ids = chat_prompt_ids(served.engine.tokenizer, messages, [WEATHER_TOOL])
    rendered = served.engine.tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in rendered
    assert '{"type": "function", "function": {"name": "get_weather"' in rendered
    text, n_tokens, _ = greedy_text(served.model_path, served.engine.tokenizer, ids, MAX_TOKENS)
    reply = client.chat.completions.create(model=served.engine.model_id, messages=messages, tools=[WEATHER_TOOL],
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert reply.usage.prompt_tokens == len(ids)
    assert (reply.choices[0].message.content or "") == text


def test_32_concurrent_streaming_clients_match_mlx_lm(served):
    expected = [_expected(served, _messages(100 + i)) for i in range(32)]

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await aclient.chat.completions.create(
            model=served.engine.model_id, messages=_messages(100 + i), max_tokens=MAX_TOKENS, temperature=0,
            stream=True)
        pieces, reason = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
        return "".join(pieces), reason

    async def all_clients() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    results = asyncio.run(all_clients())
    assert results == [(text, reason) for text, _, reason, _ in expected]
    assert served.engine.status()["requests"] == []


def test_a_repeated_prompt_reports_cached_tokens(served, client):
    prompt = list(range(300, 340))  # 40 tokens: two full KV blocks can be reused
    first = client.completions.create(model=served.engine.model_id, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=served.engine.model_id, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.choices[0].text == first.choices[0].text


def test_cache_salt_keeps_prefixes_apart(served, client):
    prompt = list(range(400, 440))
    client.completions.create(model=served.engine.model_id, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    other = client.completions.create(model=served.engine.model_id, prompt=prompt, max_tokens=1,
                                      extra_body={"cache_salt": "b"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_a_model_is_retrieved_by_id_or_alias_and_others_are_not_found(served, client):
    model = client.models.retrieve(served.engine.model_id)
    assert (model.id, model.object) == (served.engine.model_id, "model")
    assert client.models.retrieve("default").id == served.engine.model_id
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"


def test_a_prefilled_answer_is_continued_as_mlx_lm_continues_it(served, client):
    """vLLM's `continue_final_message`: the last (assistant) message is left open and the answer continues it."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    ids = render_chat(served.engine.tokenizer, normalize_messages(messages), None, continue_final=True)
    assert served.engine.tokenizer.decode(ids).endswith("The colour is")
    text, n_tokens, _ = greedy_text(served.model_path, served.engine.tokenizer, ids, MAX_TOKENS)
    reply = client.chat.completions.create(model=served.engine.model_id, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"continue_final_message": True})  # fmt: skip
    assert reply.choices[0].message.content == text
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), n_tokens)
    with pytest.raises(openai.BadRequestError, match="last message to be the assistant's"):
        client.chat.completions.create(model=served.engine.model_id, messages=messages[:1], max_tokens=2,
                                       extra_body={"continue_final_message": True})  # fmt: skip


def test_min_tokens_and_include_stop_str_in_output_reach_the_engine(served, client):
    prompt = list(range(30, 50))
    whole = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    stop = whole[3:5]
    kept = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]  # fmt: skip
    assert kept.text == whole[: whole.index(stop) + len(stop)] and kept.finish_reason == "stop"
    held = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                     extra_body={"min_tokens": 24})  # fmt: skip
    assert held.usage.completion_tokens == 24
    with pytest.raises(openai.BadRequestError, match="min_tokens") as caught:
        client.completions.create(model="default", prompt=prompt, max_tokens=4, extra_body={"min_tokens": 5})
    assert caught.value.body["param"] == "min_tokens"


def test_bad_words_keep_a_word_out_of_the_answer(served, client):
    """vLLM's bad_words: the word's tokens, as a text starts and after a space, are never generated in a row."""
    tokenizer = served.engine.tokenizer
    prompt = list(range(60, 80))
    reply = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0)
    tokens = tokenizer.encode(reply.choices[0].text, add_special_tokens=False)
    word = tokenizer.decode(tokens[4:6]).strip()  # two tokens' text from the middle of the plain answer
    banned = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0,
                                       extra_body={"bad_words": [word]}).choices[0].text  # fmt: skip
    sequences = [tokenizer.encode(t, add_special_tokens=False) for t in (word, " " + word)]
    answer = tokenizer.encode(banned, add_special_tokens=False)
    assert banned != reply.choices[0].text
    assert not any(answer[i : i + len(s)] == s for s in sequences for i in range(len(answer)))
    for bad in ("word", [""], ["  "], [3]):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="default", prompt=prompt, max_tokens=2, extra_body={"bad_words": bad})
        assert caught.value.body["param"] == "bad_words"


def test_truncate_prompt_tokens_keeps_the_prompts_tail(served, client):
    prompt = list(range(100, 140))
    tail = client.completions.create(model="default", prompt=prompt[-12:], max_tokens=8, temperature=0)
    cut = client.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 12})  # fmt: skip
    assert cut.usage.prompt_tokens == 12
    assert cut.choices[0].text == served.engine.tokenizer.decode(prompt[-12:]) + tail.choices[0].text
    whole = client.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"truncate_prompt_tokens": -1})  # fmt: skip
    assert whole.usage.prompt_tokens == 40
    for keep in (0, -2, 10**9):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="default", prompt=prompt, max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": keep})  # fmt: skip
        assert caught.value.body["param"] == "truncate_prompt_tokens"
