"""vLLM's `min_tokens` and `include_stop_str_in_output`: no stop token or stop string ends an answer before its
`min_tokens`-th token (the stop tokens are masked from the logits until then, so the answer is the model's with
them forbidden), and a stop string can be kept in the text."""

from __future__ import annotations

import mlx.core as mx

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest, SamplingParams
from tests.engine.reference import load_reference, prompt_of, reference_tokens


def forbidding_reference(path, prompt: list[int], forbidden: set[int], min_tokens: int, max_tokens: int) -> list[int]:
    """mlx-lm's greedy tokens with `forbidden` masked for the first `min_tokens`, cut after the first one after."""
    from mlx_lm.generate import generate_step

    count = 0

    def hold(tokens, logits):
        nonlocal count
        count += 1
        return logits.at[..., mx.array(sorted(forbidden))].add(-mx.inf) if count <= min_tokens else logits

    model, _ = load_reference(str(path))
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, logits_processors=[hold]):
        out.append(int(token))
        if token in forbidden:
            break
    return out


def test_min_tokens_holds_back_stop_tokens_until_reached(tiny_qwen3):
    prompt = prompt_of(30, seed=61)
    natural = reference_tokens(tiny_qwen3, prompt, 60)
    stop = natural[5]  # the plain answer would stop at its 6th token
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=128))
    try:
        [plain, held] = engine.generate([
            GenerationRequest(prompt_ids=tuple(prompt), max_tokens=60, stop_token_ids=(stop,)),
            GenerationRequest(prompt_ids=tuple(prompt), max_tokens=60, stop_token_ids=(stop,),
                              sampling=SamplingParams(min_tokens=20)),
        ])  # fmt: skip
    finally:
        engine.shutdown()
    assert list(plain.token_ids) == natural[: natural.index(stop) + 1]
    eos = set(load_reference(str(tiny_qwen3))[1].eos_token_ids)
    want = forbidding_reference(tiny_qwen3, prompt, {stop, *eos}, 20, 60)
    assert list(held.token_ids) == want and len(held.token_ids) > 20
    assert stop not in held.token_ids[:20]


def test_stop_strings_wait_for_min_tokens_and_may_stay_in_the_text(tiny_qwen3):
    prompt = prompt_of(30, seed=42)
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=128))
    try:
        [whole] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=60)])
        stop = whole.text[4:6]  # early in the answer
        cut, kept, late = engine.generate([
            GenerationRequest(prompt_ids=tuple(prompt), max_tokens=60, stop=(stop,)),
            GenerationRequest(prompt_ids=tuple(prompt), max_tokens=60, stop=(stop,), include_stop_str_in_output=True),
            GenerationRequest(prompt_ids=tuple(prompt), max_tokens=60, stop=(stop,),
                              sampling=SamplingParams(min_tokens=30)),
        ])  # fmt: skip
    finally:
        engine.shutdown()
    first = whole.text.index(stop)
    assert cut.text == whole.text[:first] and kept.text == whole.text[: first + len(stop)]
    assert len(late.token_ids) >= 30 and late.text.startswith(whole.text[: first + len(stop)])
