"""The real ANE lane: the built package run by Core ML with compute units CPU_AND_NE (macOS only).

Importing this module is safe anywhere; constructing `CoreMLLane` off macOS raises `LaneError` with the
reason. Host work (embedding, RoPE tables, padding the past KV) happens on the engine thread in MLX/NumPy;
only `predict` runs on a single worker thread, so the GPU keeps decoding while the Neural Engine works.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_serve.ane import host
from mlx_serve.ane.builder import package_geometries
from mlx_serve.ane.lane import ChunkResult, Clock, LaneError, LayerKV
from mlx_serve.ane.pieces import run_pieces


class _PredictingChunk:
    def __init__(self, future: Future, request_id: str, start: int, submitted: float, clock: Clock) -> None:
        self._future = future
        self._clock = clock
        self._request_id = request_id
        self._start = start
        self._submitted = submitted

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout_s: float | None = None) -> ChunkResult:
        try:
            arrays = self._future.result(timeout=timeout_s)
        except FutureTimeout as exc:
            raise LaneError(f"ANE chunk of {self._request_id} timed out after {timeout_s}s") from exc
        except Exception as exc:  # noqa: BLE001 - any Core ML failure means: fall back to the GPU
            raise LaneError(f"ANE chunk of {self._request_id} failed: {exc}") from exc
        layers = tuple(LayerKV(mx.array(k), mx.array(v)) for k, v in zip(arrays.keys, arrays.values))
        finished = self._clock()
        hidden = mx.array(arrays.hidden)
        return ChunkResult(
            self._request_id, self._start, hidden, layers, CoreMLLane.label, self._submitted, finished
        )


class CoreMLLane:
    label = "coreml-ane"

    def __init__(
        self, model, package: Path | str, compute_units: str = "CPU_AND_NE", clock: Clock = time.perf_counter
    ) -> None:
        if sys.platform != "darwin":
            raise LaneError(
                f"the Core ML lane runs only on macOS (this is {sys.platform}); use --ane-lane cpu"
            )
        if package is None:
            raise LaneError("the Core ML lane needs a package: python -m mlx_serve ane build --model DIR")
        import coremltools as ct

        self.model = model
        self.clock = clock
        self.geometries = package_geometries(Path(package))
        self.max_context = next(iter(self.geometries.values())).max_context
        units = getattr(ct.ComputeUnit, compute_units)
        self._models = {
            rows: ct.models.MLModel(str(package), compute_units=units, function_name=geo.function_name)
            for rows, geo in self.geometries.items()
        }
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ane-lane")

    def accepts(self, start: int, rows: int) -> bool:
        largest = max(self.geometries)
        # pieces after the first see the earlier pieces as past: all of it must fit max_context
        return rows > 0 and start + max(rows - largest, 0) <= self.max_context

    def submit(
        self, request_id: str, token_ids: Sequence[int], start: int, kv_in: Sequence[LayerKV]
    ) -> _PredictingChunk:
        if not self.accepts(start, len(token_ids)):
            raise LaneError(f"chunk at {start} of {len(token_ids)} rows exceeds the package's context")
        submitted = self.clock()
        # MLX work (embedding, RoPE tables, reading the past KV) stays on this, the engine's, thread
        embeddings = np.array(host.embed(self.model, token_ids).astype(mx.float32))
        tables = host.rope_tables(self.model, start, len(token_ids) + max(self.geometries))
        past_keys, past_values = _past_arrays(kv_in, start, next(iter(self.geometries.values())))
        future = self._worker.submit(
            run_pieces, self.geometries, self._predict, embeddings, start, past_keys, past_values, tables
        )
        return _PredictingChunk(future, request_id, start, submitted, self.clock)

    def run_chunk(
        self, request_id: str, token_ids: Sequence[int], start: int, kv_in: Sequence[LayerKV]
    ) -> ChunkResult:
        return self.submit(request_id, token_ids, start, kv_in).result()

    def logits(self, hidden: mx.array) -> mx.array:
        return host.lm_head(self.model, hidden.astype(self.model.model.norm.weight.dtype))

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def _predict(self, rows: int, inputs):
        return self._models[rows].predict(dict(inputs))


def _past_arrays(kv_in: Sequence[LayerKV], start: int, geometry) -> tuple[list, list]:
    """fp16 NumPy copies of the past K/V; empty (1, KVH, 0, D) arrays for a first chunk with no kv_in."""
    if start == 0 and not kv_in:
        empty = np.zeros((1, geometry.num_kv_heads, 0, geometry.head_dim), np.float16)
        return [empty] * geometry.num_layers, [empty] * geometry.num_layers
    keys = [np.array(kv.keys[:, :, :start].astype(mx.float16)) for kv in kv_in]
    values = [np.array(kv.values[:, :, :start].astype(mx.float16)) for kv in kv_in]
    return keys, values
