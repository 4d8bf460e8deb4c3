"""LoRA adapters: chosen per request (`EngineConfig.adapters`, rows of several adapters and the base in one step)
and applied to the model itself (`adapter_path`). Each request's greedy tokens are mlx-lm's own with that adapter
loaded (`mlx_lm.load(..., adapter_path=...)`); what cannot be served is refused with the field to blame."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_serve.adapter_specs import AdapterSpec, parse_adapter_spec
from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.checkpoints.adapters import make_adapter
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest, ModelNotFound, UnsupportedModel
from mlx_serve.types import GenerationRequest
from tests.engine.reference import prompt_of, reference_adapter_tokens, reference_tokens

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("lora") / "base", arch="qwen3", seed=3)


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        # mlx-lm's usual keys over every layer
        "alpha": make_adapter(base, root / "alpha", rank=8, scale=20.0, seed=1),
        # another rank, other linears (attention output, a dense MLP's down projection), the last layer only
        "beta": make_adapter(base, root / "beta", rank=4, scale=10.0, num_layers=1, seed=2,
                             keys=("self_attn.o_proj", "mlp.down_proj", "self_attn.k_proj")),
    }  # fmt: skip


def adapter_tokens(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    """mlx-lm's greedy tokens with `adapter` loaded (None: the base model)."""
    if adapter is None:
        return reference_tokens(base, prompt, MAX_TOKENS)
    return reference_adapter_tokens(base, adapter, prompt, MAX_TOKENS)


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def engine_with(base: Path, adapters: dict[str, Path], **settings) -> Engine:
    specs = tuple(AdapterSpec(name, str(path)) for name, path in adapters.items())
    return Engine.load(EngineConfig(model=str(base), kv_blocks=128, row_ceiling=24, row_floor=4, adapters=specs,
                                    **settings))  # fmt: skip


# compiled decode steps (on with CUDA) replay the base model's trace: steps with adapter rows must run eager
@pytest.mark.parametrize("compile_decode", ["off", "on"])
def test_rows_of_several_adapters_and_the_base_share_steps_and_give_mlx_lms_tokens(base, adapters, compile_decode):
    # the same prompt under each adapter: the prefix cache must not hand one adapter's KV to another
    shared = prompt_of(40, seed=7)
    cases = [(None, shared), ("alpha", shared), ("beta", shared), ("alpha", prompt_of(57, seed=8)),
             (None, prompt_of(23, seed=9)), ("beta", prompt_of(66, seed=10))]  # fmt: skip
    engine = engine_with(base, adapters, compile_decode=compile_decode)
    slots_a_step: list[set[int]] = []
    adapted_forward = engine.runner._adapted_forward

    def recording(prepared):
        slots_a_step.append(set(np.array(prepared.adapter_rows).tolist()))
        return adapted_forward(prepared)

    engine.runner._adapted_forward = recording
    try:
        first = iter(engine.submit(GenerationRequest(prompt_ids=tuple(shared), max_tokens=MAX_TOKENS)))
        head = next(first)  # the rest arrive while it decodes: prefill chunks of every adapter beside its lane
        handles = [iter(engine.submit(GenerationRequest(prompt_ids=tuple(p), max_tokens=MAX_TOKENS, adapter=a)))
                   for a, p in cases[1:]]  # fmt: skip
        results = [tokens_of([head, *first])] + [tokens_of(h) for h in handles]
    finally:
        engine.shutdown()
    for (adapter, prompt), tokens in zip(cases, results):
        assert tokens == adapter_tokens(base, adapters.get(adapter), prompt), f"adapter {adapter}"
    # each adapter changes the answer (so the comparison above proves it was applied)
    assert len({tuple(results[i]) for i in range(3)}) == 3
    assert {0, 1, 2} in slots_a_step  # some step carried rows of the base and of both adapters


