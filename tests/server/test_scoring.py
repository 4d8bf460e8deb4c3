"""/v1/completions for scoring and batches, through the official `openai` client against a real server: `echo` with
`logprobs` (the prompt's tokens scored, as lm-eval's loglikelihood asks for them), `max_tokens` 0 with `echo`, and a
list of prompts in one call. Every figure is compared with mlx-lm's model on the same token ids."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

from tests.engine.reference import prompt_of, reference_prompt_logprobs
from tests.server.reference import greedy_text


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)


def _assert_scored(served, prompt: list[int], logprobs, top: int) -> None:
    """The first len(prompt) entries are the prompt's tokens scored as mlx-lm scores them."""
    tokenizer = served.engine.tokenizer
    reference = reference_prompt_logprobs(served.model_path, prompt)
    n = len(prompt)
    assert logprobs.tokens[:n] == [tokenizer.decode([t]) for t in prompt]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    want = reference[np.arange(n - 1), prompt[1:]]
    np.testing.assert_allclose(logprobs.token_logprobs[1:n], want, atol=2e-5)
    for row, alternatives in enumerate(logprobs.top_logprobs[1:n]):
        assert len(alternatives) == top
        if top:
            assert max(alternatives.values()) == pytest.approx(float(reference[row].max()), abs=2e-5)


def test_echo_with_max_tokens_0_scores_a_batch_of_prompts(served, client):
    prompts = [prompt_of(40, seed=400), prompt_of(23, seed=401)]
    reply = client.completions.create(model=served.engine.model_id, prompt=prompts, max_tokens=0, echo=True,
                                      logprobs=2, temperature=0)  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, prompt in zip(reply.choices, prompts):
        assert choice.text == served.engine.tokenizer.decode(prompt)
        assert len(choice.logprobs.tokens) == len(prompt)  # the prompt alone
        _assert_scored(served, prompt, choice.logprobs, 2)
        assert choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (63, 0)


def test_a_loglikelihood_request_as_lm_eval_sends_it(served, client):
    """Context and continuation as one token prompt, max_tokens 1, echo, logprobs 1: the continuation's summed
    log-probability and whether it is greedy are mlx-lm's."""
    context, continuation = prompt_of(30, seed=410), prompt_of(6, seed=411)
    prompt = context + continuation
    reply = client.completions.create(model=served.engine.model_id, prompt=[prompt], max_tokens=1, echo=True,
                                      logprobs=1, temperature=0, seed=1234)  # fmt: skip
    logprobs = reply.choices[0].logprobs
    reference = reference_prompt_logprobs(served.model_path, prompt)
    positions = np.arange(len(context), len(prompt))
    want = float(reference[positions - 1, np.array(continuation)].sum())
    assert sum(logprobs.token_logprobs[len(context) : len(prompt)]) == pytest.approx(want, abs=1e-4)
    greedy = all(reference[p - 1].argmax() == prompt[p] for p in positions)
    tops = logprobs.top_logprobs[len(context) : len(prompt)]
    assert greedy == all(max(top, key=top.get) == token for top, token in zip(tops, logprobs.tokens[len(context) :]))
    assert len(logprobs.tokens) == len(prompt) + 1  # and the one generated token


