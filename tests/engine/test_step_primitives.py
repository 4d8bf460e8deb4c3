"""The CUDA engine's steps with prefill, built on the CPU with its kernels stood in for: what a layer's attention
hands MLX. Each primitive costs the H200's host time (~17 us a graph node, NOTES session 32), so the copies the
paged chunk attention no longer needs (the chunk's queries into `[1, H, n, D]`, the concatenation after the decode
rows) must stay gone. Nothing is evaluated: the step's graph is read from the arrays it would queue."""

from __future__ import annotations

import collections
import sys

import mlx.core as mx
import pytest

from benchmarks.gpu.profile_mixed import graph_primitives, mixed_step_runner
from mlx_serve import ragged
from mlx_serve.checkpoints.builder import checkpoint_config
from mlx_serve.checkpoints.weights import build_mlx_model
from mlx_serve.kv_pool import KVLayout

LAYERS = 3
COPIES = ("Contiguous", "Concatenate")  # kernels a layer's attention launched only to move rows around


def _kernel_caches() -> list:
    """Every cached kernel builder of `mlx_serve.kernels`: stand-ins must not outlive the test in them."""
    return [fn for name, module in sys.modules.items() if name.startswith("mlx_serve.kernels.")
            for fn in vars(module).values() if callable(fn) and hasattr(fn, "cache_clear")]  # fmt: skip


@pytest.fixture
def cuda_path(monkeypatch):
    """MLX answers as its CUDA backend would (so the engine picks its kernels), each kernel launch returns zeros
    and is kept with its inputs, and `mx.async_eval` keeps what it is given instead of running it."""
    launches, queued = [], []

    def cuda_kernel(name, input_names, output_names, source, header="", **_):
        def launch(*, inputs, output_shapes, output_dtypes, **__):
            launches.append((name, dict(zip(input_names, inputs, strict=True))))
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]

        return launch

    config = checkpoint_config("qwen3", "tiny", "bfloat16") | {"head_dim": 64, "num_hidden_layers": LAYERS}
    model = build_mlx_model(config)
    model.set_dtype(mx.bfloat16)  # the paged kernel takes bf16
    mx.eval(model.parameters())
    gpu = mx.Device(mx.gpu)
    for fn in _kernel_caches():
        fn.cache_clear()
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: gpu)
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: queued.append(arrays))
    yield model, launches, queued
    for fn in _kernel_caches():
        fn.cache_clear()


def step_graph(model, launches: list, queued: list, lanes: int, rows: int) -> tuple[collections.Counter, list]:
    """The primitives of one step of `lanes` decode lanes and a `rows`-row chunk over a 1,024-token history (the
    arrays it queues and every stood-in kernel's inputs), and the step's kernel launches."""
    args = model.args
    layout = KVLayout(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, mx.bfloat16)
    runner, plan = mixed_step_runner(model, layout, lanes, rows, 1024, "fused", repeats=2)
    launches.clear()
    queued.clear()
    runner.submit(plan(0))
    roots = [a for arrays in queued for a in arrays] + [a for _, inputs in launches for a in inputs.values()]
    return collections.Counter(graph_primitives(*roots)), list(launches)


@pytest.mark.parametrize("lanes", [4, 0])
def test_a_paged_chunk_attends_without_copies(cuda_path, monkeypatch, lanes) -> None:
    """Beside decode lanes and alone (a cached prefix's continuation): rows first, no `Contiguous` of the chunk's
    queries and no concatenation a layer; with `PAGED_ROWS_FIRST` off (the A/B's other side) one copy in a layer,
    and beside decode lanes the concatenation too."""
    model, launches, queued = cuda_path
    now, now_launches = step_graph(model, launches, queued, lanes, rows=64)
    monkeypatch.setattr(ragged, "PAGED_ROWS_FIRST", False)
    before, _ = step_graph(model, launches, queued, lanes, rows=64)
    chunk_calls = [inputs for name, inputs in now_launches if name.startswith("mlx_serve_chunk_attention")
                   and "merge" not in name]  # fmt: skip
    assert len(chunk_calls) == LAYERS and all(inputs["q"].ndim == 3 for inputs in chunk_calls)  # the QR build
    for copy in COPIES:
        assert now[copy] < LAYERS, (copy, now)  # whatever else copies, not a layer's attention
    assert before["Contiguous"] - now["Contiguous"] == LAYERS
    assert before["Concatenate"] - now["Concatenate"] == (LAYERS if lanes else 0)


def test_decode_rows_lead_the_chunk_attention_output(cuda_path) -> None:
    """A step of decode lanes and a chunk hands the decode rows' attention to the chunk's kernel (or its merge)
    as `head`, in every layer: the step's attention output is that kernel's."""
    model, launches, queued = cuda_path
    _, calls = step_graph(model, launches, queued, lanes=4, rows=64)
    led = [name for name, inputs in calls if name.startswith("mlx_serve_chunk_attention") and "head" in inputs]
    assert len(led) == LAYERS and all("_head" in name for name in led)
    heads = [inputs["head"] for name, inputs in calls if "head" in inputs]
    assert all(head.shape == (4, 4, 64) for head in heads)  # the 4 decode rows, every query head
