"""`FusedDecode.mixed` with the CUDA kernels (in-place K/V prologue, paged gather, bucketed SDPA) against the eager
step, eager and compiled (`CompiledMixed`): the part of `--fuse-mixed` the CPU cannot test. A first chunk that samples nothing evaluates only the pool,
so it also checks that each layer's in-place writes run (the pool's arrays depend on them)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_serve.checkpoints.builder import checkpoint_config
from mlx_serve.checkpoints.weights import build_mlx_model
from mlx_serve.engine_setup import prefill_gather
from mlx_serve.kernels.paged_attention import select_decode_attention
from mlx_serve.kv_pool import KVLayout, KVPool
from mlx_serve.runner import ModelRunner
from mlx_serve.types import SamplingParams
from scheduler.plan import Lane, LaneKind, StepPlan

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the fused prologue kernel needs MLX's CUDA backend")


def _small_qwen3():
    """Two Qwen3 layers with 128-wide heads (the prologue kernel's shape) and random weights."""
    config = checkpoint_config("qwen3", "tiny", "float32")
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = build_mlx_model(config)
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(3), len(params))
    model.update(tree_unflatten([
        (name, 1.0 + 0.1 * mx.random.uniform(-1, 1, p.shape, key=k) if "norm" in name
         else 0.05 * mx.random.normal(p.shape, key=k))
        for (name, p), k in zip(params, keys)
    ]))  # fmt: skip
    mx.eval(model.parameters())
    return model


@on_cuda
@pytest.mark.device
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_mixed_steps_with_the_kernels_equal_the_eager_steps(compiled):
    model = _small_qwen3()
    args = model.args
    layout = KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32)
    prompt = [(i * 7919) % (args.vocab_size - 10) + 10 for i in range(1500)]
    blocks_p, blocks_d = tuple(range(2, 100)), (0, 1)

    def run(fuse_mixed: bool) -> list[tuple[int, float]]:
        pool = KVPool(layout, 128, 16)
        runner = ModelRunner(model, pool, select_decode_attention("auto"), compile_decode=True, fuse_decode=True,
                             fuse_mixed=fuse_mixed, compile_mixed=fuse_mixed and compiled,
                             prefill_gather=prefill_gather(pool))  # fmt: skip
        for rid in ("d", "p"):
            runner.add_request(rid, SamplingParams(temperature=0.0, logprobs=1))
        # a chunk that samples nothing: only the pool is evaluated
        runner.execute(StepPlan(0, (Lane("p", LaneKind.PREFILL, tuple(prompt[:1024]), 0, blocks_p, False),), 1024,
                                "t", None, False))  # fmt: skip
        first = runner.execute(StepPlan(1, (Lane("d", LaneKind.PREFILL, tuple(prompt[:20]), 0, blocks_d, True),), 20,
                                        "t", None, False))  # fmt: skip
        token = first.samples["d"].token_id
        mixed = StepPlan(2, (Lane("d", LaneKind.DECODE, (token,), 20, blocks_d, True),
                             Lane("p", LaneKind.PREFILL, tuple(prompt[1024:]), 1024, blocks_p, True)), 476, "t", None,
                         True)  # fmt: skip
        out = runner.execute(mixed)
        return [(token, first.samples["d"].logprob)] + [(s.token_id, s.logprob) for s in out.samples.values()]

    eager, fused = run(False), run(True)
    assert [t for t, _ in fused] == [t for t, _ in eager]
    for (_, a), (_, b) in zip(fused, eager):
        assert abs(a - b) < 1e-3, (a, b)
