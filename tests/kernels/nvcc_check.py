"""Compile our `mx.fast.cuda_kernel` sources with nvcc on a machine without a GPU.

`recorded_kernels()` stands in for `mx.fast.cuda_kernel` while a kernel's Python wrapper runs on the CPU: each call
is answered with zeros of the asked shapes and its source is kept, wrapped as MLX's CUDA backend wraps it (the
same signature: inputs with their `_shape` / `_strides` / `_ndim` where the body names them, outputs, template
constants). `compile_source` then runs `nvcc` for sm_90 over it, against a small stand-in for MLX's device header.
A kernel that does not compile is then found here, not in a device call.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

CUDA_TYPES = {
    mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.int32: "int32_t",
    mx.uint32: "uint32_t", mx.int64: "int64_t", mx.uint64: "uint64_t", mx.int8: "int8_t", mx.uint8: "uint8_t",
    mx.int16: "int16_t", mx.uint16: "uint16_t", mx.bool_: "bool",
}  # fmt: skip

# what MLX's `mlx/backend/cuda/device/utils.cuh` gives a custom kernel, as far as our kernels use it
DEVICE_HEADER = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cooperative_groups.h>
namespace mlx::core::cu {
struct Shape { int32_t d[10]; __device__ int32_t operator[](int i) const { return d[i]; } };
struct Strides { int64_t d[10]; __device__ int64_t operator[](int i) const { return d[i]; } };
}
#define inf __int_as_float(0x7f800000)
"""


@dataclass
class RecordedKernel:
    name: str
    source: str  # the whole translation unit, as MLX's CUDA backend builds it


def nvcc() -> str | None:
    return shutil.which("nvcc")


def _wrap(name: str, header: str, body: str, inputs: list[tuple[str, mx.array]], outputs: list[tuple[str, mx.Dtype]],
          template: list[tuple[str, object]]) -> str:  # fmt: skip
    params = []
    for input_name, array in inputs:
        params.append(f"    const {CUDA_TYPES[array.dtype]}* {input_name}")
        for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
            if array.ndim > 0 and input_name + suffix in body:
                params.append(f"    const __grid_constant__ {kind} {input_name}{suffix}")
    params += [f"    {CUDA_TYPES[dtype]}* {output_name}" for output_name, dtype in outputs]
    constants = []
    for constant, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {constant} = {str(value).lower()};")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {constant} = {value};")
        else:
            constants.append(f"  using {constant} = {CUDA_TYPES[value]};")
    signature = ",\n".join(params)
    return (
        f"{DEVICE_HEADER}\n{header}\nnamespace mlx::core::cu {{\nnamespace cg = cooperative_groups;\n"
        f"__global__ void {name}(\n{signature}) {{\n" + "\n".join(constants) + f"\n{body}\n}}\n}}\n"
    )


@contextlib.contextmanager
def recorded_kernels(monkeypatch) -> Iterator[list[RecordedKernel]]:
    """Within the block, `mx.fast.cuda_kernel` records each launch's translation unit and returns zeros."""
    recorded: list[RecordedKernel] = []

    def cuda_kernel(name, input_names, output_names, source, header="", **_):
        def launch(*, inputs, output_shapes, output_dtypes, template=(), **__):
            unit = _wrap(name, header, source, list(zip(input_names, inputs, strict=True)),
                         list(zip(output_names, output_dtypes, strict=True)), list(template))  # fmt: skip
            recorded.append(RecordedKernel(name, unit))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]

        return launch

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    yield recorded


def compile_source(kernel: RecordedKernel) -> subprocess.CompletedProcess:
    """`nvcc -arch=sm_90 -c` over the kernel's translation unit (no output kept)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / f"{kernel.name}.cu"
        path.write_text(kernel.source)
        command = [nvcc(), "-arch=sm_90", "-std=c++17", "-c", str(path), "-o", str(Path(scratch) / "k.o")]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)
