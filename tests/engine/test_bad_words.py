"""vLLM's `bad_words`: a word (a token sequence) is never generated. Its last token is masked wherever the tokens
generated just before it are the rest of it, so the answer is mlx-lm's with that mask as a logits processor."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.types import GenerationRequest, SamplingParams
from tests.engine.reference import load_reference, prompt_of, reference_tokens

MAX_TOKENS = 40


def banning_reference(path, prompt: list[int], words: list[tuple[int, ...]]) -> list[int]:
    """mlx-lm's greedy tokens with each word's last token masked after the rest of it was generated."""
    from mlx_lm.generate import generate_step

    def ban(tokens, logits):
        generated = tokens.tolist()[len(prompt) :]
        for word in words:
            if len(word) == 1 or tuple(generated[-(len(word) - 1) :]) == word[:-1] and len(generated) >= len(word) - 1:
                logits = logits.at[..., word[-1]].add(-mx.inf)
        return logits

    model, tokenizer = load_reference(str(path))
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, logits_processors=[ban]):
        out.append(int(token))
        if token in tokenizer.eos_token_ids:
            break
    return out


def contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("compile_decode", ["off", "on"])
def test_bad_words_are_never_generated_and_the_rest_is_mlx_lms(tiny_qwen3, compile_decode):
    prompt = prompt_of(30, seed=71)
    natural = reference_tokens(tiny_qwen3, prompt, MAX_TOKENS)
    assert len(natural) >= 30
    cases = [
        [(natural[3],)],  # one token: masked always
        [(natural[7], natural[8]), (natural[12], natural[13], natural[14])],
        [tuple(natural[:25])],  # longer than the penalties' 20-token window
        [(prompt[-1], natural[0])],  # a prompt's tail never counts: the answer is the natural one
    ]
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=256, compile_decode=compile_decode))
    try:
        done = engine.generate([
            GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS, sampling=SamplingParams(bad_words=tuple(w)))
            for w in cases
        ])  # fmt: skip
    finally:
        engine.shutdown()
    for words, completion in zip(cases, done):
        tokens = list(completion.token_ids)
        assert tokens == banning_reference(tiny_qwen3, prompt, words), words
        assert not any(contains(tokens, word) for word in words if word[0] != prompt[-1])
    assert [list(c.token_ids) != natural for c in done] == [True, True, True, False]


def test_bad_words_are_checked_against_the_vocabulary():
    with pytest.raises(InvalidRequest, match="bad_words"):
        SamplingParams(bad_words=((5, 10**9),)).validate(1000)
    with pytest.raises(InvalidRequest, match="bad_words"):
        SamplingParams(bad_words=((),)).validate(1000)
