"""The fused decode forward: mlx-lm's tokens on quantized checkpoints, weights held once, clear refusals."""

from __future__ import annotations

import gc
import io

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load

from benchmarks.gpu.profile_mixed import graph_primitives
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.fused_decode import FusedDecode, unsupported_reason
from mlx_serve.kernels.decode_qkv import plain_qkv_rows
from mlx_serve.kernels.paged_attention import batched_decode_attention
from tests.engine.reference import prompt_of, reference_tokens, run_staggered


def assert_parity(path, seed: int, **config) -> Engine:
    """Five staggered requests through an engine with `config` give mlx-lm's tokens; returns the (shut) engine."""
    prompts = [prompt_of(n, seed=seed + n) for n in (23, 7, 41, 16, 30)]
    engine = Engine.load(EngineConfig(model=str(path), row_ceiling=24, row_floor=1, **config))
    try:
        results = run_staggered(engine, prompts, first=2, max_tokens=12)
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_tokens(path, prompt, 12), f"request {i}"
    return engine


def assert_fused_parity(path, seed: int, **overrides) -> Engine:
    """The same through compiled, fused decode steps (with `overrides`)."""
    engine = assert_parity(path, seed, compile_decode="on", fuse_decode="on", **overrides)
    assert engine.runner.compiled.fused is not None
    return engine


@pytest.mark.parametrize("fixture", ["tiny_qwen3_4bit", "tiny_qwen3_8bit", "tiny_qwen3_moe_4bit"])
def test_fused_decode_matches_mlx_lm_on_quantized_checkpoints(fixture, request):
    assert_fused_parity(request.getfixturevalue(fixture), seed=70)


def test_fusing_keeps_one_copy_of_the_weights_and_the_modules_outputs(tiny_qwen3):
    model, _ = load(str(tiny_qwen3))
    x = mx.random.normal((3, 1, model.args.hidden_size), key=mx.random.key(0))
    block = model.model.layers[0]
    before = [block.self_attn.k_proj(x), block.mlp.up_proj(x), model(mx.array([[1, 2, 3]]))]
    mx.eval(before)
    gc.collect()
    active = mx.get_active_memory()
    fused = FusedDecode(model, batched_decode_attention, plain_qkv_rows)
    gc.collect()
    weights = sum(layer.qkv.weight.nbytes + layer.gate_up.weight.nbytes for layer in fused.layers)
    # the projections are views of the fused arrays: what was freed pays for them
    assert mx.get_active_memory() - active < weights / 4
    after = [block.self_attn.k_proj(x), block.mlp.up_proj(x), model(mx.array([[1, 2, 3]]))]
    for a, b in zip(before, after):
        assert mx.array_equal(a, b).item()


def test_unknown_families_are_refused_with_the_reason(tiny_qwen2):
    model, _ = load(str(tiny_qwen2))
    assert "qwen2" in unsupported_reason(model)
    with pytest.raises(InvalidRequest, match="cannot take the fused forward.*qwen2"):
        Engine.load(EngineConfig(model=str(tiny_qwen2), compile_decode="on", fuse_decode="on"))
    # auto quietly keeps mlx-lm's modules
    engine = Engine.load(EngineConfig(model=str(tiny_qwen2), compile_decode="on", fuse_decode="auto"))
    try:
        assert engine.runner.compiled.fused is None
    finally:
        engine.shutdown()


def test_fused_decode_needs_compiled_steps(tiny_qwen3):
    with pytest.raises(InvalidRequest, match="compile"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), compile_decode="off", fuse_decode="on"))


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_dense_experts_equal_the_gathered_experts(tiny_qwen3_moe, rows):
    """Every expert computed, then each row's top-k picked: mlx-lm's router, choice and weighted sum."""
    from mlx_serve import dense_experts

    model, _ = load(str(tiny_qwen3_moe))
    mlp = model.model.layers[1].mlp
    assert dense_experts.supports(mlp)
    x = mx.random.normal((rows, model.args.hidden_size), key=mx.random.key(rows))
    expected, got = mlp(x), dense_experts.dense_moe(mlp, x)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()
    # the tiny model: 8 experts, top 2; dense from 1 row (2 pairs >= a quarter of 8)
    assert dense_experts.worth_it(mlp, 1)


