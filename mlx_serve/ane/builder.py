"""Build the ANE prefill package: the decoder stack of a loaded mlx-lm model as a Core ML ML program.

No PyTorch: the program is written op by op with coremltools' MIL builder (`mil_layers.py`), one function per
chunk size, merged into one multifunction `.mlpackage` (weights shared between functions). Inputs and outputs
are described in `contract.py`. Building and saving work on Linux; running the package needs macOS.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from mlx_serve.ane import contract
from mlx_serve.ane.spec import DenseSpec, dense_spec

COMPRESSIONS = ("int8", "int4")
DEFAULT_CHUNK_SIZES = (64,)
DEFAULT_MAX_CONTEXT = 2048


class Progress(Protocol):
    """The part of a tqdm bar the builder uses."""

    def update(self, n: int = 1) -> object: ...
    def set_description(self, desc: str) -> object: ...


def geometry(spec: DenseSpec, rows: int, max_context: int) -> contract.ChunkGeometry:
    return contract.ChunkGeometry(
        rows=rows,
        max_context=max_context,
        hidden_size=spec.hidden_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_layers=spec.num_layers,
    )


def build_function(spec: DenseSpec, rows: int, max_context: int):
    """The MIL function for one chunk size (a `coremltools` pymil `Function`)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, types
    from coremltools.converters.mil.mil.program import Placeholder  # noqa: F401  (TensorSpec's base)

    from mlx_serve.ane import mil_layers

    shapes = geometry(spec, rows, max_context).input_shapes()
    specs = {name: mb.TensorSpec(shape=shape, dtype=types.fp16) for name, shape in shapes.items()}
    with Function(specs, opset_version=ct.target.iOS18) as function:
        inputs = function.inputs
        tables = (inputs["rope_cos"], inputs["rope_sin"])
        x = inputs["hidden"]
        new_kv = []
        for index, weights in enumerate(spec.layers):
            layer_io = (inputs[contract.past_key_name(index)], inputs[contract.past_value_name(index)])
            x, k_new, v_new = mil_layers.decoder_layer(
                x, weights, spec, layer_io, tables, inputs["attn_mask"], rows, index
            )
            new_kv += [
                mb.identity(x=k_new, name=contract.new_key_name(index)),
                mb.identity(x=v_new, name=contract.new_value_name(index)),
            ]
        out = mil_layers.rms_norm(x, spec.final_norm, spec.rms_norm_eps, axis=1, name="hidden_out")
        function.set_outputs([out, *new_kv])
    return function


def _convert(function):
    """One function -> an in-memory `MLModel` (fp16 throughout: the program is already fp16)."""
    import coremltools as ct
    from coremltools.converters.mil.mil import Program

    program = Program()
    program.add_function("main", function)
    return ct.convert(
        program,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,
    )


def compress_weights(mlmodel, compression: str):
    """int8: per-channel symmetric; int4: per-block (32) symmetric. Only the 1x1 conv (linear) weights."""
    import coremltools.optimize.coreml as cto

    if compression == "int8":
        op_config = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", weight_threshold=0)
    elif compression == "int4":
        op_config = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=32, weight_threshold=0
        )
    else:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
    config = cto.OptimizationConfig(op_type_configs={"conv": op_config})
    return cto.linear_quantize_weights(mlmodel, config)


def build_package(
    model,
    out: Path,
    chunk_sizes: Sequence[int] = DEFAULT_CHUNK_SIZES,
    max_context: int = DEFAULT_MAX_CONTEXT,
    compression: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write `out` (a `.mlpackage`) for an mlx-lm model object. Returns `out`.

    Steps reported to `progress`: 2 per chunk size (build, convert) + 1 per size if compressing + 1 to merge.
    """
    spec = dense_spec(model)
    return build_package_from_spec(spec, out, chunk_sizes, max_context, compression, progress)


def count_steps(chunk_sizes: Sequence[int], compression: str | None) -> int:
    return len(chunk_sizes) * (3 if compression else 2) + 1


def build_package_from_spec(
    spec: DenseSpec,
    out: Path,
    chunk_sizes: Sequence[int],
    max_context: int,
    compression: str | None = None,
    progress: Progress | None = None,
) -> Path:
    import coremltools as ct

    _check_sizes(chunk_sizes, max_context)
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="mlx_serve_ane_") as tmp:
        descriptor = None
        for rows in sorted(set(chunk_sizes)):
            name = contract.function_name(rows)
            _step(progress, f"build {name}")
            function = build_function(spec, rows, max_context)
            _step(progress, f"convert {name}")
            mlmodel = _convert(function)
            if compression:
                _step(progress, f"compress {name} ({compression})")
                mlmodel = compress_weights(mlmodel, compression)
            path = str(Path(tmp) / f"{name}.mlpackage")
            mlmodel.save(path)
            if descriptor is None:
                descriptor = ct.utils.MultiFunctionDescriptor()
            descriptor.add_function(path, "main", name)
        descriptor.default_function_name = contract.function_name(min(chunk_sizes))
        _step(progress, "merge functions")
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        ct.utils.save_multifunction(descriptor, str(out))
    return out


def _step(progress: Progress | None, description: str) -> None:
    if progress is not None:
        progress.set_description(description)
        progress.update(1)


def _check_sizes(chunk_sizes: Sequence[int], max_context: int) -> None:
    if not chunk_sizes or any(rows < 1 for rows in chunk_sizes):
        raise ValueError(f"chunk sizes must be positive, got {list(chunk_sizes)}")
    # the ANE wants no dimension above 16,384 (ARCHITECTURE.md)
    if max_context + max(chunk_sizes) > 16384:
        raise ValueError("max_context + chunk rows must stay within 16,384 (a Neural Engine limit)")
    if max_context % 32:
        raise ValueError("max_context must be a multiple of 32 (Neural Engine tensor alignment)")


def package_geometries(package: Path) -> dict[int, contract.ChunkGeometry]:
    """Chunk rows -> geometry, read from a saved package's own function descriptions (works on Linux)."""
    import coremltools as ct

    spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    geometries = {}
    for function in spec.description.functions:
        shapes = {f.name: tuple(f.type.multiArrayType.shape) for f in function.input}
        _, hidden_size, _, rows = shapes["hidden"]
        _, num_kv_heads, max_context, head_dim = shapes[contract.past_key_name(0)]
        num_layers = sum(1 for name in shapes if name.startswith("past_k_"))
        geo = contract.ChunkGeometry(rows, max_context, hidden_size, num_kv_heads, head_dim, num_layers)
        if geo.function_name != function.name:
            raise ValueError(f"{package}: function {function.name!r} does not follow the prefill contract")
        geometries[rows] = geo
    return dict(sorted(geometries.items()))
