"""`benchmarks/gpu/bench_two_streams.py` on the CPU backend: a chunk on a second MLX stream leaves the decoding
streams' tokens and the prompt's hidden state exactly as they are alone, and every mode reports its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result() -> dict:
    from benchmarks.gpu.bench_two_streams import measure, workload
    from benchmarks.gpu.models import build_dummy_model

    dummy = build_dummy_model("tiny")
    work = workload(dummy.model, dummy.config["vocab_size"], streams=2, history=24, prompt=96, chunk=32)
    return measure(dummy.model, work, everies=(1, 2))


@pytest.mark.parametrize("mode", ["serial_every_1", "concurrent_every_1", "serial_every_2", "concurrent_every_2"])
def test_a_chunk_beside_the_decode_steps_changes_no_token(result: dict, mode: str) -> None:
    figures = result[mode]
    assert figures["tokens_match_alone"] is True
    assert figures["prompt_matches_solo"] is True
    assert figures["prompt_ms"] > 0 and figures["prompt_vs_solo"] > 0
    assert figures["chunk_submit_p50_ms"] > 0 and figures["gap_max_from_arrival_ms"] > 0


def test_the_calm_runs_report_no_chunk(result: dict) -> None:
    assert result["decode"]["chunk_submit_p50_ms"] is None
    assert result["decode"]["gap_max_from_arrival_ms"] is None
    assert result["prefill"]["prompt_ms"] > 0


def test_the_command_line_prints_one_json_object() -> None:
    command = [sys.executable, "-m", "benchmarks.gpu.bench_two_streams", "--shape", "tiny", "--streams", "2",
               "--history", "16", "--prompt", "64", "--chunk", "32", "--every", "1"]  # fmt: skip
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True, timeout=300).stdout
    parsed = json.loads(out)
    assert parsed["chunk"] == 32 and "concurrent_every_1" in parsed
