"""The expert-tiles grouped GEMM (CUDA) against its gather_mm reference, tile by tile and as a whole MoE block."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.grouped_experts import gather_tiles, grouped_moe, tile_count
from mlx_serve.kernels import expert_tiles
from mlx_serve.kernels.expert_tiles import expert_tiles_matmul, supports

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the expert-tiles kernel needs MLX's CUDA backend")


def test_supports_only_the_shapes_the_kernel_tiles() -> None:
    weight = mx.zeros((4, 256, 64), dtype=mx.bfloat16)
    assert supports(weight, 32) and supports(weight, 16) and supports(weight, 64)
    assert not supports(weight, 8)  # tile rows
    assert not supports(weight.astype(mx.float32), 32)
    assert not supports(mx.zeros((4, 200, 64), dtype=mx.bfloat16), 32)  # N not a multiple of 128
    assert not supports(mx.zeros((4, 256, 96), dtype=mx.bfloat16), 32)  # K not a multiple of 64 (either k step)


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("tile", [16, 32, 64])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("experts,n,k,used", [(8, 128, 64, 5), (16, 256, 2048, 16), (128, 768, 2048, 100), (4, 2048, 768, 7)])
@pytest.mark.parametrize("k_step,stages", [(32, 3), (64, 2)])
def test_the_used_tiles_equal_the_gather_mm_reference(tile, gather, experts, n, k, used, k_step, stages,
                                                      monkeypatch) -> None:  # fmt: skip
    """Tile rows read in place, or gathered from input rows (padding rows, source -1, read as zeros), with either
    k step (padded or swizzled shared memory)."""
    monkeypatch.setattr(expert_tiles, "KB", k_step)
    monkeypatch.setattr(expert_tiles, "PIPE", stages)
    rng = np.random.default_rng(experts + n + k + tile)
    total = used + 3  # trailing tiles the kernel skips
    inputs = total * tile // 2 if gather else total * tile
    x = mx.array(rng.standard_normal((inputs, k)).astype(np.float32)).astype(mx.bfloat16)
    weight = mx.array((rng.standard_normal((experts, n, k)) * 0.05).astype(np.float32)).astype(mx.bfloat16)
    tile_expert = mx.array(np.sort(rng.integers(0, experts, total)).astype(np.uint32))
    used_tiles = mx.array([used], dtype=mx.int32)
    source = None
    if gather:
        rows = rng.integers(0, inputs, total * tile)
        source = mx.array(np.where(rng.random(total * tile) < 0.3, -1, rows).astype(np.int32))
    got = expert_tiles_matmul(x, weight, tile_expert, used_tiles, tile, source)[: used * tile].astype(mx.float32)
    want = gather_tiles(x, weight, tile_expert, used_tiles, tile, source)[: used * tile].astype(mx.float32)
    scale = mx.abs(want).max().item()
    assert mx.abs(got - want).max().item() <= 1e-2 * scale  # bf16 outputs, fp32 sums in different orders


@pytest.mark.device
@on_cuda
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_moe_block_through_the_kernel_equals_mlx_lms_block(rows) -> None:
    from mlx_lm.models.qwen3_moe import ModelArgs, Qwen3MoeSparseMoeBlock

    args = ModelArgs(model_type="qwen3_moe", hidden_size=256, num_hidden_layers=1, intermediate_size=512,
                     num_attention_heads=4, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1,
                     mlp_only_layers=[], moe_intermediate_size=128, rms_norm_eps=1e-6, vocab_size=100,
                     num_key_value_heads=2, head_dim=64, rope_theta=1e4, tie_word_embeddings=False,
                     max_position_embeddings=512, norm_topk_prob=True)  # fmt: skip
    block = Qwen3MoeSparseMoeBlock(args)
    block.set_dtype(mx.bfloat16)
    x = mx.random.normal((rows, 256), key=mx.random.key(rows)).astype(mx.bfloat16)
    want = block(x).astype(mx.float32)
    for tile in (16, 32, 64):
        assert tile_count(rows * 4, 16, tile) >= 1
        got = grouped_moe(block, x, tile, expert_tiles_matmul).astype(mx.float32)
        assert mx.abs(got - want).max().item() <= 2e-2 * mx.abs(want).max().item()