def test_dense_experts_refuse_what_they_cannot_compute(tiny_qwen3_moe_4bit, tiny_qwen3):
    from mlx_serve import dense_experts

    quantized, _ = load(str(tiny_qwen3_moe_4bit))
    dense, _ = load(str(tiny_qwen3))
    assert not dense_experts.supports(quantized.model.layers[0].mlp)  # gather_qmm keeps the packed weights
    assert not dense_experts.supports(dense.model.layers[0].mlp)
    with pytest.raises(InvalidRequest, match="dense_experts must be auto, on or off"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), dense_experts="always"))


def test_fused_decode_with_dense_experts_matches_mlx_lm(tiny_qwen3_moe, monkeypatch):
    from mlx_serve import dense_experts

    calls = []
    original = dense_experts.dense_moe
    monkeypatch.setattr(dense_experts, "dense_moe", lambda mlp, x: calls.append(x.shape[0]) or original(mlp, x))
    assert_fused_parity(tiny_qwen3_moe, seed=90, dense_experts="on")
    assert calls, "the dense experts never ran"


def test_installed_dense_experts_choose_by_rows_and_keep_the_weights(tiny_qwen3_moe, monkeypatch):
    from mlx.utils import tree_flatten

    from mlx_serve import dense_experts

    model, _ = load(str(tiny_qwen3_moe))
    names = [name for name, _ in tree_flatten(model.parameters())]
    assert dense_experts.install(model, max_rows=4) == model.args.num_hidden_layers
    assert dense_experts.install(model, max_rows=4) == 0  # idempotent
    assert [name for name, _ in tree_flatten(model.parameters())] == names
    calls = []
    original = dense_experts.dense_moe
    monkeypatch.setattr(dense_experts, "dense_moe", lambda mlp, x: calls.append(x.shape[0]) or original(mlp, x))
    mlp = model.model.layers[0].mlp
    gathered = type(mlp).__mro__[1].__call__  # mlx-lm's own block
    for rows in (3, 6):
        x = mx.random.normal((rows, 1, model.args.hidden_size), key=mx.random.key(rows))  # the [T, 1] rows layout
        got, expected = mlp(x), gathered(mlp, x)
        assert got.shape == x.shape and mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()
    assert calls == [3]  # 6 rows are past max_rows: gather_mm


def test_eager_steps_with_dense_experts_match_mlx_lm(tiny_qwen3_moe, monkeypatch):
    """Prefill chunks and mixed steps (not only fused decode) through the dense experts give mlx-lm's tokens."""
    from mlx_serve import dense_experts

    calls = []
    original = dense_experts.dense_moe
    monkeypatch.setattr(dense_experts, "dense_moe", lambda mlp, x: calls.append(x.shape[0]) or original(mlp, x))
    assert_parity(tiny_qwen3_moe, seed=95, compile_decode="off", dense_experts="on")
    assert max(calls) > 5, "no prefill chunk went through the dense experts"


def test_dequantized_rows_equal_the_quantized_matmul_in_float32(tiny_qwen3_4bit):
    from mlx_serve.quantized_rows import DequantizedRows

    model, _ = load(str(tiny_qwen3_4bit))
    proj = model.model.layers[0].mlp.gate_proj
    embed = model.model.embed_tokens
    x = mx.random.normal((6, model.args.hidden_size), key=mx.random.key(2))
    dense = DequantizedRows(4)
    assert dense.applies(proj, 6) and not dense.applies(proj, 3) and not DequantizedRows(0).applies(proj, 6)
    assert mx.array_equal(dense.linear(proj, x), proj(x)).item()
    assert mx.array_equal(dense.embedding_as_linear(embed, x), embed.as_linear(x)).item()
    plain = nn.Linear(4, 3)
    assert not dense.applies(plain, 6)  # only quantized modules change path


