"""What the builder writes: a multifunction package whose functions follow the contract; refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ane_reference import build, load, mlx_forward, prompt, relative_error
from coremltools.converters.mil.mil import types

from mlx_serve.ane import contract
from mlx_serve.ane.builder import build_package_from_spec, package_geometries
from mlx_serve.ane.check import TOLERANCE, interpret_prompt, mlx_prompt, worst_errors
from mlx_serve.ane.interpreter import Interpreter
from mlx_serve.ane.spec import dense_spec
from mlx_serve.errors import UnsupportedModel


def test_package_has_one_function_per_chunk_size(qwen3_model, qwen3_package: Path) -> None:
    geometries = package_geometries(qwen3_package)
    assert list(geometries) == [16, 32]
    spec = dense_spec(qwen3_model)
    for rows, geo in geometries.items():
        assert geo.function_name == contract.function_name(rows)
        assert (geo.max_context, geo.hidden_size, geo.num_layers) == (128, spec.hidden_size, spec.num_layers)
    program = Interpreter.from_package(qwen3_package).program
    function = program.functions["prefill_16"]
    outputs = [var.name for var in function.outputs]
    assert outputs == ["hidden_out"] + [f"{kv}_{i}" for i in range(spec.num_layers) for kv in "kv"]
    op_types = {op.op_type for op in function.operations}
    assert "conv" in op_types and "gather" not in op_types  # linears as 1x1 convs; embedding left in MLX
    assert all(var.dtype == types.fp16 for var in function.inputs.values())
    assert all(var.dtype == types.fp16 for var in function.outputs)


def test_moe_models_are_refused(tiny_qwen3_moe: Path) -> None:
    with pytest.raises(UnsupportedModel, match="qwen3_moe"):
        dense_spec(load(tiny_qwen3_moe))


def test_sizes_are_checked(qwen3_model, tmp_path: Path) -> None:
    spec = dense_spec(qwen3_model)
    with pytest.raises(ValueError, match="multiple of 32"):
        build_package_from_spec(spec, tmp_path / "x.mlpackage", (16,), max_context=100)
    with pytest.raises(ValueError, match="16,384"):
        build_package_from_spec(spec, tmp_path / "x.mlpackage", (64,), max_context=16384)


@pytest.fixture(scope="module", params=["int8", "int4"])
def compressed_package(request: pytest.FixtureRequest, qwen3_model, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp(request.param) / "model.mlpackage"
    return request.param, build(qwen3_model, out, chunk_sizes=(16,), compression=request.param)


def test_compressed_package_stays_close(qwen3_model, compressed_package) -> None:
    # per-weight quantization noise on this random model: int8 ~1% per linear (measured ~3% after 2 layers);
    # int4 per-block(32) ~10% per linear (measured ~30%): int4 trades quality for size, check on real weights
    compression, package = compressed_package
    program = Interpreter.from_package(package).program
    op_types = {op.op_type for op in program.functions["prefill_16"].operations}
    assert "constexpr_blockwise_shift_scale" in op_types
    tokens = prompt(20, qwen3_model.args.vocab_size, seed=6)
    hidden = interpret_prompt(qwen3_model, package, tokens, chunk=16).hidden
    bound = {"int8": 0.06, "int4": 0.6}[compression]
    assert relative_error(hidden, mlx_forward(qwen3_model, tokens).hidden) < bound


def test_compressed_weights_decompress_to_the_originals(qwen3_model, compressed_package) -> None:
    # the interpreter's decompression is exact to the quantizer: every weight within half a quantization step
    compression, package = compressed_package
    interpreter = Interpreter.from_package(package)
    function = interpreter.program.functions["prefill_16"]
    conv = next(
        op for op in function.operations if op.op_type == "conv" and op.name.startswith("layer0_q_proj")
    )
    weight_op = conv.inputs["weight"].op
    values = {name: var.val for name, var in weight_op.inputs.items()}
    decompressed = interpreter.handlers[weight_op.op_type](weight_op, values)[:, :, 0, 0].astype(np.float32)
    original = dense_spec(qwen3_model).layers[0].q.weight
    if compression == "int8":  # per output channel, levels -127..127
        step = np.abs(original).max(axis=1, keepdims=True) / 127
    else:  # per block of 32 inputs, levels -7..7
        blocks = original.reshape(original.shape[0], -1, 32)
        step = np.repeat(np.abs(blocks).max(axis=-1) / 7, 32, axis=1)
    assert (np.abs(decompressed - original) <= step * 0.51 + 1e-3).all()


def test_quantized_mlx_model_builds_from_its_dequantized_weights(
    tiny_qwen3_4bit: Path, tmp_path: Path
) -> None:
    model = load(tiny_qwen3_4bit)
    package = build(model, tmp_path / "q4.mlpackage", chunk_sizes=(16,))
    tokens = prompt(20, model.args.vocab_size, seed=8)
    errors = worst_errors(interpret_prompt(model, package, tokens, chunk=16), mlx_prompt(model, tokens))
    assert max(errors.values()) < TOLERANCE, errors