def test_an_adapter_request_reuses_only_its_own_cached_prefix(base, adapters):
    prompt = prompt_of(48, seed=11)
    engine = engine_with(base, adapters)
    try:
        def run(adapter):
            return engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=4, adapter=adapter)])[0]

        cold_base, cold_alpha, warm_alpha, warm_base = run(None), run("alpha"), run("alpha"), run(None)
    finally:
        engine.shutdown()
    assert cold_alpha.usage.cached_tokens == 0  # the base model's blocks of this prompt are not alpha's
    assert warm_alpha.usage.cached_tokens > 0 and warm_base.usage.cached_tokens > 0
    assert warm_alpha.token_ids == cold_alpha.token_ids and warm_base.token_ids == cold_base.token_ids


def test_an_adapter_over_a_quantized_base_gives_mlx_lms_tokens(tmp_path):
    base = make_checkpoint(tmp_path / "q4", arch="qwen3", seed=4, quantize_bits=4, group_size=32)
    adapter = make_adapter(base, tmp_path / "a", rank=8, seed=5, keys=("self_attn.q_proj", "mlp.up_proj"))
    prompts = [prompt_of(30, seed=12), prompt_of(45, seed=13)]
    engine = engine_with(base, {"a": adapter})
    try:
        done = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=MAX_TOKENS, adapter="a")
                                for p in prompts])  # fmt: skip
    finally:
        engine.shutdown()
    for prompt, completion in zip(prompts, done):
        assert list(completion.token_ids) == adapter_tokens(base, adapter, prompt)


def test_adapter_path_serves_the_fine_tuned_model_as_mlx_lm_loads_it(base, adapters):
    prompts = [prompt_of(35, seed=14), prompt_of(50, seed=15)]
    engine = Engine.load(EngineConfig(model=str(base), kv_blocks=128, row_ceiling=24, row_floor=4,
                                      adapter_path=str(adapters["alpha"])))  # fmt: skip
    try:
        done = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=MAX_TOKENS) for p in prompts])
    finally:
        engine.shutdown()
    for prompt, completion in zip(prompts, done):
        assert list(completion.token_ids) == adapter_tokens(base, adapters["alpha"], prompt)


def test_a_cancelled_adapter_request_leaves_the_others_right(base, adapters):
    prompt = prompt_of(30, seed=16)
    engine = engine_with(base, adapters)
    try:
        doomed = engine.submit(GenerationRequest(prompt_ids=tuple(prompt_of(90, seed=17)), max_tokens=200,
                                                 adapter="beta"))  # fmt: skip
        next(iter(doomed))
        kept = engine.submit(GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS, adapter="alpha"))
        threading.Timer(0.05, doomed.cancel).start()
        tokens = tokens_of(kept)
        assert list(doomed)[-1].finish_reason == "cancelled"
        assert engine.runner._adapter_of == {}  # both released their adapter slot
    finally:
        engine.shutdown()
    assert tokens == adapter_tokens(base, adapters["alpha"], prompt)


@pytest.mark.parametrize("bits", [None, 4])
def test_base_rows_take_the_fused_forward_beside_adapters(tmp_path, base, adapters, bits):
    """As on CUDA: steps with no adapter row run the fused forward (decode compiled, prefill in compiled mixed
    traces), adapter rows the modules; an adapter loaded at runtime wraps the fused forward's views of q/k/v."""
    if bits is not None:
        base = make_checkpoint(tmp_path / "q4", arch="qwen3", seed=8, quantize_bits=bits, group_size=32)
        adapters = {"alpha": make_adapter(base, tmp_path / "a", rank=8, seed=9),
                    "beta": make_adapter(base, tmp_path / "b", rank=4, seed=10, keys=("self_attn.v_proj",
                                                                                      "mlp.up_proj"))}  # fmt: skip
    prompts = [prompt_of(29, seed=24), prompt_of(44, seed=25)]
    engine = engine_with(base, {"alpha": adapters["alpha"]}, compile_decode="on", fuse_decode="on", fuse_mixed="on",
                         compile_mixed="on", defer_mixed_traces="off", warm_up=False, adapter_memory_gb=0.1)
    fused_steps = []
    mixed = engine.runner.fused_mixed.mixed
    engine.runner.fused_mixed.mixed = lambda *args: fused_steps.append(args) or mixed(*args)
    try:
        assert engine.runner.compiled.fused is not None
        engine.load_adapter(AdapterSpec("beta", str(adapters["beta"])))
        cases = [(p, a) for p in prompts for a in (None, "alpha", "beta")]
        done = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=MAX_TOKENS, adapter=a)
                                for p, a in cases])  # fmt: skip
        alone = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=MAX_TOKENS) for p in prompts])
    finally:
        engine.shutdown()
    assert fused_steps  # the base-only steps ran the fused forward
    for (prompt, adapter), completion in zip(cases, done):
        assert list(completion.token_ids) == adapter_tokens(base, adapters.get(adapter), prompt), f"adapter {adapter}"
    for prompt, completion in zip(prompts, alone):
        assert list(completion.token_ids) == adapter_tokens(base, None, prompt)


