"""`profile_mixed`'s primitive count (`--parts count`), on the CPU with the tiny shape: the step it counts is the
step the runner queues, so a chunk's step counts what a decode step does plus its own attention's primitives."""

from __future__ import annotations

import mlx.core as mx
import pytest

from benchmarks.gpu.models import build_dummy_model
from benchmarks.gpu.profile_mixed import mixed_step_runner, step_ops
from mlx_serve.kv_pool import KVLayout


@pytest.fixture(scope="module")
def tiny():
    dummy = build_dummy_model("tiny", "float32")
    args = dummy.model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    return dummy.model, KVLayout(args.num_hidden_layers, args.num_key_value_heads, head_dim, mx.float32)


def test_a_chunk_adds_primitives_to_a_decode_step(tiny):
    model, layout = tiny
    decode = step_ops(model, layout, lanes=2, rows=0, history=256, variant="fused")
    mixed = step_ops(model, layout, lanes=2, rows=24, history=256, variant="fused")
    lone = step_ops(model, layout, lanes=0, rows=24, history=256, variant="fused")
    for counted in (decode, mixed, lone):
        assert counted["primitives"] == sum(counted["kinds"].values())
        assert 0 < counted["views"] < counted["primitives"]
        # every layer's projections are in the graph: at least q/k/v, o, gate/up and down a layer
        assert counted["kinds"]["Matmul"] >= 4 * model.args.num_hidden_layers
    assert mixed["primitives"] > decode["primitives"]
    assert mixed["primitives"] > lone["primitives"]


def test_the_runner_plans_decode_only_and_lone_chunk_steps(tiny):
    model, layout = tiny
    _, decode_only = mixed_step_runner(model, layout, lanes=3, rows=0, history=128, variant="fused", repeats=2)
    plan = decode_only(0)
    assert plan.prefill_rows == 0 and len(plan.lanes) == 3 and plan.contended
    _, lone_chunk = mixed_step_runner(model, layout, lanes=0, rows=40, history=128, variant="fused", repeats=2)
    plan = lone_chunk(0)
    (lane,) = plan.lanes
    assert plan.prefill_rows == 40 and lane.samples and not plan.contended  # a continuation samples its last row