def test_fused_decode_with_dequantized_rows_matches_mlx_lm(tiny_qwen3_4bit, monkeypatch):
    from mlx_serve import quantized_rows

    dense_calls = []
    original = quantized_rows._dense_weight
    monkeypatch.setattr(quantized_rows, "_dense_weight", lambda m: dense_calls.append(m) or original(m))
    assert_fused_parity(tiny_qwen3_4bit, seed=110, dequantize_rows=2)
    assert dense_calls, "no projection ran dense"
    with pytest.raises(InvalidRequest, match="dequantize_rows must be a whole number"):
        Engine.load(EngineConfig(model=str(tiny_qwen3_4bit), dequantize_rows=-1))


def test_eager_steps_with_dequantized_rows_match_mlx_lm(tiny_qwen3_4bit, monkeypatch):
    """Prefill chunks of enough rows take the dequantized product too (MLX's 4-bit GEMM on CUDA runs prefill at a
    third of bf16 speed); equal to the quantized matmul in float32, so mlx-lm's tokens."""
    from mlx_serve import quantized_rows

    model, _ = load(str(tiny_qwen3_4bit))
    quantized_rows.fold_quantized_rows(model, dequantize_from=4)
    proj = model.model.layers[0].mlp.gate_proj
    dense_calls = []
    original = quantized_rows._dense_weight
    monkeypatch.setattr(quantized_rows, "_dense_weight", lambda m: dense_calls.append(m) or original(m))
    for rows in (6, 3):
        x = mx.random.normal((rows, 1, model.args.hidden_size), key=mx.random.key(rows))  # the [T, 1] rows layout
        want = nn.QuantizedLinear.__call__(proj, x.reshape(1, rows, -1)).reshape(rows, 1, -1)
        assert mx.array_equal(proj(x), want).item()
    assert len(dense_calls) == 1  # the 6-row product only

    assert_parity(tiny_qwen3_4bit, seed=120, compile_decode="off", dequantize_rows=8)
    assert len(dense_calls) > 1, "no prefill chunk ran dense"


@pytest.mark.parametrize("mode", ["on, fused", "on, unfused", "all"])
def test_projections_split_over_k_match_mlx_lm(tiny_qwen3_4bit, narrow_k_splits, mode):
    """`--split-quantized-k on`: o_proj and down_proj (and, without the fused forward, every projection) as sums of
    products over K slices; `all`: the fused q/k/v and gate/up too. Decode and prefill steps; in float32 only the
    order of the sum changes."""
    if mode == "on, fused":
        engine = assert_fused_parity(tiny_qwen3_4bit, seed=130, split_quantized_k="on", fuse_mixed="on")
    elif mode == "on, unfused":
        engine = assert_parity(tiny_qwen3_4bit, seed=131, compile_decode="off", split_quantized_k="on")
    else:
        engine = assert_fused_parity(tiny_qwen3_4bit, seed=132, split_quantized_k="all", fuse_mixed="on")
    block = engine.runner.model.model.layers[0]
    assert block.mlp.down_proj.k_splits == 4 and block.self_attn.o_proj.k_splits == 2
    assert block.self_attn.q_proj.k_splits == (1 if mode == "on, fused" else 2)
    if mode == "all":
        layer = engine.runner.compiled.fused.layers[0]
        assert layer.qkv.k_splits == 2 and layer.gate_up.k_splits == 2
        # the block's own projections are slices of the fused arrays, and still compute their part
        x = mx.random.normal((3, 1, engine.runner.model.args.hidden_size), key=mx.random.key(1))
        q_width = block.self_attn.q_proj.weight.shape[1]
        want = layer.qkv(x.reshape(3, -1))[:, :q_width]
        assert mx.allclose(block.self_attn.q_proj(x).reshape(3, -1), want, rtol=1e-5, atol=1e-5).item()
        # a second engine over the same, already split model (the GPU bench builds one model for several engines),
        # its layout read again off the split projections
        loaded = engine.loaded
        again = Engine.from_model(loaded.model, loaded.tokenizer, loaded.config, engine.config)
        assert again.loaded.layout == loaded.layout
        prompts = [prompt_of(n, seed=133 + n) for n in (23, 9)]
        try:
            results = run_staggered(again, prompts, first=1, max_tokens=8)
        finally:
            again.shutdown()
        assert [results[i] for i in range(2)] == [reference_tokens(tiny_qwen3_4bit, p, 8) for p in prompts]
    with pytest.raises(InvalidRequest, match="split_quantized_k must be auto, on, off or all"):
        Engine.load(EngineConfig(model=str(tiny_qwen3_4bit), split_quantized_k="yes"))
    with pytest.raises(InvalidRequest, match="split_quantized_k all needs fuse_mixed"):
        Engine.load(EngineConfig(model=str(tiny_qwen3_4bit), split_quantized_k="all", fuse_mixed="off"))


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_moe", "tiny_qwen3_4bit", "tiny_llama"])
def test_steps_with_prefill_through_the_fused_forward_match_mlx_lm(fixture, request, monkeypatch):
    """`fuse_mixed`: prefill chunks and mixed steps take the fused forward (q/k/v as one matmul, the prologue
    writing every row's K/V, each lane's attention as in the ragged cache) and still give mlx-lm's tokens."""
    mixed_rows = []
    original = FusedDecode.mixed
    monkeypatch.setattr(
        FusedDecode, "mixed", lambda self, tokens, layout, pool: mixed_rows.append(tokens.shape[0])
        or original(self, tokens, layout, pool),
    )
    assert_fused_parity(request.getfixturevalue(fixture), seed=140, fuse_mixed="on")
    assert mixed_rows and max(mixed_rows) > 5, "no step with prefill took the fused forward"