def test_an_unknown_adapter_is_refused_at_submit(base, adapters):
    engine = engine_with(base, {"alpha": adapters["alpha"]})
    try:
        with pytest.raises(ModelNotFound, match="adapter 'gamma' is not served; adapters served: alpha"):
            engine.submit(GenerationRequest(prompt_ids=(1, 2, 3), adapter="gamma"))
    finally:
        engine.shutdown()


def test_adapter_specs_are_checked_before_the_model_loads(tmp_path, base, adapters):
    assert parse_adapter_spec("chat=/a/b=c") == AdapterSpec("chat", "/a/b=c")
    with pytest.raises(InvalidRequest, match="NAME=DIR"):
        parse_adapter_spec("just-a-path")
    cases = [
        ((AdapterSpec("a", str(adapters["alpha"])), AdapterSpec("a", str(adapters["beta"]))), "given twice"),
        ((AdapterSpec("a b", str(adapters["alpha"])),), "only letters"),
        ((AdapterSpec("a", str(tmp_path / "none")),), "adapter_config.json and adapters.safetensors"),
    ]
    for specs, message in cases:
        with pytest.raises((InvalidRequest, ModelNotFound), match=message):
            Engine.load(EngineConfig(model=str(tmp_path / "never-read"), adapters=specs))


def _rewrite(source: Path, out: Path, config: dict | None = None, weights: dict | None = None) -> Path:
    out.mkdir()
    original = json.loads((source / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**original, **(config or {})}))
    loaded = mx.load(str(source / "adapters.safetensors"))
    mx.save_safetensors(str(out / "adapters.safetensors"), weights(loaded) if callable(weights) else loaded)
    return out


@pytest.mark.parametrize(
    ("config", "weights", "error", "message"),
    [
        ({"fine_tune_type": "dora"}, None, UnsupportedModel, "'dora' fine-tune; per-request adapters are LoRA only"),
        ({"lora_parameters": {"rank": 8}}, None, InvalidRequest, "lora_parameters.scale is missing"),
        (None, lambda w: {k: v[:, :-1] if k.endswith("lora_a") else v for k, v in w.items()}, InvalidRequest,
         "lora_a \\(128, 7\\) / lora_b \\(8, 128\\) do not fit a 128 -> 128 linear"),
        (None, lambda w: {**w, "lm_head.lora_a": mx.zeros((128, 8)), "lm_head.lora_b": mx.zeros((8, 10))},
         UnsupportedModel, "the decoder layers' linears only"),
        (None, lambda w: {**w, "model.layers.0.self_attn.q_proj.m": mx.zeros((4,))}, UnsupportedModel,
         "other than LoRA matrices"),
    ],
)  # fmt: skip
def test_an_adapter_the_engine_cannot_serve_is_refused_at_load(tmp_path, base, adapters, config, weights, error,
                                                               message):  # fmt: skip
    bad = _rewrite(adapters["alpha"], tmp_path / "bad", config, weights)
    with pytest.raises(error, match=message):
        Engine.load(EngineConfig(model=str(base), kv_blocks=64, adapters=(AdapterSpec("bad", str(bad)),)))