def test_echo_puts_the_prompt_before_mlx_lms_answer_streaming_and_not(served, client):
    tokenizer = served.engine.tokenizer
    prompt = prompt_of(25, seed=420)
    text, n_tokens, _ = greedy_text(served.model_path, tokenizer, prompt, 6)
    reply = client.completions.create(model=served.engine.model_id, prompt=prompt, max_tokens=6, echo=True,
                                      logprobs=0, temperature=0)  # fmt: skip
    choice = reply.choices[0]
    assert choice.text == tokenizer.decode(prompt) + text
    assert len(choice.logprobs.tokens) == len(prompt) + n_tokens
    _assert_scored(served, prompt, choice.logprobs, 0)
    chunks = list(client.completions.create(model=served.engine.model_id, prompt=prompt, max_tokens=6, echo=True,
                                            logprobs=0, temperature=0, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == choice.logprobs.text_offset


def test_streamed_choices_of_a_prompt_echo_the_scores_its_first_choice_computes_once(served, client, monkeypatch):
    """n choices of two prompts, streamed: each choice echoes its prompt's scores (mlx-lm's), and the engine is asked
    to score each prompt once, by its first choice; the later choices' chunks wait for those scores."""
    engine = served.engine
    submitted = []
    real_submit = engine.submit_all

    class FirstLate:  # each prompt's first choice is read late, so its siblings' tokens come before its scores
        def __init__(self, handle):
            self.handle = handle

        async def __aiter__(self):
            await asyncio.sleep(0.3)
            async for event in self.handle:
                yield event

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def submit_all(requests):
        submitted.extend(requests)
        return [FirstLate(h) if i % 3 == 0 else h for i, h in enumerate(real_submit(requests))]

    monkeypatch.setattr(engine, "submit_all", submit_all)
    prompts = [prompt_of(21, seed=425), prompt_of(14, seed=426)]
    chunks = list(client.completions.create(model=engine.model_id, prompt=prompts, max_tokens=4, n=3, echo=True,
                                            logprobs=1, temperature=0, stream=True))  # fmt: skip
    assert [r.sampling.prompt_logprobs is not None for r in submitted] == [True, False, False] * 2
    for index in range(6):
        parts = [c.choices[0] for c in chunks if c.choices[0].index == index]
        tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
        token_logprobs = [lp for p in parts if p.logprobs for lp in p.logprobs.token_logprobs]
        top_logprobs = [top for p in parts if p.logprobs for top in p.logprobs.top_logprobs]
        scored = type("Scored", (), dict(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs))
        _assert_scored(served, prompts[index // 3], scored, 1)


def test_echo_without_logprobs_scores_nothing_and_text_prompts_echo_as_given(served, client):
    reply = client.completions.create(model=served.engine.model_id, prompt="Once upon a time", max_tokens=3,
                                      echo=True, temperature=0)  # fmt: skip
    assert reply.choices[0].text.startswith("Once upon a time") and reply.choices[0].logprobs is None


def test_a_batch_with_n_orders_choices_by_prompt_and_counts_each_prompt_once(served, client):
    tokenizer = served.engine.tokenizer
    prompts = [prompt_of(12, seed=430), prompt_of(17, seed=431), prompt_of(9, seed=432)]
    reply = client.completions.create(model=served.engine.model_id, prompt=prompts, max_tokens=5, n=2,
                                      temperature=0)  # fmt: skip
    assert [c.index for c in reply.choices] == list(range(6))
    expected = [greedy_text(served.model_path, tokenizer, p, 5) for p in prompts]
    assert [c.text for c in reply.choices] == [e[0] for e in expected for _ in range(2)]
    assert reply.usage.prompt_tokens == 12 + 17 + 9
    assert reply.usage.completion_tokens == 2 * sum(e[1] for e in expected)


@pytest.mark.parametrize(("prompt", "message"), [
    ([], "a string, a list of token ids, or a list of either"),
    ([[]], "a non-empty list of integer token ids"),
    ([[1, 2], [3, 10**9]], "outside the vocabulary"),
    (["x"] * 65, "at most 64 prompts"),
])  # fmt: skip
def test_bad_prompts_are_refused_with_the_reason(served, client, prompt, message):
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        client.completions.create(model=served.engine.model_id, prompt=prompt, max_tokens=1)
    assert caught.value.body["param"] == "prompt"


def test_a_prompts_choices_share_one_scoring(served, client):
    """n > 1 with echo and logprobs, or prompt_logprobs: each prompt is scored once (its first choice computes it, the
    others wait for its blocks, as for any prompt of at least `shared_prefill_tokens`, and show the same scores)."""
    prompts = [prompt_of(300, seed=430), prompt_of(280, seed=431)]
    before = served.engine.stats()["prompt_tokens_total"]
    reply = client.completions.create(model=served.engine.model_id, prompt=prompts, max_tokens=2, echo=True, n=3,
                                      logprobs=1, temperature=0, extra_body={"prompt_logprobs": 1})  # fmt: skip
    computed = served.engine.stats()["prompt_tokens_total"] - before
    choices = reply.model_dump()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for index, choice in enumerate(reply.choices):
        prompt = prompts[index // 3]
        _assert_scored(served, prompt, choice.logprobs, 1)
        _assert_vllm_prompt_logprobs(served, prompt, choices[index]["prompt_logprobs"], 1)
    # each prompt computed whole once; its other choices take all but its last (partial) block from the cache
    assert computed <= sum(len(p) for p in prompts) + 2 * 2 * 16
    assert reply.usage.prompt_tokens == 580


def test_max_tokens_0_without_echo_is_refused(served, client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=served.engine.model_id, prompt="hi", max_tokens=0)


def _assert_vllm_prompt_logprobs(served, prompt: list[int], entries, top: int) -> None:
    """vLLM's `prompt_logprobs`: None for the first token, then the token and the top alternatives by id, each with
    mlx-lm's log-probability, its rank in the vocabulary and its text."""
    reference = reference_prompt_logprobs(served.model_path, prompt)
    tokenizer = served.engine.tokenizer
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:], 1):
        row = reference[position - 1]
        token = prompt[position]
        order = np.argsort(-row, kind="stable")
        expected_ids = {token, *order[:top].tolist()}
        assert {int(k) for k in entry} == expected_ids
        for key, value in entry.items():
            token_id = int(key)
            assert value["logprob"] == pytest.approx(float(row[token_id]), abs=2e-5)
            assert value["rank"] == 1 + int((row > row[token_id] + 1e-6).sum()), (position, token_id)
            assert value["decoded_token"] == tokenizer.decode([token_id])


def test_vllm_prompt_logprobs_on_completions_and_chat(served, client):
    prompt = prompt_of(33, seed=420)
    reply = client.completions.create(model=served.engine.model_id, prompt=[prompt], max_tokens=3, temperature=0,
                                      extra_body={"prompt_logprobs": 2})  # fmt: skip
    choice = reply.model_dump()["choices"][0]
    _assert_vllm_prompt_logprobs(served, prompt, choice["prompt_logprobs"], 2)
    assert choice["logprobs"] is None  # the answer's were not asked for
    # with echo and logprobs 1 beside it: one scoring, each answer shaped as asked
    both = client.completions.create(model=served.engine.model_id, prompt=[prompt], max_tokens=0, echo=True,
                                     logprobs=1, temperature=0, extra_body={"prompt_logprobs": 3})  # fmt: skip
    _assert_scored(served, prompt, both.choices[0].logprobs, 1)
    _assert_vllm_prompt_logprobs(served, prompt, both.model_dump()["choices"][0]["prompt_logprobs"], 3)

    messages = [{"role": "user", "content": "score me"}]
    chat = client.chat.completions.create(model=served.engine.model_id, messages=messages, max_tokens=2, n=2,
                                          temperature=0, extra_body={"prompt_logprobs": 0})  # fmt: skip
    chat_prompt = served.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    _assert_vllm_prompt_logprobs(served, list(chat_prompt), chat.model_dump()["prompt_logprobs"], 0)


def test_prompt_logprobs_are_refused_with_a_stream_or_out_of_range(served, client):
    for body, message in [({"prompt_logprobs": 1, "stream": True}, "not available when stream is true"),
                          ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": "2"}, "prompt_logprobs")]:
        extra = {k: v for k, v in body.items() if k != "stream"}
        with pytest.raises(openai.BadRequestError, match=message) as caught:
            client.completions.create(model=served.engine.model_id, prompt=[1, 2, 3], max_tokens=1,
                                      stream=body.get("stream", False), extra_body=extra)  # fmt: skip
        assert caught.value.body["param"] == "prompt_logprobs"