def test_fuse_mixed_needs_the_fused_forward(tiny_qwen3):
    with pytest.raises(InvalidRequest, match="fuse_mixed on needs the fused decode forward"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), compile_decode="on", fuse_decode="off", fuse_mixed="on"))
    with pytest.raises(InvalidRequest, match="fuse_mixed must be auto, on or off"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), fuse_mixed="sometimes"))


def test_fuse_mixed_auto_is_on_only_with_cuda_and_the_fused_forward(monkeypatch):
    import mlx_serve.kernels.paged_attention as paged_attention
    from mlx_serve import engine_setup

    for cuda in (False, True):
        monkeypatch.setattr(paged_attention, "cuda_available", lambda cuda=cuda: cuda)
        assert engine_setup.fuse_mixed("auto", fused=True) is cuda
        assert engine_setup.fuse_mixed("auto", fused=False) is False
        assert engine_setup.fuse_mixed("off", fused=True) is False


def _in_place_mixed_step(model, gather, table: bool):
    """One 5-row prefill chunk through `FusedDecode.mixed` with a stand-in for the CUDA prologue: like the kernel,
    its K/V writes are not in MLX's graph. Returns the pool, its arrays before the step, and each prologue's queries."""
    from mlx_serve.kv_pool import KVLayout, KVPool
    from mlx_serve.ragged import LaneRows, StepLayout

    args = model.args
    pool = KVPool(KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32), 8, 16)
    prologues = []

    def in_place_qkv(qkv, spec, attn, positions, slots, pool, layer):
        queries = qkv[:, : spec.heads * spec.head_dim].reshape(qkv.shape[0], spec.heads, 1, spec.head_dim)
        prologues.append(queries)
        return queries

    in_place_qkv.in_place = True
    rows = 5
    slots = mx.arange(rows, dtype=mx.int32)
    if table:
        lane = LaneRows(0, rows, slots, table=mx.array([0], dtype=mx.int32), length=mx.array([rows, 16], dtype=mx.int32),
                        kv_len=16, mask=mx.zeros((1, 1, rows, 16)))  # fmt: skip
    else:
        lane = LaneRows(0, rows, slots)
    layout = StepLayout(mx.arange(rows, dtype=mx.int32), slots, None, (lane,), prefill_gather=gather)
    before = list(pool.keys)
    FusedDecode(model, batched_decode_attention, in_place_qkv).mixed(mx.arange(1, rows + 1, dtype=mx.int32), layout, pool)
    return pool, before, prologues


