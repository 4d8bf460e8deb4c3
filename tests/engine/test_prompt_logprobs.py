"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`): each prompt token's log-probability given the ones
before it, equal to mlx-lm's model run over the whole prompt at once, however the engine cuts and places the rows."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.kernels.paged_gather import table_gather
from mlx_serve.outputs import RequestStream
from mlx_serve.types import GenerationRequest, PromptLogprob, SamplingParams
from tests.engine.reference import StreamReaders, prompt_of, reference_prompt_logprobs, reference_tokens
from tracing.events import Span, StepExecuted, StepPlanned
from tracing.sink import MemorySink


def _check(path, prompt: list[int], entries, top: int) -> None:
    """The entries are mlx-lm's: the first has none, entry p scores prompt[p] under row p - 1, and its top `top`
    are the row's most likely tokens, most likely first."""
    reference = reference_prompt_logprobs(path, prompt)
    assert [e.token_id for e in entries] == prompt
    assert entries[0].logprob is None and entries[0].top_logprobs is None
    got = np.array([e.logprob for e in entries[1:]])
    want = reference[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(got, want, atol=2e-5)
    for row, entry in enumerate(entries[1:]):
        if not top:
            assert entry.top_logprobs is None
            continue
        ids = [t.token_id for t in entry.top_logprobs]
        assert ids == list(np.argsort(-reference[row], kind="stable")[:top])
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], reference[row][ids], atol=2e-5)


def _score(engine: Engine, prompt: list[int], top: int = 0, **kwargs):
    sampling = SamplingParams(prompt_logprobs=top)
    [completion] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=4, sampling=sampling,
                                                      **kwargs)])  # fmt: skip
    return completion


def test_prompt_logprobs_in_small_chunks_beside_decoding_streams_are_mlx_lms(tiny_qwen3):
    """A 150-token prompt read in chunks of at most 16 rows while two streams decode: every entry is mlx-lm's, the
    generated tokens too, and the streams keep theirs. Steps that score rows (an LM head over each) do not teach
    the cost model: they are traced as auxiliary."""
    sink = MemorySink()
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=256, row_ceiling=16,
                                      row_floor=1, trace=sink))  # fmt: skip
    try:
        streams = [prompt_of(20, seed=300 + i) for i in range(2)]
        handles = engine.submit_all([GenerationRequest(prompt_ids=tuple(p), max_tokens=40) for p in streams])
        readers = StreamReaders(handles)
        readers.started.wait(30)
        prompt = prompt_of(150, seed=310)
        completion = _score(engine, prompt, top=3)
        tokens = readers.join()
    finally:
        engine.shutdown()
    _check(tiny_qwen3, prompt, completion.prompt_logprobs, 3)
    assert list(completion.token_ids) == reference_tokens(tiny_qwen3, prompt, 4)
    scoring = {e.step_id for e in sink.events if isinstance(e, StepPlanned)
               for lane in e.lanes if lane.request_id == completion.request_id and lane.kind == "prefill"}  # fmt: skip
    executed = {e.step_id: e.auxiliary for e in sink.events if isinstance(e, StepExecuted)}
    assert len(scoring) >= 10 and all(executed[step] for step in scoring)
    for i, prompt_ids in enumerate(streams):
        assert tokens[i] == reference_tokens(tiny_qwen3, prompt_ids, 40)


def test_a_cached_prompt_is_scored_whole_and_the_cache_still_serves_others(tiny_qwen3):
    """The prompt is in the prefix cache: the scoring request computes every row anyway (no entry is missing), and
    a later plain request still takes the cached blocks."""
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=256))
    try:
        prompt = prompt_of(83, seed=320)
        plain = GenerationRequest(prompt_ids=tuple(prompt), max_tokens=4)
        [cold] = engine.generate([plain])
        scored = _score(engine, prompt, top=0)
        [warm] = engine.generate([plain])
    finally:
        engine.shutdown()
    assert scored.usage.cached_tokens == 0
    _check(tiny_qwen3, prompt, scored.prompt_logprobs, 0)
    assert warm.usage.cached_tokens == 80
    assert scored.token_ids == cold.token_ids == warm.token_ids


