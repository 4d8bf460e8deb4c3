"""Which op fails? A pytest plugin that evaluates each module's output, pool write and custom kernel as it is made.

    python3 -m pytest -q -s -m device -p benchmarks.gpu.eval_each_module "tests/engine/test_device_families.py::...[gpt_neox]"

A step that fails on the device fails in `mx.async_eval` with the CUDA error of one node of its whole graph
("cudaGraphAddKernelNode ... invalid argument"), which names no op. With this plugin every module class of an
engine's model (its blocks, attention, norms, RoPE, linears), every KV pool write and every `mx.fast.cuda_kernel`
call evaluates its result at once, and the first to fail prints an `EVAL_EACH_MODULE` line on stderr (`-s`: else
pytest holds it) with the class and its inputs' shapes (session 41 found MLX's CUDA RoPE launch this way). Evaluations inside `mx.compile` traces
are skipped (MLX refuses them), so run with the compiled paths off where the failure hides in one. It changes timing
(a host wait after every op): a failure that needs a step in flight will not show.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import mlx.core as mx

from mlx_serve import engine, kv_pool

MARK = "EVAL_EACH_MODULE"
_wrapped: set[type] = set()


def _shapes(values: Any) -> list:
    return [getattr(v, "shape", type(v).__name__) for v in values]


def _evaluated(label: str, result: Any, inputs: Any) -> Any:
    try:
        mx.eval(result)
    except ValueError as error:
        if "function transformations" not in str(error):  # inside an mx.compile trace: nothing to evaluate yet
            report(label, inputs, error)
            raise
    except Exception as error:  # noqa: BLE001 (whatever MLX raises is reported, then raised again)
        report(label, inputs, error)
        raise
    return result


def report(label: str, inputs: Any, error: Exception) -> None:
    print(f"{MARK} {label} inputs={_shapes(inputs)}: {error}", file=sys.stderr, flush=True)


def _wrap_call(cls: type) -> None:
    if cls in _wrapped or "__call__" not in cls.__dict__:
        return
    original = cls.__call__

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        return _evaluated(cls.__qualname__, original(self, *args, **kwargs), args)

    cls.__call__ = call
    _wrapped.add(cls)


def _wrap_model(model: Any) -> None:
    for _, module in model.named_modules():
        for cls in type(module).__mro__:
            if cls.__module__.startswith(("mlx.nn", "mlx_lm", "mlx_serve")):
                _wrap_call(cls)


def _wrap_kernels() -> None:
    make = mx.fast.cuda_kernel

    @functools.wraps(make)
    def cuda_kernel(name: str, *args, **kwargs):
        kernel = make(name, *args, **kwargs)

        def launch(*call_args, **call_kwargs):
            label = f"cuda_kernel {name} grid={call_kwargs.get('grid')} threadgroup={call_kwargs.get('threadgroup')}"
            return _evaluated(label, kernel(*call_args, **call_kwargs), call_kwargs.get("inputs", ()))

        return launch

    mx.fast.cuda_kernel = cuda_kernel


def _wrap_pool_writes() -> None:
    write = kv_pool.KVPool.write

    @functools.wraps(write)
    def checked(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        write(self, layer, slots, keys, values)
        _evaluated(f"KVPool.write layer {layer}", [self.keys[layer], self.values[layer]], (slots, keys, values))

    kv_pool.KVPool.write = checked


def _wrap_engine() -> None:
    init = engine.Engine.__init__

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _wrap_model(self.runner.model)

    engine.Engine.__init__ = wrapped


def pytest_configure(config: Any) -> None:
    """Wrap before the tests are collected (kernels are made when their modules first use them); importing this
    module alone changes nothing."""
    _wrap_kernels()
    _wrap_pool_writes()
    _wrap_engine()
