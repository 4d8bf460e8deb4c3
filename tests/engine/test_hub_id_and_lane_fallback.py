"""The engine loads a 4-bit checkpoint by hub id from an offline cache, and survives a failing ANE lane."""

from __future__ import annotations

import pytest

from mlx_serve.ane.lane import LaneError
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import ModelNotFound
from mlx_serve.types import GenerationRequest
from tests.engine.reference import prompt_of, reference_tokens
from tests.engine.test_ane_lane_engine import _workload
from tests.test_model_source import build_hub_cache


def test_engine_serves_a_quantized_hub_id_from_the_offline_cache(tiny_qwen3_4bit, tmp_path, monkeypatch):
    build_hub_cache(tmp_path / "hub", "mlx-community/Tiny-Qwen3-4bit", tiny_qwen3_4bit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    engine = Engine.load(EngineConfig(model="mlx-community/Tiny-Qwen3-4bit"))
    prompt = prompt_of(20, seed=90)
    try:
        [completion] = engine.generate([GenerationRequest(prompt_ids=tuple(prompt), max_tokens=10)])
        model_id = engine.model_id
    finally:
        engine.shutdown()
    assert model_id == "mlx-community/Tiny-Qwen3-4bit"
    assert list(completion.token_ids) == reference_tokens(tiny_qwen3_4bit, prompt, 10)
    with pytest.raises(ModelNotFound, match="mlx-community/Missing"):
        Engine.load(EngineConfig(model="mlx-community/Missing"))


class _FailingChunk:
    def result(self, timeout_s=None):
        raise LaneError("injected lane failure")

    def done(self) -> bool:
        return True


def test_a_failing_ane_lane_falls_back_to_the_gpu_without_losing_requests(tiny_qwen3, monkeypatch):
    gpu_only = _run_workload(tiny_qwen3, "off")
    from mlx_serve.ane.lane import MlxCpuStandInLane

    submitted = []

    def failing_submit(self, request_id, token_ids, start, kv_in):
        submitted.append(request_id)
        return _FailingChunk()

    monkeypatch.setattr(MlxCpuStandInLane, "submit", failing_submit)
    assert _run_workload(tiny_qwen3, "cpu") == gpu_only
    assert submitted  # the lane really got chunks, and every one of them failed


def _run_workload(path, ane_lane: str):
    config = EngineConfig(model=str(path), ane_lane=ane_lane, cost_model="bucketed", row_ceiling=256)
    engine = Engine.load(config)
    try:
        return _workload(engine)
    finally:
        engine.shutdown()
