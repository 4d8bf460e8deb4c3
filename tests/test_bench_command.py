"""`python -m mlx_serve bench`: each workload's figures, the table and JSON, and the CLI's errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_serve.cli import main
from mlx_serve.workloads import ContendedFigures, WorkloadParams, contended, offline, prefix, prompt_ids

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def engine(tiny_qwen3: Path) -> Iterator[object]:
    from mlx_serve.engine import Engine, EngineConfig
    from tracing.sink import MemorySink

    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=256, max_running=8, trace=MemorySink()))
    yield engine
    engine.shutdown()


def test_prompts_are_deterministic_ordinary_tokens_with_unique_first_tokens() -> None:
    prompts = [prompt_ids(i, 32, 2048) for i in range(50)]
    assert prompts[3] == prompt_ids(3, 32, 2048)
    assert len({p[0] for p in prompts}) == 50
    assert all(10 <= t < 2048 - 10 for p in prompts for t in p)


def test_offline_generates_every_requested_token(engine) -> None:
    figures = offline(engine, WorkloadParams(requests=3, prompt_len=24, max_tokens=5))
    assert figures.generated_tokens == 3 * 5
    assert figures.steps >= 5  # at least one step per generated token of a request
    assert figures.total_s > 0 and figures.generated_tok_per_s > 0
    assert figures.host_ms_per_step is not None and figures.host_ms_per_step > 0


def test_contended_long_prefill_runs_beside_decoding_streams(engine) -> None:
    figures = contended(engine, WorkloadParams(prompt_len=16, max_tokens=2, long_prompt=192, streams=2))
    assert isinstance(figures, ContendedFigures)
    assert figures.prefill_beside_decoding and figures.contended_prefill_rows > 0
    assert 0 < figures.gap_p50_ms <= figures.gap_p95_ms <= figures.gap_max_ms
    assert figures.long_ttft_s > 0 and figures.solo_ttft_s > 0
    assert engine.status()["requests"] == []  # the streams were cancelled once the long request finished


def test_prefix_continuation_reuses_the_cold_requests_blocks(engine) -> None:
    figures = prefix(engine, WorkloadParams(prompt_len=64, max_tokens=2))
    assert figures.cold_cached_tokens == 0
    assert figures.warm_cached_tokens == 64  # the whole shared prefix: four full blocks of 16
    assert figures.ttft_ratio == pytest.approx(figures.warm_ttft_s / figures.cold_ttft_s)


def test_cli_prints_a_table_and_json_on_the_last_line(tiny_qwen3: Path) -> None:
    argv = [sys.executable, "-m", "mlx_serve", "bench", "prefix", "--model", str(tiny_qwen3), "--json",
            "--prompt-len", "32", "--kv-blocks", "64"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "| figure | value |" in lines
    assert "| warm_cached_tokens | 32 |" in lines
    result = json.loads(lines[-1])
    assert result["workload"] == "prefix"
    assert result["params"]["prompt_len"] == 32
    assert result["figures"]["warm_cached_tokens"] == 32


def test_unknown_workload_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "no-such-workload"])
    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_missing_model_is_an_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offline", "--model", str(tmp_path / "absent")]) == 1
    assert capsys.readouterr().err.startswith("error: ")


def test_non_positive_knob_is_an_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offline", "--requests", "0"]) == 1
    assert "--requests must be at least 1" in capsys.readouterr().err
