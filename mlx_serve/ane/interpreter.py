"""A NumPy reference interpreter for the saved ANE package, so its numerics are checked on Linux.

Core ML itself runs only on macOS. Here the SAVED `.mlpackage` is read back (its MIL protobuf, through
coremltools' own milproto loader) and each op is evaluated in program order: by the op's own
`value_inference` where coremltools has one (elementwise, reductions, reshapes, ...), by a small handler
here where it does not (conv, constexpr weight decompression). Values stay in the program's dtypes (fp16),
so this measures fp16 effects too; it says nothing about the Neural Engine's own rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

Handler = Callable[..., object]


def load_program(package: Path):
    """The pymil Program of a saved `.mlpackage` (all its functions)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto import load as milproto

    mlmodel = ct.models.MLModel(str(package), skip_model_load=True)
    spec = mlmodel.get_spec()
    return milproto.load(spec, spec.specificationVersion, mlmodel.weights_dir)


def _conv(op, values: Mapping[str, np.ndarray]) -> np.ndarray:
    weight = values["weight"]
    if weight.shape[2:] != (1, 1) or int(np.prod(values.get("strides", [1, 1]))) != 1:
        raise NotImplementedError(f"{op.name}: only 1x1, stride-1 convs are interpreted")
    if int(values.get("groups", 1)) != 1:
        raise NotImplementedError(f"{op.name}: grouped conv is not interpreted")
    x = values["x"]
    # accumulate in fp32 like the hardware's wide accumulators, round to the output dtype once
    out = np.einsum("oi,bihw->bohw", weight[:, :, 0, 0].astype(np.float32), x.astype(np.float32))
    if values.get("bias") is not None:
        out = out + values["bias"].astype(np.float32)[None, :, None, None]
    return out.astype(x.dtype)


def _matmul(op, values: Mapping[str, np.ndarray]) -> np.ndarray:
    x, y = values["x"], values["y"]
    if values.get("transpose_x"):
        x = np.swapaxes(x, -1, -2)
    if values.get("transpose_y"):
        y = np.swapaxes(y, -1, -2)
    return np.matmul(x.astype(np.float32), y.astype(np.float32)).astype(values["x"].dtype)


def _silu(op, values: Mapping[str, np.ndarray]) -> np.ndarray:
    x = values["x"].astype(np.float32)
    return (x / (1.0 + np.exp(-x))).astype(values["x"].dtype)


def _blockwise_shift_scale(op, values: Mapping[str, np.ndarray]) -> np.ndarray:
    data = values["data"].astype(np.float32)
    scale = values["scale"].astype(np.float32)
    offset = values.get("offset")
    repeats = [d // s for d, s in zip(data.shape, scale.shape)]
    if offset is not None:
        data = (
            data - np.tile(offset.astype(np.float32), repeats)
            if offset.shape != data.shape
            else data - offset
        )
    full_scale = scale
    for axis, repeat in enumerate(repeats):
        full_scale = np.repeat(full_scale, repeat, axis=axis)
    return (data * full_scale).astype(values["scale"].dtype)


# ops whose coremltools value_inference is missing or unusable on runtime values
HANDLERS: dict[str, Handler] = {
    "conv": _conv,
    "matmul": _matmul,  # value_inference exists but computes in fp16 end to end; hardware accumulates wider
    "silu": _silu,
    "constexpr_blockwise_shift_scale": _blockwise_shift_scale,
}


class Interpreter:
    """Runs one function of a loaded program on NumPy inputs; returns its outputs by name."""

    def __init__(self, program, handlers: Mapping[str, Handler] | None = None) -> None:
        self.program = program
        self.handlers = dict(HANDLERS, **(handlers or {}))

    @classmethod
    def from_package(cls, package: Path) -> Interpreter:
        return cls(load_program(package))

    @property
    def function_names(self) -> list[str]:
        return list(self.program.functions)

    def run(self, function_name: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        function = self.program.functions[function_name]
        env: dict[str, np.ndarray] = {}
        for name, var in function.inputs.items():
            env[var.name] = np.asarray(inputs[name]).astype(_np_dtype(var)).reshape(var.shape)
        for op in function.operations:
            for var, value in zip(op.outputs, self._evaluate(op, env)):
                env[var.name] = value
        return {var.name: env[var.name] for var in function.outputs}

    def _evaluate(self, op, env: Mapping[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        if op.op_type == "const":
            return (op.outputs[0].val,)
        values = {name: _value_of(arg, env) for name, arg in op.inputs.items()}
        handler = self.handlers.get(op.op_type)
        if handler is not None:
            result = handler(op, values)
        else:
            result = _value_inference(op, env)
        results = result if isinstance(result, (tuple, list)) else (result,)
        return tuple(np.asarray(r).astype(_np_dtype(v)) for r, v in zip(results, op.outputs))


def _np_dtype(var) -> np.dtype:
    from coremltools.converters.mil.mil import types

    return np.dtype(types.nptype_from_builtin(var.dtype))


def _value_of(arg, env: Mapping[str, np.ndarray]):
    if isinstance(arg, (tuple, list)):
        return [_value_of(a, env) for a in arg]
    if arg.name in env:
        return env[arg.name]
    return arg.val


def _bound(var, env: Mapping[str, np.ndarray]):
    """A detached copy of `var` carrying its runtime value, for the op's value_inference to read."""
    from coremltools.converters.mil.mil import Var

    if isinstance(var, (tuple, list)):
        return type(var)(_bound(v, env) for v in var)
    value = env.get(var.name) if var.val is None else var.val
    if value is None:
        return var
    if isinstance(value, np.bool_):  # numpy 2 rejects np.bool_ flags (keep_dims) in reductions
        value = bool(value)
    holder = var.sym_type()
    holder.val = value
    return Var(var.name, var.sym_type, sym_val=holder)


def _value_inference(op, env: Mapping[str, np.ndarray]):
    # value_inference reads both the attribute and op._input_vars: swap both, restore after
    originals = dict(op._input_vars)
    try:
        bound = {name: None if var is None else _bound(var, env) for name, var in originals.items()}
        op._input_vars = bound
        for name, var in bound.items():
            setattr(op, name, var)
        result = op.value_inference()
    except NotImplementedError as exc:
        raise NotImplementedError(f"no interpreter handler for MIL op {op.op_type!r} ({op.name})") from exc
    finally:
        op._input_vars = originals
        for name, var in originals.items():
            setattr(op, name, var)
    if result is None:
        raise NotImplementedError(f"value_inference of {op.op_type!r} ({op.name}) gave no value")
    return result
