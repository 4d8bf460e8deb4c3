"""`step_target_ms="auto"` through the engine: the scheduler's target follows the measured decode steps."""

from __future__ import annotations

import pytest

from mlx_serve import engine_setup
from mlx_serve.config import AUTO_STEP_FLOOR_MS
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest
from mlx_serve.types import GenerationRequest
from tests.engine.reference import prompt_of


def test_auto_learns_the_decode_step_and_keeps_the_floor(tiny_qwen3):
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), step_target_ms="auto", warm_up=False))
    try:
        target = engine.scheduler.step_target
        assert target.ms == 500.0  # nothing measured yet
        engine.generate([GenerationRequest(prompt_ids=tuple(prompt_of(12, seed=1)), max_tokens=12)])
        assert target.decode_step_ms is not None and target.decode_step_ms > 0
        assert target.ms == max(AUTO_STEP_FLOOR_MS, engine_setup.AUTO_STEP_FACTOR * target.decode_step_ms)
        assert engine.status()["step_target_ms"] == round(target.ms, 2)  # what /v1/status shows
    finally:
        engine.shutdown()


def test_the_auto_factor_is_configurable(tiny_qwen3):
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), step_target_ms="auto", step_target_factor=4.5,
                                      warm_up=False))  # fmt: skip
    try:
        engine.generate([GenerationRequest(prompt_ids=tuple(prompt_of(12, seed=2)), max_tokens=8)])
        target = engine.scheduler.step_target
        assert target.factor == 4.5 and target.ms == max(AUTO_STEP_FLOOR_MS, 4.5 * target.decode_step_ms)
    finally:
        engine.shutdown()
    with pytest.raises(InvalidRequest, match="step_target_factor must be a number > 0"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), step_target_ms="auto", step_target_factor=0, warm_up=False))


def test_the_auto_floor_is_configurable(tiny_qwen3):
    """A floor far above the CPU's decode step holds the target at the floor; floor 0 leaves factor x step."""
    for floor in (250.0, 0.0):
        engine = Engine.load(EngineConfig(model=str(tiny_qwen3), step_target_ms="auto", step_target_factor=2.0,
                                          step_target_floor_ms=floor, warm_up=False))  # fmt: skip
        try:
            engine.generate([GenerationRequest(prompt_ids=tuple(prompt_of(12, seed=3)), max_tokens=8)])
            target = engine.scheduler.step_target
            assert target.floor_ms == floor and target.decode_step_ms is not None
            assert target.ms == (250.0 if floor else 2.0 * target.decode_step_ms)
        finally:
            engine.shutdown()
    for bad in (-1.0, "low", True):
        with pytest.raises(InvalidRequest, match="step_target_floor_ms must be a number >= 0"):
            Engine.load(EngineConfig(model=str(tiny_qwen3), step_target_ms="auto", step_target_floor_ms=bad,
                                     warm_up=False))  # fmt: skip


@pytest.mark.parametrize("value", ["fast", 0, -1.0, True])
def test_a_bad_step_target_is_a_clear_error(tiny_qwen3, value):
    with pytest.raises(InvalidRequest, match="step_target_ms must be a number of milliseconds > 0 or 'auto'"):
        Engine.load(EngineConfig(model=str(tiny_qwen3), step_target_ms=value, warm_up=False))