def test_the_fused_forward_for_prefill_orders_the_pool_after_each_layers_in_place_writes(tiny_qwen3):
    """On CUDA the prologue kernel writes K/V in place, unseen by MLX's graph, which orders kernels only by the
    arrays they output. A chunk that samples nothing evaluates only the pool, so each layer's pool arrays must
    depend on its prologue, or nothing runs; and the history gather must take the prologue's output, or it may
    run beside the writes and read stale K/V (the device test's failure before this)."""
    from mlx_lm import load

    from mlx_serve.kernels.paged_gather import table_gather

    model, _ = load(str(tiny_qwen3))
    afters = []

    def ordered_gather(pool_keys, pool_values, lane, block_size, after=None):
        afters.append(after)
        return table_gather(pool_keys, pool_values, lane, block_size)

    ordered_gather.orders_after = True
    pool, before, prologues = _in_place_mixed_step(model, ordered_gather, table=True)
    layers = model.args.num_hidden_layers
    assert len(prologues) == layers
    assert len(afters) == layers and all(after is queries for after, queries in zip(afters, prologues))
    for layer in range(layers):
        assert pool.keys[layer] is not before[layer]  # re-pointed through mx.depends on this layer's prologue
        dot = io.StringIO()
        mx.export_to_dot(dot, pool.keys[layer])
        assert "Depends" in dot.getvalue()


@pytest.mark.parametrize("table", [False, True])
def test_an_in_place_prologue_is_not_used_where_the_history_read_cannot_be_ordered_after_it(tiny_qwen3, table):
    """A lane read by slot indexing, or a gather without an `after` input, cannot be ordered after in-place
    writes: the step takes mlx-lm's prologue (a scatter MLX orders itself)."""
    from mlx_lm import load

    from mlx_serve.kernels.paged_gather import table_gather

    model, _ = load(str(tiny_qwen3))
    pool, _, prologues = _in_place_mixed_step(model, table_gather, table=table)
    assert prologues == []
    for layer in range(model.args.num_hidden_layers):  # the scatter wrote the chunk's keys
        assert mx.all(mx.any(pool.keys[layer][:5] != 0, axis=(1, 2))).item()


@pytest.mark.parametrize("kv_bucket", [0, 32])
def test_fused_mixed_step_equals_the_eager_step_with_bucketed_lanes(tiny_qwen3, kv_bucket):
    """One mixed step (a decode lane and a chunk over a history) through both forwards, with the history padded
    to buckets under a mask as on CUDA (kv_bucket 32) and exact (0): the same logits."""
    from mlx_serve.kernels.paged_attention import select_decode_attention
    from mlx_serve.kv_pool import KVLayout, KVPool
    from mlx_serve.runner import ModelRunner
    from mlx_serve.types import SamplingParams
    from scheduler.plan import Lane, LaneKind, StepPlan

    model, _ = load(str(tiny_qwen3))
    args = model.args
    layout = KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.float32)

    def run(fuse_mixed: bool) -> list[mx.array]:
        runner = ModelRunner(model, KVPool(layout, 16, 16), select_decode_attention("auto"), kv_bucket=kv_bucket,
                             compile_decode=True, fuse_decode=True, fuse_mixed=fuse_mixed)  # fmt: skip
        for rid in ("d", "p"):
            runner.add_request(rid, SamplingParams(temperature=0.0, logprobs=3))
        prompt_d, prompt_p = prompt_of(20, seed=150), prompt_of(50, seed=151)
        first = StepPlan(0, (Lane("d", LaneKind.PREFILL, tuple(prompt_d), 0, (0, 1), True),
                             Lane("p", LaneKind.PREFILL, tuple(prompt_p[:30]), 0, (2, 3, 4, 5), False)), 50, "t", None,
                         True)  # fmt: skip
        token = runner.execute(first).samples["d"].token_id
        mixed = StepPlan(1, (Lane("d", LaneKind.DECODE, (token,), 20, (0, 1), True),
                             Lane("p", LaneKind.PREFILL, tuple(prompt_p[30:]), 30, (2, 3, 4, 5), True)), 20, "t", None,
                         True)  # fmt: skip
        out = runner.execute(mixed)
        return [mx.array([s.token_id, s.logprob]) for s in (out.samples["d"], out.samples["p"])]

    eager, fused = run(False), run(True)
    for a, b in zip(eager, fused):
        assert a[0].item() == b[0].item()
        assert abs(a[1].item() - b[1].item()) < 1e-4


