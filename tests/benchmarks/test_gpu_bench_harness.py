"""The H200 benchmark's harness, run on the CPU with tiny shapes: ours and mlx-lm in one call, JSON + table out.

The numbers mean nothing here; what is checked is that every figure the GPU run reports is produced and the
table is built from them, so a device call is never spent finding a broken harness.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu.api_calls import cupti_dirs
from mlx_serve.config import AUTO_STEP_FLOOR_MS


def run_bench(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "benchmarks.gpu.run_gpu_bench", "--device", "cpu", "--dtype", "float32",
            "--quick", "--out", str(out), *args]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


def test_full_run_writes_every_figure_and_the_table(tmp_path):
    done = run_bench(tmp_path, "--shapes", "tiny", "--unfused-streams", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "gpu_bench.json").read_text())["results"]
    assert "error" not in result
    for side in ("peer", "ours"):
        assert set(result[side]["decode"]) == {str(n) for n in result["stream_counts"]}
        contended = result[side]["contended"]
        assert contended["gap_ratio"] > 0
        # the window's longest gap is the longer of the two phases' longest
        phases = max(contended["gap_max_before_ms"], contended["gap_max_from_arrival_ms"])
        assert phases == pytest.approx(contended["gap_max_ms"])
    assert result["ours"]["shared_prefix"]["warm_cached_tokens"] > 0
    warm_steps = result["ours"]["shared_prefix"]["warm_steps"]
    assert warm_steps, "the warm request's steps are recorded"
    assert all(isinstance(step["compiled"], bool) for step in warm_steps)  # eager steps pay their build
    again = result["ours"]["shared_prefix"]
    assert again["again_cached_tokens"] > 0 and again["again_steps"] and again["again_ratio"] > 0
    assert "1" in result["ours"]["decode_unfused"]
    table = (tmp_path / "gpu_bench.md").read_text()
    for row in ("decode tok/s, 1 stream vs generate_step", "prefill tok/s", "contended: max gap / median gap",
                "contended: max gap before / from the long prompt's arrival",
                "shared prefix: warm TTFT / cold TTFT", "fused forward off (lever off)"):  # fmt: skip
        assert row in table, row


def test_contended_only_run_and_its_refusal(tmp_path):
    refused = run_bench(tmp_path, "--shapes", "tiny", "--contended-only")
    assert refused.returncode == 2 and "--contended-only needs --step-target-ms" in refused.stderr
    # with the fused forward for steps with prefill, the engine's own step target (a factor of its decode step)
    # and an explicit row tile
    # MLX's own tuning variables travel in the recorded command (the cache's location does not)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    env.update(MLX_MAX_OPS_PER_BUFFER="400", MLX_PTX_CACHE_DIR=str(tmp_path / "ptx"), API_CALLS="1")
    done = run_bench(tmp_path, "--shapes", "tiny", "--contended-only", "--step-target-ms", "auto", "--compile-decode",
                     "on", "--fuse-decode", "on", "--fuse-mixed", "on", "--row-quantum", "16", "--keep-traces-at", "1024,16384",
                     env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert written["mlx_settings"] == {"MLX_MAX_OPS_PER_BUFFER": "400"}
    assert written["command"].startswith("MLX_MAX_OPS_PER_BUFFER=400 python -m benchmarks.gpu.run_gpu_bench ")
    assert " --contended-only " in written["command"] and " --keep-traces-at 1024,16384 " in written["command"]
    (result,) = written["results"]
    assert result["peer"] == {} and "decode" not in result["ours"]
    assert result["step_target_ms"] >= AUTO_STEP_FLOOR_MS  # learned by the end of the run, never under the floor
    assert result["ours"]["step_target_ms"] == result["step_target_ms"]
    assert result["ours"]["row_quantum"] == 16  # as the engine resolved it
    steps = result["ours"]["contended"]["steps"]
    assert "submission" in steps["mixed_host_ms_p50"]
    # [rows, decode lanes, history, ms, predicted ms, prefill lanes, auxiliary, compiled, why auxiliary]
    recorded = steps["prefill_steps"]
    assert recorded and all(len(step) == 9 and step[0] > 0 and step[5] >= 1 for step in recorded)
    assert not any(step[6] or step[7] or step[8] for step in recorded)  # on the CPU no compiled mixed shape is traced
    # each step's planned budget and why: at least its rows (a cut may make it fewer), a contended reason
    budgets = steps["prefill_budgets"]
    assert len(budgets) == len(recorded)
    assert all(budget[0] >= step[0] for budget, step in zip(budgets, recorded, strict=True) if step[1])
    assert all(budget[1].startswith(("contended", "halved")) for budget, step in zip(budgets, recorded) if step[1])
    assert all(budget[2] > 0 for budget, step in zip(budgets, recorded) if step[1])  # a contended step's limit
    assert isinstance(steps["decode_debt_steps"], int)
    # the engine thread during the longest gap: what ran between the two tokens
    longest = result["ours"]["contended"]["longest_gap"]
    assert longest["ms"] == pytest.approx(result["ours"]["contended"]["gap_max_ms"], abs=1.0)  # the same gap
    assert longest["spans"] and all(span[3] >= 0 and span[2] <= longest["ms"] for span in longest["spans"])
    # Python's collections: per generation in the pass, and any inside the longest gap
    collections = result["ours"]["contended"]["gc"]
    assert all(c["count"] >= 1 and c["max_ms"] <= c["total_ms"] for c in collections.values())
    assert all(p[0] in (0, 1, 2) and p[1] <= p[2] for p in longest["gc"])
    # compiled decode shapes traced in the pass (the warm passes met them) and inside the longest gap
    assert result["ours"]["contended"]["decode_traces"] == len(longest["decode_traces"]) == 0
    assert result["ours"]["contended"]["peak_above_start_mb"] > 0 and result["ours"]["contended"]["pool_layer_mb"] > 0
    # MLX's buffer cache at the pass's end, within the engine's cache limit (MLX's CPU backend keeps 32 MiB at most)
    # and its memory limit, where the allocator's behaviour turns
    contended = result["ours"]["contended"]
    assert 0 < contended["cache_limit_mb"] < contended["memory_limit_mb"]
    assert 0 <= contended["cache_end_mb"] <= contended["cache_limit_mb"] + 1
    assert len(result["ours"]["settled_traces"]) == 2  # two warm passes by default, each settled
    # each warm pass's headline figures; the last one's are its full record's
    first, last = result["ours"]["warm_passes"]
    warm = result["ours"]["contended_warm"]
    assert last == {"long_ttft_s": warm["long_ttft_s"], "gap_ratio": warm["gap_ratio"],
                    "gap_max_ms": warm["gap_max_ms"], **{k: warm["steps"][k] for k in
                    ("mixed_steps", "mixed_rows_p50", "mixed_ms_p50")}}  # fmt: skip
    assert first["long_ttft_s"] > 0 and first["mixed_steps"] > 0 and first["gap_ratio"] >= 1
    assert result["ours"]["kept_traces_at"] == [1024, 16384] and result["ours"]["untraced"] == 0  # none on the CPU
    if cupti_dirs():  # API_CALLS=1: the shim built and loaded; without a driver CUPTI refuses and times nothing
        assert steps["api_calls_status"]["cupti_result"] != 0 and steps["api_calls_status"]["dropped"] == 0
        *per_call, submissions, slowest = steps["submission_api_calls"]
        assert per_call == [] and slowest == {"slowest_in_submit": []}  # no call timed
        assert submissions["range"] == "submit" and submissions["spans"] == steps["mixed_steps"]
        assert longest["api_calls"] == []
    # what the live cost model was shown, every pass: the measured pass's contended steps with prefill among them
    shown, scored_from = result["ours"]["cost_observations"], result["ours"]["contended"]["cost_observations_from"]
    contended_steps = [step for step in recorded if step[1] and not step[6]]
    assert 0 < scored_from < len(shown) and len(shown) - scored_from == len(contended_steps)
    assert [sum(rows for rows, _ in chunks) for chunks, *_ in shown[scored_from:]] == [s[0] for s in contended_steps]
    # the decode-only steps the cost model never sees, each placed after the cost observations before it
    decoded = result["ours"]["decode_observations"]
    assert decoded and all(0 <= at <= len(shown) and lanes > 0 and ms > 0 for at, lanes, _, ms in decoded)
    assert [at for at, *_ in decoded] == sorted(at for at, *_ in decoded)
    measured = [entry for entry in decoded if entry[0] >= scored_from]
    assert len(measured) >= result["ours"]["contended"]["steps"]["decode_only_steps"]
    table = (tmp_path / "gpu_bench.md").read_text()
    assert "TTFT / its solo TTFT" in table and "mlx-lm |" in table
    assert "host ms of a step with prefill" in table


@pytest.mark.parametrize(
    ("shape", "flags", "lever", "label"),
    [
        ("tiny-moe", ["--dense-experts", "on", "--gathered-experts-streams", "4"], "decode_gathered_experts",
         "dense experts off"),
        ("tiny-4bit", ["--dequantize-rows", "2", "--quantized-streams", "4"], "decode_quantized_matmul",
         "dequantized rows off"),
        ("tiny-4bit", ["--split-quantized-k", "on", "--unsplit-streams", "4"], "decode_unsplit", "split over K off"),
        ("tiny-4bit", ["--split-all-streams", "4", "--compile-decode", "on", "--fuse-decode", "on", "--fuse-mixed", "on"],
         "decode_split_all", "fused projections split too"),
    ],
)  # fmt: skip
def test_decode_only_run_with_a_lever(tmp_path, shape, flags, lever, label):
    done = run_bench(tmp_path, "--shapes", shape, "--decode-only", "--streams", "1,4", "--decode-rounds", "1", *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "gpu_bench.json").read_text())["results"]
    assert set(result["ours"]["decode"]) == {"1", "4"} and "4" in result["ours"][lever]
    assert f"{label} (lever off)" in (tmp_path / "gpu_bench.md").read_text()


def test_bandwidth_limit_counts_only_the_experts_a_step_reads():
    from benchmarks.gpu.report import step_bytes

    dense = {"weight_bytes": 16e9}
    assert step_bytes(dense, 8) == 16e9
    moe = {"weight_bytes": 61e9, "expert_bytes": 58e9, "experts": 128, "experts_per_token": 8}
    assert step_bytes(moe, 1) == pytest.approx(3e9 + 58e9 / 16)  # one row reads 8 of 128 experts
    assert step_bytes(moe, 8) < step_bytes(moe, 64) < 61e9
    assert step_bytes(moe, 1000) == pytest.approx(61e9)


def test_mlx_lm_side_runs_on_modules_our_engine_never_changes(narrow_k_splits):
    """Our engine folds rows, fuses and re-lays the model's projections in place; mlx-lm's side of the comparison
    runs on `peer_model`, which keeps mlx-lm's classes and arrays (and so its speed and numbers)."""
    import mlx.core as mx
    import mlx.nn as nn

    from benchmarks.gpu.models import build_dummy_model
    from mlx_serve import quantized_rows
    from mlx_serve.engine import Engine, EngineConfig

    dummy = build_dummy_model("tiny-4bit", "float32")
    tokens = mx.array([[1, 5, 9, 2]])
    before = dummy.peer_model(tokens)
    mx.eval(before)
    config = EngineConfig(model="tiny", kv_blocks=64, compile_decode="on", fuse_decode="on", split_quantized_k="on")
    Engine.from_model(dummy.model, dummy.tokenizer, dummy.config, config).shutdown()
    ours, theirs = dummy.model.model.layers[0], dummy.peer_model.model.layers[0]
    assert type(ours.mlp.down_proj) is quantized_rows.RowsQuantizedLinear and ours.mlp.down_proj.k_splits > 1
    assert type(theirs.mlp.down_proj) is nn.QuantizedLinear and theirs.mlp.down_proj.weight.ndim == 2
    assert theirs.self_attn.q_proj is not ours.self_attn.q_proj
    assert mx.array_equal(dummy.peer_model(tokens), before).item()


