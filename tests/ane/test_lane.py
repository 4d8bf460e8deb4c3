"""The lane contract as the runner will use it: K/V from the engine's KV pool in, new K/V back into it."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from ane_reference import mlx_forward, prompt

from mlx_serve.ane import handoff
from mlx_serve.ane.lane import LaneError, MlxCpuStandInLane, make_lane
from mlx_serve.kv_pool import KVLayout, KVPool, slot_array
from scheduler.plan import Lane, LaneKind, Path

BLOCK_SIZE = 16


def _pool(model) -> KVPool:
    attn = model.layers[0].self_attn
    layout = KVLayout(len(model.layers), attn.n_kv_heads, round(attn.scale**-2), mx.float32)
    return KVPool(layout, num_blocks=8, block_size=BLOCK_SIZE)


def _prefill_through_lane(lane, model, tokens: list[int], chunk: int):
    """The runner's hand-off (mlx_serve.ane.handoff), one chunk after another, as scheduler lanes."""
    pool = _pool(model)
    block_ids = tuple(range(8))
    hidden, labels = [], set()
    for start in range(0, len(tokens), chunk):
        piece = tuple(tokens[start : start + chunk])
        plan_lane = Lane(
            f"req-{start}", LaneKind.PREFILL, piece, start, block_ids, samples=False, path=Path.ANE
        )
        result = handoff.submit_from_pool(lane, plan_lane, pool).result(timeout_s=60.0)
        handoff.write_back(result, plan_lane, pool)
        hidden.append(result.hidden)
        labels.add(result.label)
        assert result.finished_s >= result.submitted_s and result.rows == len(piece)
    all_slots = mx.array(slot_array(block_ids, 0, len(tokens), BLOCK_SIZE))
    kv = [pool.gather(layer, all_slots) for layer in range(len(model.layers))]
    return mx.concatenate(hidden), kv, labels


def test_stand_in_reproduces_mlx_prefill_and_kv(qwen3_model) -> None:
    tokens = prompt(40, qwen3_model.args.vocab_size, seed=5)
    expected = mlx_forward(qwen3_model, tokens)
    lane = MlxCpuStandInLane(qwen3_model)
    hidden, kv, labels = _prefill_through_lane(lane, qwen3_model, tokens, chunk=12)
    assert labels == {"mlx-cpu-standin"}
    np.testing.assert_allclose(np.array(hidden), expected.hidden, atol=1e-4, rtol=1e-4)
    for layer, (keys, values) in enumerate(kv):
        np.testing.assert_allclose(np.array(keys), expected.keys[layer], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.array(values), expected.values[layer], atol=1e-4, rtol=1e-4)
    last_logits = np.array(lane.logits(hidden[-1:]))
    assert int(last_logits.argmax()) == int(expected.logits[-1].argmax())


def test_stand_in_accepts_within_its_context(qwen3_model) -> None:
    lane = MlxCpuStandInLane(qwen3_model, max_context=64)
    assert lane.accepts(0, 16) and lane.accepts(64, 16)
    assert not lane.accepts(65, 16) and not lane.accepts(0, 0)


def test_make_lane_modes(qwen3_model) -> None:
    assert make_lane("off", qwen3_model) is None
    assert isinstance(make_lane("cpu", qwen3_model), MlxCpuStandInLane)
    with pytest.raises(ValueError):
        make_lane("gpu", qwen3_model)


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal off macOS")
def test_coreml_lane_refuses_off_macos(qwen3_model, qwen3_package) -> None:
    with pytest.raises(LaneError, match="only on macOS"):
        make_lane("coreml", qwen3_model, package=qwen3_package)


def test_chunk_span_uses_the_given_clock(qwen3_model) -> None:
    ticks = iter(range(100))
    lane = MlxCpuStandInLane(qwen3_model, clock=lambda: float(next(ticks)))
    result = lane.run_chunk("r1", [1, 2, 3], 0, [])
    span = result.span(step_id=7)
    assert (span.name, span.start, span.end, span.step_id) == ("ane_chunk", 0.0, 1.0, 7)
    assert span.attrs == {"request_id": "r1", "rows": 3, "start": 0, "lane": "mlx-cpu-standin"}


def test_core_ml_failure_and_timeout_become_lane_errors() -> None:
    # the runner's fallback contract: any failure or timeout surfaces as LaneError, never a hang or a crash
    from concurrent.futures import Future

    from mlx_serve.ane.coreml_lane import _PredictingChunk

    failed: Future = Future()
    failed.set_exception(RuntimeError("ANE compile failed"))
    with pytest.raises(LaneError, match="compile failed"):
        _PredictingChunk(failed, "r", 0, 0.0, clock=lambda: 0.0).result(timeout_s=1.0)
    never: Future = Future()
    pending = _PredictingChunk(never, "r", 0, 0.0, clock=lambda: 0.0)
    assert not pending.done()
    with pytest.raises(LaneError, match="timed out"):
        pending.result(timeout_s=0.01)