@pytest.mark.parametrize("rows,tile", [(1, 4), (5, 1), (16, 4), (33, 8)])
def test_grouped_experts_equal_the_gathered_experts(tiny_qwen3_moe, rows, tile):
    """Expert tiles through gather_mm (the reference of the `expert_tiles` kernel): every pair lands in one tile of
    its expert, so the block's output is mlx-lm's, whatever the tile size."""
    from mlx_serve.grouped_experts import grouped_moe, tile_count, tile_layout

    model, _ = load(str(tiny_qwen3_moe))
    mlp = model.model.layers[1].mlp
    x = mx.random.normal((rows, model.args.hidden_size), key=mx.random.key(rows))
    assert mx.allclose(grouped_moe(mlp, x, tile), mlp(x), rtol=1e-5, atol=1e-6).item()
    experts = mlp.switch_mlp.gate_proj.num_experts
    chosen = mx.array([[0, 1]] * rows)  # the most lopsided routing: two experts take every pair
    layout = tile_layout(chosen, experts, tile)
    used = layout.used.item()
    assert layout.tile_expert.size == tile_count(2 * rows, experts, tile) and used == 2 * -(-rows // tile)
    slots, source = layout.pair_slot.tolist(), layout.source.tolist()
    assert len(set(slots)) == len(slots)  # no two pairs share a tile row
    for pair, slot in enumerate(slots):  # each pair's row is its input row, in a tile of its expert
        assert source[slot] == pair // 2 and layout.tile_expert[slot // tile].item() == pair % 2
    assert sum(s >= 0 for s in source) == 2 * rows and all(s < 0 for s in source[used * tile :])


def test_eager_steps_through_expert_tiles_match_mlx_lm(tiny_qwen3_moe, monkeypatch):
    """`expert_tiles="on"` off CUDA multiplies the tiles with gather_mm: steps of enough rows (prefill chunks,
    mixed steps) take the tiles, fewer rows the dense form, and the tokens are mlx-lm's."""
    from mlx_serve import dense_experts, grouped_experts

    monkeypatch.setattr(dense_experts, "TILES_FROM_ROWS", 6)
    tiled, dense = [], []
    original_tiles, original_dense = grouped_experts.grouped_moe, dense_experts.dense_moe
    monkeypatch.setattr(dense_experts, "grouped_moe", lambda mlp, x, *a: tiled.append(x.shape[0]) or original_tiles(mlp, x, *a))
    monkeypatch.setattr(dense_experts, "dense_moe", lambda mlp, x: dense.append(x.shape[0]) or original_dense(mlp, x))
    assert_parity(tiny_qwen3_moe, seed=97, compile_decode="off", dense_experts="on", expert_tiles="on")
    assert tiled and min(tiled) >= 6 and dense and max(dense) < 6
    with pytest.raises(InvalidRequest, match="expert_tiles must be auto, on or off"):
        Engine.load(EngineConfig(model=str(tiny_qwen3_moe), expert_tiles="kernel"))


def test_blocks_the_tile_kernel_cannot_take_keep_the_other_forms(tiny_qwen3_moe):
    """The CUDA kernel takes bf16 weights in whole 128 x 32 slices: the tiny model's float32 experts (48 wide) are
    never handed to it, while gather_mm's tiles take any block."""
    from mlx_serve import dense_experts
    from mlx_serve.grouped_experts import gather_tiles, tiles_fit
    from mlx_serve.kernels.expert_tiles import expert_tiles_matmul

    model, _ = load(str(tiny_qwen3_moe))
    mlp = model.model.layers[0].mlp
    assert not tiles_fit(expert_tiles_matmul, mlp) and tiles_fit(gather_tiles, mlp)
    dense_experts.install(model, tiles=expert_tiles_matmul)
    assert type(mlp).expert_tiles is None and type(mlp).dense_max_rows == dense_experts.MAX_ROWS


def test_the_moe_warm_up_runs_each_form_once(tiny_qwen3_moe, monkeypatch):
    """`warm_moe_blocks` (CUDA start-up: the tile kernels compile at first use) runs one block at a row count of
    each form and tile size within the ceiling: dense, small tiles, large tiles."""
    from mlx_serve import dense_experts

    tiled, dense = [], []
    original_tiles, original_dense = dense_experts.grouped_moe, dense_experts.dense_moe
    monkeypatch.setattr(dense_experts, "grouped_moe", lambda mlp, x, tile, *a: tiled.append(tile) or original_tiles(mlp, x, tile, *a))
    monkeypatch.setattr(dense_experts, "dense_moe", lambda mlp, x: dense.append(x.shape[0]) or original_dense(mlp, x))
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3_moe), dense_experts="on", expert_tiles="on"))
    engine.shutdown()
    assert engine.runner.warm_moe_blocks(1024) == 3 and dense == [8] and tiled == [32, 64]
    assert engine.runner.warm_moe_blocks(100) == 2  # within the ceiling only


