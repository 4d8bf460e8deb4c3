"""Random mixes of requests and cancellations on a small KV pool (waiting, preemption, chunked prefill beside
decoding streams): nothing is lost and nothing hangs. Every handle ends with exactly one final event; what ran to
its end is mlx-lm's (greedy tokens, prompt log-probabilities); the pool is empty afterwards."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest, SamplingParams
from tests.engine.reference import prompt_of, reference_prompt_logprobs, reference_tokens

KINDS = ("greedy", "prompt_logprobs", "logprobs", "sampled")
# examples a variant runs; a longer hunt: MLX_SERVE_CHAOS_EXAMPLES=150 pytest tests/engine/test_engine_chaos.py
EXAMPLES = int(os.environ.get("MLX_SERVE_CHAOS_EXAMPLES", "25"))


@dataclass(frozen=True)
class Op:
    length: int  # prompt tokens
    max_tokens: int
    kind: str
    cancel_after: int | None  # cancel once this many tokens have come (0: right after submitting); None: never
    seed: int


OPS = st.lists(
    st.builds(Op, st.integers(1, 120), st.integers(1, 60), st.sampled_from(KINDS),
              st.one_of(st.none(), st.none(), st.integers(0, 6)), st.integers(0, 10_000)),
    min_size=1, max_size=7,
)  # fmt: skip


@pytest.fixture(scope="module",
                params=["qwen3", "gemma3-window-space", "qwen3-8-bit-kv", "qwen3_next-recurrent", "deepseek_v3-latent",
                        "gemma4_text-window-space", "llama4-window-space"])
def served(request, tiny_qwen3, tmp_path_factory):
    """The engine, its checkpoint and its KV's bits: 14 blocks of 16 = 224 tokens of KV for up to 7 requests of up to
    180, so requests wait and some are preempted; Gemma 3's sliding-window layers (16 tokens) in a window space of 4
    blocks besides (also Gemma 4's, whose last layers read an earlier layer's K/V, and Llama 4's chunked layers); or
    the KV quantized to 8 bits (the references then use mlx-lm's quantized caches); or Qwen3-Next's recurrent layers,
    each request's state in one of 4 slots; or DeepSeek-V3's latent attention."""
    path, bits = tiny_qwen3, None
    settings = dict(block_size=16, kv_blocks=14, row_ceiling=48, row_floor=8, max_running=4)
    if request.param.endswith("-window-space"):
        from mlx_serve.checkpoints import make_checkpoint

        arch = request.param.split("-")[0]
        path = make_checkpoint(tmp_path_factory.mktemp("chaos") / arch, arch=arch, seed=4)
        settings["window_kv_tokens"] = 64
    if request.param in ("qwen3_next-recurrent", "deepseek_v3-latent"):
        from mlx_serve.checkpoints import make_checkpoint

        arch = request.param.split("-")[0]
        path = make_checkpoint(tmp_path_factory.mktemp("chaos") / arch, arch=arch, seed=4)
    if request.param == "qwen3-8-bit-kv":
        bits = 8
        settings |= dict(kv_bits=8, kv_group_size=32)
    engine = Engine.load(EngineConfig(model=str(path), **settings))
    yield engine, path, bits
    engine.shutdown()


def _request(op: Op) -> GenerationRequest:
    sampling = {
        "greedy": SamplingParams(),
        "prompt_logprobs": SamplingParams(prompt_logprobs=2),
        "logprobs": SamplingParams(logprobs=1),
        "sampled": SamplingParams(temperature=0.8, top_p=0.9, seed=op.seed),
    }[op.kind]
    return GenerationRequest(prompt_ids=tuple(prompt_of(op.length, seed=op.seed)), max_tokens=op.max_tokens,
                             sampling=sampling, ignore_eos=op.kind == "sampled")  # fmt: skip


def _read(handle, op: Op, events: list) -> None:
    for event in handle:
        events.append(event)
        if op.cancel_after is not None and sum(e.token_id is not None for e in events) == op.cancel_after:
            handle.cancel()


def _run(engine, requests: list[GenerationRequest], ops: list[Op]) -> list[list]:
    """Submit the requests together, cancel as each op says, read every stream on its own thread; each stream's
    events, checked to end with exactly one final event and none to hang."""
    handles = engine.submit_all(requests)
    events: list[list] = [[] for _ in ops]
    readers = [threading.Thread(target=_read, args=(h, op, e)) for h, op, e in zip(handles, ops, events)]
    for op, handle, reader in zip(ops, handles, readers):
        if op.cancel_after == 0:
            handle.cancel()
        reader.start()
    for reader in readers:
        reader.join(120)
        assert not reader.is_alive(), "a stream hung"
    for stream in events:
        finals = [e for e in stream if e.finish_reason is not None]
        assert len(finals) == 1 and finals[0] is stream[-1]
    return events


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_requests_and_cancellations_lose_nothing(served, ops):
    engine, path, bits = served
    quantized = dict(kv_bits=bits, kv_group_size=32)
    events = _run(engine, [_request(op) for op in ops], ops)
    for op, stream in zip(ops, events):
        final = stream[-1]
        tokens = [e.token_id for e in stream if e.token_id is not None]
        assert final.usage.prompt_tokens == op.length and final.usage.completion_tokens == len(tokens)
        prompt = prompt_of(op.length, seed=op.seed)
        if final.finish_reason == "cancelled":  # what came before the cancel is still right (a prefix)
            assert op.cancel_after is not None and len(tokens) < op.max_tokens
            if op.kind != "sampled":
                assert tokens == reference_tokens(path, prompt, op.max_tokens, **quantized)[: len(tokens)]
            continue
        assert final.finish_reason in ("stop", "length")
        if op.kind == "sampled":
            assert len(tokens) == op.max_tokens
            continue
        assert tokens == reference_tokens(path, prompt, op.max_tokens, **quantized)
        if op.kind == "logprobs":
            assert all(e.logprob is not None and e.logprob <= 0 for e in stream if e.token_id is not None)
        if op.kind == "prompt_logprobs":
            entries = stream[0].prompt_logprobs
            assert [e.token_id for e in entries] == prompt
            reference = reference_prompt_logprobs(path, prompt, **quantized)
            want = reference[np.arange(op.length - 1), prompt[1:]]
            np.testing.assert_allclose([e.logprob for e in entries[1:]], want, atol=2e-5)
    deadline = time.monotonic() + 10
    while engine.stats()["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats.get("window_blocks_used", 0) == 0
    states = engine.status()["recurrent_state"]
    assert states is None or states["slots_in_use"] == 0


DRAFTED_KINDS = ("greedy", "adapter", "bad_words", "sampled")


@pytest.fixture(scope="module")
def drafting_engine(tiny_qwen3, tmp_path_factory):
    """Every draftable request drafts from a draft model (the served model's twin: its drafts are kept, so lanes
    carry several rows), one LoRA adapter is served, and the pool is small enough to preempt."""
    from mlx_serve.adapter_specs import AdapterSpec
    from mlx_serve.checkpoints.adapters import make_adapter

    adapter = make_adapter(tiny_qwen3, tmp_path_factory.mktemp("chaos") / "a", rank=4, seed=3)
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=14, row_ceiling=48, row_floor=8,
                                      max_running=4, draft_model=str(tiny_qwen3),
                                      adapters=(AdapterSpec("a", str(adapter)),)))  # fmt: skip
    yield engine, adapter
    engine.shutdown()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.builds(Op, st.integers(1, 120), st.integers(1, 60), st.sampled_from(DRAFTED_KINDS),
                              st.one_of(st.none(), st.none(), st.integers(0, 6)), st.integers(0, 10_000)),
                    min_size=1, max_size=6))  # fmt: skip
def test_drafted_adapted_and_cancelled_requests_lose_nothing(drafting_engine, tiny_qwen3, ops):
    from tests.engine.reference import reference_adapter_tokens

    engine, adapter = drafting_engine

    def request(op: Op) -> GenerationRequest:
        sampling = {"greedy": SamplingParams(), "adapter": SamplingParams(),
                    "bad_words": SamplingParams(bad_words=((7, 8), (9,))),
                    "sampled": SamplingParams(temperature=0.8, seed=op.seed)}[op.kind]  # fmt: skip
        return GenerationRequest(prompt_ids=tuple(prompt_of(op.length, seed=op.seed)), max_tokens=op.max_tokens,
                                 sampling=sampling, adapter="a" if op.kind == "adapter" else None,
                                 ignore_eos=op.kind == "sampled")  # fmt: skip

    events = _run(engine, [request(op) for op in ops], ops)
    for op, stream in zip(ops, events):
        tokens = [e.token_id for e in stream if e.token_id is not None]
        assert stream[-1].usage.completion_tokens == len(tokens) <= op.max_tokens
        if op.kind in ("sampled", "bad_words"):
            if op.kind == "bad_words":
                assert 9 not in tokens and not any(tokens[i : i + 2] == [7, 8] for i in range(len(tokens)))
            continue
        prompt = prompt_of(op.length, seed=op.seed)
        want = (reference_adapter_tokens(tiny_qwen3, adapter, prompt, op.max_tokens) if op.kind == "adapter"
                else reference_tokens(tiny_qwen3, prompt, op.max_tokens))  # fmt: skip
        if stream[-1].finish_reason == "cancelled":
            assert tokens == want[: len(tokens)]
        else:
            assert tokens == want
    deadline = time.monotonic() + 10
    while engine.stats()["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["kv_blocks_used"] == 0 and engine.drafter.held_tokens == 0
