"""`benchmarks/gpu/eval_each_module.py`: the plugin names the module whose output fails to evaluate, and changes no
token where nothing fails (run in a child pytest, as the plugin wraps classes for its whole process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD_TEST = """
import mlx.core as mx
from mlx_lm.models import qwen3

from mlx_serve.checkpoints import make_checkpoint
from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.types import GenerationRequest
from tests.engine.reference import reference_tokens

FAIL = {fail}


def test_child(tmp_path):
    path = make_checkpoint(tmp_path / "qwen3", arch="qwen3", seed=3)
    if FAIL:  # an MLP output that fails only when evaluated (a singular inverse on the CPU)
        plain = qwen3.MLP.__call__
        qwen3.MLP.__call__ = lambda self, x: plain(self, x) + 0 * mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu).sum()
    engine = Engine.load(EngineConfig(model=str(path), kv_blocks=64, block_size=16))
    try:
        [done] = engine.generate([GenerationRequest(prompt_ids=tuple(range(10, 30)), max_tokens=6)])
    finally:
        engine.shutdown()
    if not FAIL:
        assert list(done.token_ids) == reference_tokens(path, list(range(10, 30)), 6)
"""


def _child(tmp_path: Path, fail: bool) -> subprocess.CompletedProcess:
    test = tmp_path / "test_child.py"
    test.write_text(textwrap.dedent(CHILD_TEST.format(fail=fail)))
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "benchmarks.gpu.eval_each_module",
               str(test), "--rootdir", str(tmp_path)]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip


def test_the_first_output_that_fails_is_named(tmp_path):
    run = _child(tmp_path, fail=True)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("EVAL_EACH_MODULE")]
    assert lines, run.stdout[-2000:] + run.stderr[-2000:]
    assert lines[0].startswith("EVAL_EACH_MODULE MLP inputs=[(20, 1, ") and "LU factorization failed" in lines[0]


def test_where_nothing_fails_the_tokens_are_mlx_lms(tmp_path):
    run = _child(tmp_path, fail=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "EVAL_EACH_MODULE" not in run.stdout + run.stderr
