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
        ({"cost_residual_weight": 1.5}, "cost_residual_weight must be in"),
        ({"floor_slack": 0.5}, "floor_slack must be a number >= 1 or 'auto'"),
        ({"floor_slack": "wide"}, "floor_slack must be a number >= 1 or 'auto'"),
        ({"max_prefill_slowdown": 0.5}, "max_prefill_slowdown must be 0"),
        ({"debt_tolerance": 0.5}, "debt_tolerance must be >= 1"),
        ({"trace_neighbour_shapes": -1}, "trace_neighbour_shapes must be a whole number"),
        ({"slack_guard_rows": -64}, "slack_guard_rows must be a whole number"),
        ({"untrained_rows": -1}, "untrained_rows must be a whole number"),
        ({"chat_template": "{% for m in messages %}{{ m.content }}"}, "chat template: line 1: Unexpected end"),
        ({"chat_template": "/no/such/template.jinja"}, "is neither a file nor a Jinja template"),
        ({"adapter_path": "/a", "ane_lane": "ane"}, "--adapter-path cannot run with --ane-lane ane"),
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


def test_midpoint_and_slack_settings_reach_the_scheduler():
    from mlx_serve.engine_setup import scheduler_config

    for on in (False, True):
        config = scheduler_config(EngineConfig(slack_guard_rows=64 * on, price_first_runs=on, price_stand_in_runs=on,
                                               untrained_rows=512 * on),
                                  num_blocks=64, context_length=4096)  # fmt: skip
        assert (config.slack_guard_rows, config.price_first_runs, config.price_stand_in_runs) == (64 * on, on, on)
        assert config.untrained_rows == 512 * on


@pytest.mark.parametrize(
    ("floor_slack", "quantum", "checked_fill", "resolved"),
    [
        ("auto", 64, "on", 2.0),  # a checked row-tile fill: the limit bounds every step (8B 4-bit on CUDA)
        ("auto", 1, "on", 1.5),  # no row tile (bf16 models, the CPU backend): nothing to check
        ("auto", 64, "off", 1.5),  # an unchecked fill may carry a step past the limit: the narrower slack
        ("auto", 64, "untraced", 1.5),
        (1.25, 64, "on", 1.25),  # a number is taken as given
        (2, 1, "off", 2.0),
    ],
)
def test_floor_slack_auto_is_wider_only_where_the_fill_is_checked(floor_slack, quantum, checked_fill, resolved):
    from mlx_serve.engine_setup import scheduler_config

    config = scheduler_config(EngineConfig(floor_slack=floor_slack, checked_fill=checked_fill), num_blocks=64,
                              context_length=4096, quantum=quantum, kv_bucket=1024)  # fmt: skip
    assert config.floor_slack == resolved and config.debt_tolerance == 1.25
    assert (config.row_quantum, config.checked_fill) == (quantum, checked_fill)


def test_a_chat_template_file_replaces_the_checkpoints(tmp_path, tiny_qwen3):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=16, chat_template=str(template)))
    try:
        rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                        add_generation_prompt=True)  # fmt: skip
    finally:
        engine.shutdown()
    assert rendered == "[user] hi\n[assistant] "
