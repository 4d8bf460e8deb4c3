"""Dummy checkpoints: mlx-lm loads them unchanged, they are deterministic, their tokenizer covers the vocab."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_serve.checkpoints import checkpoint_config, make_checkpoint
from mlx_serve.checkpoints.shards import TensorSpec, plan_shards
from mlx_serve.checkpoints.tokenizer import ADDED_TOKENS, build_tokenizer, token_ids
from mlx_serve.checkpoints.weights import hf_tensor_specs
from mlx_serve.errors import InvalidRequest

FLOAT_FIXTURES = ["tiny_qwen3", "tiny_llama", "tiny_qwen2", "tiny_qwen3_moe"]
QUANT_FIXTURES = {"tiny_qwen3_4bit": 4, "tiny_qwen3_8bit": 8, "tiny_qwen3_moe_4bit": 4}


def file_hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def greedy_tokens(model, tokenizer, text: str, max_tokens: int = 8) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]


@pytest.mark.parametrize("fixture", FLOAT_FIXTURES)
def test_tiny_checkpoint_loads_and_generates_with_mlx_lm(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(fixture)
    model, tokenizer, config = mlx_lm.load(str(path), return_config=True)
    assert config["vocab_size"] == len(tokenizer) == model.args.vocab_size
    assert type(tokenizer.detokenizer).__name__ == "BPEStreamingDetokenizer"
    text = mlx_lm.generate(model, tokenizer, "Hello there", max_tokens=6)
    assert isinstance(text, str) and text


def test_mistral_checkpoint_keeps_its_model_type_and_loads(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "mistral", arch="mistral", seed=7)
    model, tokenizer, config = mlx_lm.load(str(path), return_config=True)
    assert config["model_type"] == "mistral"
    assert type(model).__module__ == "mlx_lm.models.llama"
    assert len(greedy_tokens(model, tokenizer, "hi", max_tokens=3)) == 3


@pytest.mark.parametrize("fixture", FLOAT_FIXTURES)
def test_weights_are_sharded_with_a_complete_index(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((path / "model.safetensors.index.json").read_text())
    stored = {name: shard.name for shard in shards for name in mx.load(str(shard))}
    assert index["weight_map"] == stored
    assert index["metadata"]["total_size"] == sum(v.nbytes for s in shards for v in mx.load(str(s)).values())


def test_moe_checkpoint_stores_experts_unstacked_like_hugging_face(tiny_qwen3_moe: Path) -> None:
    names = json.loads((tiny_qwen3_moe / "model.safetensors.index.json").read_text())["weight_map"]
    config = json.loads((tiny_qwen3_moe / "config.json").read_text())
    assert not any("switch_mlp" in name for name in names)
    for e in range(config["num_experts"]):
        assert f"model.layers.0.mlp.experts.{e}.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names


def test_same_seed_gives_same_bytes_and_other_seed_differs(tmp_path: Path) -> None:
    first = file_hashes(make_checkpoint(tmp_path / "a", arch="qwen3", seed=11))
    again = file_hashes(make_checkpoint(tmp_path / "b", arch="qwen3", seed=11))
    other = file_hashes(make_checkpoint(tmp_path / "c", arch="qwen3", seed=12))
    assert first == again
    assert first["model-00001-of-00003.safetensors"] != other["model-00001-of-00003.safetensors"]
    # the last shard holds only the final norm (ones), so it may match
    assert first["tokenizer.json"] == other["tokenizer.json"]


def test_quantized_checkpoints_are_deterministic_too(tmp_path: Path) -> None:
    first = make_checkpoint(tmp_path / "a", arch="qwen3_moe", seed=5, quantize_bits=4, group_size=32)
    again = make_checkpoint(tmp_path / "b", arch="qwen3_moe", seed=5, quantize_bits=4, group_size=32)
    assert file_hashes(first) == file_hashes(again)


def test_greedy_output_depends_on_the_prompt(tiny_qwen3: Path) -> None:
    model, tokenizer = mlx_lm.load(str(tiny_qwen3))
    outputs = [greedy_tokens(model, tokenizer, text) for text in ("Hello", "The capital of France", "1 2 3")]
    assert len({tuple(out) for out in outputs}) == 3
    assert all(len(set(out)) >= 3 for out in outputs), outputs


def test_every_id_decodes_and_special_tokens_sit_at_the_end(tiny_qwen3: Path) -> None:
    _, tokenizer, config = mlx_lm.load(str(tiny_qwen3), return_config=True)
    vocab_size = config["vocab_size"]
    assert len(tokenizer.convert_ids_to_tokens(list(range(vocab_size)))) == vocab_size
    for token_id in range(vocab_size):
        assert isinstance(tokenizer.decode([token_id]), str)
    detokenizer = tokenizer.detokenizer
    for token_id in range(vocab_size):
        detokenizer.add_token(token_id)
    detokenizer.finalize()
    ids = token_ids(vocab_size)
    assert [tokenizer.convert_tokens_to_ids(text) for text, _ in ADDED_TOKENS] == list(ids.values())
    assert tokenizer.eos_token_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}


def test_real_size_tokenizer_has_exactly_the_vocab_size() -> None:
    tokenizer = build_tokenizer(151936)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 151936
    assert tokenizer.id_to_token(151935) == ADDED_TOKENS[-1][0]
    assert (
        tokenizer.decode(tokenizer.encode("hello world, the tokenizer").ids) == "hello world, the tokenizer"
    )


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_text_round_trips_through_the_tokenizer(text: str) -> None:
    tokenizer = _tiny_tokenizer()
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def _tiny_tokenizer(cache: dict = {}):  # noqa: B006 - a tiny memo shared across hypothesis examples
    if "tok" not in cache:
        cache["tok"] = build_tokenizer(checkpoint_config("qwen3", "tiny")["vocab_size"])
    return cache["tok"]


def test_chat_template_renders_chatml_and_tool_calls(tiny_qwen3: Path) -> None:
    _, tokenizer = mlx_lm.load(str(tiny_qwen3))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "sunny"},
    ]
    plain = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    assert (
        plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call in text
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        in text
    )
    assert tokenizer.tool_call_start == "<tool_call>" and tokenizer.tool_call_end == "</tool_call>"
    body = call.removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert tokenizer.tool_parser(body) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    no_think = tokenizer.apply_chat_template(
        messages[1:2], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("fixture", sorted(QUANT_FIXTURES))
def test_quantized_checkpoints_load_and_generate(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    config = json.loads((path / "config.json").read_text())
    bits = QUANT_FIXTURES[fixture]
    assert config["quantization"] == config["quantization_config"]
    defaults = {key: config["quantization"][key] for key in ("group_size", "bits", "mode")}
    assert defaults == {"group_size": 64, "bits": bits, "mode": "affine"}
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
    model, tokenizer = mlx_lm.load(str(path))
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert model.model.layers[0].self_attn.q_proj.bits == bits
    assert len(greedy_tokens(model, tokenizer, "Hello", max_tokens=4)) == 4


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_mixed_precision_checkpoint_loads_and_generates(arch: str, tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / arch, arch=arch, seed=8, quant_predicate="mixed_3_6", group_size=32)
    quantization = json.loads((path / "config.json").read_text())["quantization"]
    per_layer_bits = {v["bits"] for v in quantization.values() if isinstance(v, dict)}
    assert per_layer_bits == {3, 6}
    model, tokenizer = mlx_lm.load(str(path))
    assert {m.bits for m in model.modules() if hasattr(m, "bits")} == {3, 6}
    assert len(greedy_tokens(model, tokenizer, "Hello", max_tokens=4)) == 4


@pytest.mark.parametrize(
    ("arch", "preset", "expected"),
    [
        (
            "qwen3",
            "0.6b",
            dict(
                hidden_size=1024,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                intermediate_size=3072,
                vocab_size=151936,
            ),
        ),
        (
            "qwen3",
            "8b",
            dict(hidden_size=4096, num_hidden_layers=36, num_key_value_heads=8, vocab_size=151936),
        ),
        (
            "qwen3_moe",
            "30b-a3b",
            dict(
                hidden_size=2048,
                num_hidden_layers=48,
                num_experts=128,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
                mlp_only_layers=[],
                decoder_sparse_step=1,
                norm_topk_prob=True,
            ),
        ),
        ("llama", "8b", dict(hidden_size=4096, num_hidden_layers=32, vocab_size=128256)),
    ],
)
def test_big_presets_have_the_real_shapes(arch: str, preset: str, expected: dict) -> None:
    config = checkpoint_config(arch, preset, "bfloat16")
    assert config["model_type"] == arch and config["torch_dtype"] == "bfloat16"
    assert {key: config[key] for key in expected} == expected


@pytest.mark.parametrize(
    ("arch", "preset", "low", "high"),
    [("qwen3", "0.6b", 0.55e9, 0.65e9), ("qwen3_moe", "30b-a3b", 30.0e9, 31.0e9)],
)
def test_big_preset_parameter_counts_match_the_real_models(
    arch: str, preset: str, low: float, high: float
) -> None:
    specs = hf_tensor_specs(checkpoint_config(arch, preset, "bfloat16"), "bfloat16")
    params = sum(spec.nbytes for spec in specs) // 2
    assert low < params < high


@pytest.mark.parametrize(
    ("arch", "preset"),
    [("mistral", "0.6b"), ("qwen3", "30b-a3b"), ("qwen3_moe", "8b"), ("bloom", "tiny"), ("qwen3", "70b")],
)
def test_combos_that_make_no_sense_are_refused(arch: str, preset: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match=arch if arch in ("bloom",) else preset):
        make_checkpoint(tmp_path / "x", arch=arch, preset=preset)
    assert not (tmp_path / "x").exists()


def test_bad_quantization_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="bits"):
        make_checkpoint(tmp_path / "a", quantize_bits=7)
    with pytest.raises(InvalidRequest, match="group size"):
        make_checkpoint(tmp_path / "b", quantize_bits=4, group_size=48)
    with pytest.raises(InvalidRequest, match="recipe"):
        make_checkpoint(tmp_path / "c", quant_predicate="mixed_9_9")


def test_shard_plan_splits_small_models_and_caps_big_shards() -> None:
    small = [TensorSpec(f"t{i}", (4,), 16) for i in range(4)]
    assert [len(shard) for shard in plan_shards(small)] == [2, 2]
    big = [TensorSpec(f"t{i}", (1,), 3 << 30) for i in range(3)]
    assert [len(shard) for shard in plan_shards(big, max_shard_bytes=4 << 30)] == [1, 1, 1]


def test_make_model_cli_writes_a_loadable_checkpoint_and_refuses_bad_combos(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "mlx_serve", "make-model"]
    done = subprocess.run(
        [*cmd, "--arch", "llama", "--out", str(out), "--seed", "3"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    model, tokenizer = mlx_lm.load(str(out))
    assert len(greedy_tokens(model, tokenizer, "hi", max_tokens=2)) == 2
    refused = subprocess.run(
        [*cmd, "--arch", "mistral", "--preset", "0.6b", "--out", str(tmp_path / "m")],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0
    assert "error: --arch mistral --preset 0.6b makes no sense" in refused.stderr
    shown = subprocess.run(
        [*cmd, "--preset", "0.6b", "--config-only", "--out", str(tmp_path / "c")],
        capture_output=True,
        text=True,
    )
    assert json.loads(shown.stdout)["hidden_size"] == 1024
    assert not (tmp_path / "c").exists()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, message in ((a_file, "is not a directory"), (a_file / "below", "cannot create")):
        refused = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True)
        assert refused.returncode == 1 and message in refused.stderr and "Traceback" not in refused.stderr


def test_cli_choices_match_the_library() -> None:
    from mlx_lm.convert import QUANT_RECIPES

    from mlx_serve.checkpoints import ARCHS, DTYPES, PRESETS
    from mlx_serve.commands import make_model

    assert (make_model.ARCHS, make_model.PRESETS, make_model.DTYPES) == (ARCHS, PRESETS, DTYPES)
    assert list(make_model.RECIPES) == list(QUANT_RECIPES)


def test_default_model_is_built_once_in_the_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_serve.checkpoints import default_model_path

    monkeypatch.setenv("MLX_SERVE_CACHE", str(tmp_path))
    path = default_model_path()
    assert path.parent == tmp_path and (path / "config.json").is_file()
    hashes = file_hashes(path)
    assert default_model_path() == path and file_hashes(path) == hashes
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging directory left behind
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"


def test_processes_racing_to_build_the_default_model_agree(tmp_path: Path) -> None:
    script = "from mlx_serve.checkpoints import default_model_path; print(default_model_path())"
    env = {**__import__("os").environ, "MLX_SERVE_CACHE": str(tmp_path)}
    racers = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = {racer.communicate()[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    assert len(paths) == 1
    path = Path(paths.pop())
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    model, tokenizer = mlx_lm.load(str(path))
    assert len(greedy_tokens(model, tokenizer, "hi", max_tokens=2)) == 2