def test_prompt_logprobs_in_the_cuda_layout_with_compiled_steps_run_eager(tiny_qwen3):
    """History padded to buckets and read through the block table, compiled decode and mixed steps on: the scoring
    chunks take the eager path (a compiled trace gives the last row's logits only) and the entries are mlx-lm's."""
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), row_ceiling=7, row_floor=1, compile_decode="on",
                                      fuse_decode="on", fuse_mixed="on", compile_mixed="on", warm_up=False,
                                      defer_mixed_traces=False))  # fmt: skip
    engine.runner.kv_bucket = 32
    engine.runner.prefill_gather = table_gather
    try:
        other = prompt_of(9, seed=330)
        handle = engine.submit(GenerationRequest(prompt_ids=tuple(other), max_tokens=30))
        prompt = prompt_of(45, seed=331)
        completion = _score(engine, prompt, top=2)
        other_tokens = [e.token_id for e in handle if e.token_id is not None]
    finally:
        engine.shutdown()
    _check(tiny_qwen3, prompt, completion.prompt_logprobs, 2)
    assert list(completion.token_ids) == reference_tokens(tiny_qwen3, prompt, 4)
    assert other_tokens == reference_tokens(tiny_qwen3, other, 30)


def test_scoring_chunks_stay_off_the_ane_lane(tiny_qwen3):
    """With the lane's CPU stand-in on and long prompts arriving together (chunks placed on the ANE path), a scored
    prompt's chunks run on the GPU path (the lane returns the last row's hidden state only): every entry is there
    and mlx-lm's, and other prompts' chunks still took the lane."""
    sink = MemorySink()
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), ane_lane="cpu", cost_model="bucketed", row_ceiling=256,
                                      row_floor=64, trace=sink))  # fmt: skip
    prompts = [prompt_of(n, seed=80 + i) for i, n in enumerate((150, 210, 180, 260, 130, 240))]
    try:
        streams = [engine.submit(GenerationRequest(prompt_ids=tuple(prompt_of(8, seed=350 + i)), max_tokens=60))
                   for i in range(2)]  # fmt: skip
        readers = StreamReaders(streams)
        assert readers.started.wait(60)
        requests = [GenerationRequest(prompt_ids=tuple(p), max_tokens=4,
                                      sampling=SamplingParams(prompt_logprobs=1 if i == 3 else None))
                    for i, p in enumerate(prompts)]  # fmt: skip
        completions = engine.generate(requests)
        readers.join()
    finally:
        engine.shutdown()
    on_lane = {e.attrs["request_id"] for e in sink.events if isinstance(e, Span) and e.name == "ane_chunk"}
    planned = {lane.request_id for e in sink.events if isinstance(e, StepPlanned) for lane in e.lanes
               if lane.path == "ane"}  # fmt: skip
    scored = {completions[3].request_id}
    assert on_lane and not (on_lane | planned) & scored
    _check(tiny_qwen3, prompts[3], completions[3].prompt_logprobs, 1)
    assert completions[0].prompt_logprobs is None


def test_a_one_token_prompt_has_one_entry_and_a_bad_count_is_refused(tiny_qwen3):
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=64))
    try:
        completion = _score(engine, [42], top=5)
        assert completion.prompt_logprobs == (PromptLogprob(42, None),)
        for bad in (21, -1, True):
            with pytest.raises(InvalidRequest, match="prompt_logprobs"):
                engine.submit(GenerationRequest(prompt_ids=(1, 2), sampling=SamplingParams(prompt_logprobs=bad)))
    finally:
        engine.shutdown()


def test_rows_recomputed_after_a_preemption_are_not_entered_twice():
    request = GenerationRequest(prompt_ids=(5, 6, 7, 8), sampling=SamplingParams(prompt_logprobs=0))
    stream = RequestStream("r", request, detokenizer=None, arrival=0.0)
    first = [PromptLogprob(6, -1.0), PromptLogprob(7, -2.0)]
    stream.add_prompt_logprobs(1, first)
    stream.add_prompt_logprobs(1, [PromptLogprob(6, -1.5), PromptLogprob(7, -2.5), PromptLogprob(8, -3.0)])
    assert stream.prompt_logprobs == [PromptLogprob(5, None), *first, PromptLogprob(8, -3.0)]