def test_a_mismatched_adapter_path_is_a_clear_error(tmp_path, base, adapters):
    with pytest.raises(ModelNotFound, match="no adapter_config.json"):
        Engine.load(EngineConfig(model=str(base), kv_blocks=64, adapter_path=str(tmp_path)))
    bad = _rewrite(adapters["alpha"], tmp_path / "bad",
                   weights=lambda w: {k: v[:, :-1] if k.endswith("lora_a") else v for k, v in w.items()})
    with pytest.raises(InvalidRequest, match="adapter path .*incompatible"):
        Engine.load(EngineConfig(model=str(base), kv_blocks=64, adapter_path=str(bad)))


def test_adapters_in_the_cuda_layout(base, adapters):
    """As on CUDA: prefill history in buckets read through the block table, base-only decode steps compiled."""
    from mlx_serve.kernels.paged_gather import table_gather

    prompts = [prompt_of(33, seed=18), prompt_of(47, seed=19)]
    engine = engine_with(base, adapters, compile_decode="on", warm_up=False)
    engine.runner.kv_bucket, engine.runner.prefill_gather = 32, table_gather
    try:
        done = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=MAX_TOKENS, adapter=a)
                                for p in prompts for a in (None, "alpha", "beta")])  # fmt: skip
    finally:
        engine.shutdown()
    cases = [(p, a) for p in prompts for a in (None, "alpha", "beta")]
    for (prompt, adapter), completion in zip(cases, done):
        assert list(completion.token_ids) == adapter_tokens(base, adapters.get(adapter), prompt), f"adapter {adapter}"


def test_an_adapter_loaded_at_runtime_over_split_k_quantized_linears(tmp_path):
    """As a 4-bit model runs on CUDA: its products folded and split over K before any adapter comes (the engine
    splits only products wide enough to gain from it; here every one is split in two, as it would be)."""
    from mlx_serve.adapter_specs import AdapterSpec as Spec
    from mlx_serve.quantized_rows import RowsQuantizedLinear, split_k

    base = make_checkpoint(tmp_path / "q4", arch="qwen3", seed=6, quantize_bits=4, group_size=32)
    adapter = make_adapter(base, tmp_path / "a", rank=8, seed=7, keys=("self_attn.o_proj", "mlp.down_proj"))
    prompt = prompt_of(40, seed=20)
    engine = Engine.load(EngineConfig(model=str(base), kv_blocks=128, split_quantized_k="on", dequantize_rows=16,
                                      adapter_memory_gb=0.1))  # fmt: skip
    try:
        for _, module in engine.loaded.model.named_modules():
            if type(module) is RowsQuantizedLinear:
                split_k(module, 2)
        engine.load_adapter(Spec("a", str(adapter)))
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS, adapter="a")])
    finally:
        engine.shutdown()
    assert list(done.token_ids) == adapter_tokens(base, adapter, prompt)


def _held_bytes(engine: Engine) -> int:
    """What the adapted linears' stacks hold, read off the model."""
    from mlx_serve.adapters import AdaptedLinear

    return sum(m.lora_a.nbytes + m.lora_b.nbytes + m.scales.nbytes
               for _, m in engine.loaded.model.named_modules() if isinstance(m, AdaptedLinear))  # fmt: skip