def test_a_request_the_engine_fails_stops_the_measurement_with_a_clear_error(monkeypatch):
    """A step that fails (as the 8B 4-bit layout did on the device) ends the shape's run with the engine's failure,
    not an IndexError on a first token that never came."""
    from benchmarks.gpu.models import build_dummy_model
    from benchmarks.gpu.ours import OurSide
    from benchmarks.gpu.workloads import Prompts

    dummy = build_dummy_model("tiny", "float32")
    side = OurSide(dummy, kv_blocks=64, step_target_ms=100.0, attention="auto")
    try:
        def broken(*args, **kwargs):
            raise ValueError("a step that cannot run")

        monkeypatch.setattr(side.engine.runner, "submit", broken)
        with pytest.raises(RuntimeError, match="1 of 1 requests failed in the engine"):
            side.prefill(Prompts(dummy.config["vocab_size"], seed=0), 32)
    finally:
        side.close()


def test_mlx_lm_decode_out_of_memory_is_retried_at_the_servers_prompt_concurrency(monkeypatch):
    """A 64-stream prefill beside our 30B-A3B engine ran out of memory; the retry prefills 8 prompts at a time and
    says so in the result. Any other error is not swallowed."""
    from benchmarks.gpu import run_gpu_bench

    calls = []

    def decode(model, prompts, p, streams, prefill_batch=None):
        calls.append(prefill_batch)
        if prefill_batch is None:
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return {"tok_s": 1.0}

    monkeypatch.setattr(run_gpu_bench.peer, "decode", decode)
    assert run_gpu_bench._peer_decode(None, None, None, 64) == {"tok_s": 1.0, "prefill_batch": 8}
    assert calls == [None, 8]

    def broken(model, prompts, p, streams, prefill_batch=None):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(run_gpu_bench.peer, "decode", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_gpu_bench._peer_decode(None, None, None, 64)


def test_paged_head_rows_are_two_whole_numbers_and_paste_back():
    """`--paged-head-rows SHORT,LONG` sets the paged chunk-attention kernel's two limits for an A/B; the recorded
    command gives them back as typed."""
    from benchmarks.gpu import run_gpu_bench

    assert run_gpu_bench._head_rows("8192,24576") == [8192, 24576]
    for bad in ("2048", "1,2,3", "-1,5", "a,b"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            run_gpu_bench._head_rows(bad)
    assert run_gpu_bench._argument("paged_head_rows", [8192, 24576]) == "--paged-head-rows 8192,24576"


def test_the_residual_weight_is_checked_as_serve_checks_it(capsys):
    """`--cost-residual-weight` takes serve's weight in [0, 1], default 0.3; out of range it stops at parsing."""
    from benchmarks.gpu import run_gpu_bench

    assert run_gpu_bench.parse_args([]).cost_residual_weight == 0.3
    assert run_gpu_bench.parse_args(["--cost-residual-weight", "0"]).cost_residual_weight == 0.0
    for bad in ("1.5", "-0.1", "nan", "some"):
        with pytest.raises(SystemExit):
            run_gpu_bench.parse_args(["--cost-residual-weight", bad])
        assert "--cost-residual-weight" in capsys.readouterr().err
