"""Settings that need no model are refused before one is loaded: a path that does not exist still gets the
setting's error, not the loader's (a real checkpoint can take minutes to load before a late check)."""

from __future__ import annotations

import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import InvalidRequest, ModelNotFound

MISSING = "/nonexistent/model-dir"


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"row_floor": 512, "row_ceiling": 64}, "row_floor <= row_ceiling"),
        ({"compile_mixed": "yes"}, "compile_mixed must be auto, on or off"),
        ({"split_quantized_k": "some"}, "split_quantized_k must be auto, on, off or all"),
        ({"chunk_attention": "flash"}, "chunk_attention must be auto, sdpa, matmul or paged"),
        ({"dequantize_rows": -1}, "dequantize_rows must be a whole number"),
        ({"row_quantum": 0}, "row_quantum must be a whole number"),
        ({"step_target_ms": "auto", "step_target_factor": -2}, "step_target_factor must be a number > 0"),
        ({"step_target_floor_ms": -1.0}, "step_target_floor_ms must be a number >= 0"),
        ({"plan_headroom": 1.5}, "plan_headroom must be in"),
        ({"cost_model": "oracle"}, "cost_model must be one of"),
        ({"cost_trust_factor": 0.5}, "cost_trust_factor must be 0"),
        ({"floor_slack": 0.5}, "floor_slack must be >= 1"),
        ({"max_prefill_slowdown": 0.5}, "max_prefill_slowdown must be 0"),
        ({"trace_neighbour_shapes": -1}, "trace_neighbour_shapes must be a whole number"),
    ],
)
def test_bad_settings_fail_before_the_model_loads(setting, message):
    with pytest.raises(InvalidRequest, match=message):
        Engine.load(EngineConfig(model=MISSING, **setting))


def test_good_settings_reach_the_loader():
    with pytest.raises(ModelNotFound, match="not found"):
        Engine.load(EngineConfig(model=MISSING, row_floor=64, row_ceiling=512, compile_mixed="off",
                                 step_target_ms="auto", step_target_floor_ms=0.0))  # fmt: skip


def test_checked_fill_reaches_the_scheduler():
    from mlx_serve.engine_setup import scheduler_config

    for mode in ("off", "untraced", "on"):
        config = scheduler_config(EngineConfig(checked_fill=mode), num_blocks=64, context_length=4096, kv_bucket=1024)
        assert config.checked_fill == mode
    with pytest.raises(InvalidRequest, match="checked_fill"):
        Engine.load(EngineConfig(checked_fill="always"))