def test_dense_projections_multiply_by_transposes_evaluated_once(tiny_qwen3):
    """No Transpose node a projection a step (each is host work on CUDA), the same products bit for bit, and a
    module put in a projection's place (an adapter) or a weight re-pointed is called as it is."""
    model, _ = load(str(tiny_qwen3))
    fused = FusedDecode(model, batched_decode_attention, plain_qkv_rows)
    layer = fused.layers[0]
    x = mx.random.normal((5, model.args.hidden_size), key=mx.random.key(1))
    o_in = mx.random.normal((5, layer.block.self_attn.o_proj.weight.shape[1]), key=mx.random.key(2))
    for linear, inputs in ((layer.qkv, x), (layer.gate_up, x), (layer.block.self_attn.o_proj, o_in)):
        ours, theirs = fused._project(linear, inputs), linear(inputs)
        assert "Transpose" not in graph_primitives(ours) and "Transpose" in graph_primitives(theirs)
        assert mx.array_equal(ours, theirs).item()

    class Wrapped(nn.Module):  # what an adapter install does: another module where the projection was
        def __init__(self, base):
            super().__init__()
            self.base = base

        def __call__(self, x):
            return self.base(x) * 2

    wrapped = Wrapped(layer.block.self_attn.o_proj)
    assert mx.array_equal(fused._project(wrapped, o_in), layer.block.self_attn.o_proj(o_in) * 2).item()
    layer.qkv.weight = layer.qkv.weight * 1  # re-pointed: the cached transpose no longer applies
    assert "Transpose" in graph_primitives(fused._project(layer.qkv, x))


def test_a_projection_with_a_bias_adds_it_as_the_linear_does():
    from types import SimpleNamespace

    from mlx_serve.fused_decode import transposed_weights

    linear = nn.Linear(8, 4, bias=True)
    holder = SimpleNamespace(_transposed=transposed_weights([linear, nn.QuantizedLinear(64, 64)]))
    assert list(holder._transposed) == [id(linear)]  # only dense linears
    x = mx.random.normal((3, 8), key=mx.random.key(3))
    ours = FusedDecode._project(holder, linear, x)
    assert "Transpose" not in graph_primitives(ours) and mx.array_equal(ours, linear(x)).item()
