"""mlx-lm's own generation, the reference every engine output is compared with."""

from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx
import numpy as np


@functools.lru_cache(maxsize=8)
def load_reference(path: str):
    import mlx_lm

    return mlx_lm.load(path)


def reference_cache(model, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
    """mlx-lm's caches for the model; `kv_bits`: its QuantizedKVCache from the first token in place of each
    full-attention layer's KVCache (its rotating caches stay: mlx-lm quantizes none)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    if kv_bits is None:
        return cache
    return [QuantizedKVCache(kv_group_size, kv_bits) if type(c) is KVCache else c for c in cache]


def reference_tokens(path: Path, prompt_ids: list[int], max_tokens: int, kv_bits: int | None = None,
                     kv_group_size: int = 64) -> list[int]:
    """Greedy tokens from mlx-lm's generate_step, cut after the first eos (the engine stops there too), with its
    caches as `reference_cache` makes them."""
    from mlx_lm.generate import generate_step

    model, tokenizer = load_reference(str(path))
    eos = set(tokenizer.eos_token_ids)
    out: list[int] = []
    cache = reference_cache(model, kv_bits, kv_group_size)
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, prompt_cache=cache):
        out.append(int(token))
        if token in eos:
            break
    return out


@functools.lru_cache(maxsize=8)
def load_adapted_reference(path: str, adapter_path: str):
    import mlx_lm

    return mlx_lm.load(path, adapter_path=adapter_path)


def reference_adapter_tokens(path: Path, adapter_path: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from mlx-lm's generate_step with an adapter loaded as mlx-lm loads it, cut after the first eos."""
    from mlx_lm.generate import generate_step

    model, tokenizer = load_adapted_reference(str(path), str(adapter_path))
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        out.append(int(token))
        if token in tokenizer.eos_token_ids:
            break
    return out


def reference_prompt_logprobs(path: Path, prompt_ids: list[int], kv_bits: int | None = None,
                              kv_group_size: int = 64) -> np.ndarray:
    """mlx-lm's log-softmax of every prompt row `[n, V]` (float32), one forward over the whole prompt: row p scores
    the prompt token at p + 1. `kv_bits`: through its quantized caches (`reference_cache`). Gemma 3n's forward
    without caches has its KV-shared layers compute K/V of their own, which its generation never does: it reads
    through fresh caches, as generation would."""
    model, _ = load_reference(str(path))
    cached = kv_bits is not None or getattr(model, "model_type", None) == "gemma3n"
    cache = reference_cache(model, kv_bits, kv_group_size) if cached else None
    logits = model(mx.array(prompt_ids)[None], cache=cache)[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def generate_in_cuda_layout(engine, prompts: list[list[int]], max_tokens: int, gather=None) -> list[list[int]]:
    """Greedy tokens of `prompts` with prefill lanes laid out as on CUDA: history padded to 32-token buckets behind
    a mask, read through `gather` (a `PrefillGather`; None: slots). Shuts the engine down."""
    from mlx_serve.types import GenerationRequest

    engine.runner.kv_bucket = 32
    engine.runner.prefill_gather = gather
    try:
        completions = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=max_tokens) for p in prompts])
    finally:
        engine.shutdown()
    return [list(completion.token_ids) for completion in completions]


def run_staggered_counted(engine, prompts: list[list[int]], first: int, max_tokens: int) -> tuple[dict, dict]:
    """`run_staggered`, then the engine's counters (`status()`); shuts the engine down."""
    try:
        tokens = run_staggered(engine, prompts, first, max_tokens)
        return tokens, engine.status()["counters"]
    finally:
        engine.shutdown()


def run_next_turn(engine, first: list[int], extra: list[int]) -> tuple[list[int], list[int], int]:
    """A chat's next turn: `first` answered (6 tokens), then it, its answer and `extra` as one prompt (8 tokens).
    Returns that prompt, its tokens and the prefix-cache hit tokens so far. Shuts the engine down."""
    from mlx_serve.types import GenerationRequest

    try:
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(first), max_tokens=6)])
        follow = first + list(done.token_ids) + extra
        [again] = engine.generate([GenerationRequest(prompt_ids=tuple(follow), max_tokens=8)])
        hits = engine.status()["counters"]["prefix_hit_tokens"]
    finally:
        engine.shutdown()
    return follow, list(again.token_ids), hits


def prompt_of(length: int, seed: int, vocab: int = 200, offset: int = 10) -> list[int]:
    """A deterministic prompt of ordinary (non-special) token ids."""
    return [offset + (seed * 7919 + i * 104729) % vocab for i in range(length)]


class StreamReaders:
    """Read several handles' tokens on background threads; `started` is set at the first token of any."""

    def __init__(self, handles: list) -> None:
        import threading

        self.tokens: dict[int, list[int]] = {}
        self.started = threading.Event()
        self._threads = [threading.Thread(target=self.read, args=(i, h)) for i, h in enumerate(handles)]
        for thread in self._threads:
            thread.start()

    def read(self, key: int, handle) -> None:
        tokens = []
        try:
            for event in handle:
                if event.token_id is not None:
                    tokens.append(event.token_id)
                    self.started.set()
        finally:  # a stream that ended without a token (a failed step) must not leave the caller waiting
            self.tokens[key] = tokens
            self.started.set()

    def join(self) -> dict[int, list[int]]:
        for thread in self._threads:
            thread.join(180)
        return self.tokens


def run_staggered(engine, prompts: list[list[int]], first: int, max_tokens: int) -> dict[int, list[int]]:
    """Submit `prompts[:first]`, and the rest once the first token of any of them has come (while they run);
    returns every request's tokens by its index in `prompts`."""
    from mlx_serve.types import GenerationRequest

    def submit(prompt: list[int]):
        return engine.submit(GenerationRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens))

    readers = StreamReaders([submit(p) for p in prompts[:first]])
    assert readers.started.wait(180)  # a cold device run JIT-compiles its kernels first (gemma3n: over 60 s once)
    for i, prompt in enumerate(prompts[first:], start=first):
        readers.read(i, submit(prompt))
    return readers.join()