def test_adapters_loaded_at_runtime_stay_within_the_memory_kept_for_them(base, adapters):
    """The stacks a load would build are priced before anything changes: at the limit it loads, a byte under it is
    refused and the adapters served answer as before."""
    prompt = prompt_of(30, seed=21)
    engine = engine_with(base, {"alpha": adapters["alpha"]}, adapter_memory_gb=0.0)
    try:
        assert engine.adapter_bytes == engine.adapter_limit_bytes == _held_bytes(engine) > 0
        with pytest.raises(InvalidRequest, match="would bring the adapters' matrices to .* MiB, over the .* MiB kept "
                                                 "for them \\(raise --adapter-memory-gb\\)"):  # fmt: skip
            engine.load_adapter(AdapterSpec("beta", str(adapters["beta"])))
        assert engine.adapters == ("alpha",) and _held_bytes(engine) == engine.adapter_bytes  # nothing changed
        # beta takes a new slot in alpha's stacks, and stacks of its own: priced exactly
        engine.adapter_limit_bytes = 1 << 40
        engine.load_adapter(AdapterSpec("beta", str(adapters["beta"])))
        needed = engine.adapter_bytes
        assert needed == _held_bytes(engine)
        engine.unload_adapter("beta")
        engine.unload_adapter("alpha")
        assert engine.adapters == () and engine.adapter_bytes == _held_bytes(engine) < needed  # freed: rank-1 zeros
        engine.adapter_limit_bytes = needed  # both again, in the freed slots: the same stacks, so they fit
        engine.load_adapter(AdapterSpec("beta", str(adapters["beta"])))
        engine.load_adapter(AdapterSpec("alpha", str(adapters["alpha"])))
        assert _held_bytes(engine) == needed
        done = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=MAX_TOKENS, adapter=a)
                                for a in ("alpha", "beta")])  # fmt: skip
    finally:
        engine.shutdown()
    for adapter, completion in zip(("alpha", "beta"), done):
        assert list(completion.token_ids) == adapter_tokens(base, adapters[adapter], prompt), adapter


def test_the_memory_kept_for_adapters_comes_out_of_the_kv_pool(base):
    from mlx_serve.model_loading import kv_pool_blocks

    engine = Engine.load(EngineConfig(model=str(base), kv_blocks=16, warm_up=False))
    engine.shutdown()
    block_bytes = engine.loaded.layout.bytes_per_token() * 16

    def blocks(kept_gb: float) -> int:
        return kv_pool_blocks(EngineConfig(memory_budget_gb=0.25, max_running=10**6, adapter_memory_gb=kept_gb),
                              engine.loaded)  # fmt: skip

    assert blocks(0.0) - blocks(0.125) == pytest.approx(0.125 * 2**30 * 0.9 / block_bytes, abs=1)
    with pytest.raises(Exception, match="and 0.25 GiB kept for adapters; at least"):
        blocks(0.25)
    with pytest.raises(InvalidRequest, match="adapter_memory_gb must be a number >= 0"):
        Engine.load(EngineConfig(model=str(base), adapter_memory_gb=-1.0))


def test_compiled_decode_steps_carry_adapter_rows_and_forget_their_traces_when_adapters_change(base, adapters):
    """Decode steps with adapter rows replay compiled traces of their own; a trace holds the stacks it was built over,
    so loading another adapter into a freed slot must not replay the old adapter's matrices."""
    prompts = [prompt_of(26, seed=22), prompt_of(31, seed=23)]
    engine = engine_with(base, {"alpha": adapters["alpha"]}, compile_decode="on", adapter_memory_gb=0.1)
    eager_steps = []
    adapted_forward = engine.runner._adapted_forward
    engine.runner._adapted_forward = lambda prepared: eager_steps.append(prepared) or adapted_forward(prepared)

    def run(adapter: str) -> list[list[int]]:
        done = engine.generate([GenerationRequest(prompt_ids=tuple(p), max_tokens=MAX_TOKENS, adapter=a)
                                for p in prompts for a in (adapter, None)])  # fmt: skip
        return [list(c.token_ids) for c in done]

    try:
        first = run("alpha")
        adapted_shapes = {shape for shape in engine.runner.compiled.shapes if len(shape) == 3}
        steps_first = len(eager_steps)
        engine.unload_adapter("alpha")
        assert not any(len(shape) == 3 for shape in engine.runner.compiled.shapes)  # the traces went with it
        engine.load_adapter(AdapterSpec("beta", str(adapters["beta"])))  # into alpha's slot
        second = run("beta")
    finally:
        engine.shutdown()
    assert adapted_shapes  # decode steps with alpha's rows replayed a trace
    assert steps_first < MAX_TOKENS  # only the prompts' chunks ran eager, not a step per token
    cases = [(p, a) for named in ("alpha", "beta") for p in prompts for a in (named, None)]
    for tokens, (prompt, adapter) in zip(first + second, cases, strict=True):
        assert tokens == adapter_tokens(base, adapters.get(adapter), prompt), adapter
