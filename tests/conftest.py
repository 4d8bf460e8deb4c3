"""Shared fixtures: tiny dummy checkpoints of real architectures, built once per test session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

# under pytest-xdist each worker compiles MLX's CPU kernels into a temp dir of its own (MLX caches them under TMPDIR):
# two processes building one kernel's library at once could load it half-written
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["TMPDIR"] = str(Path(tempfile.gettempdir()) / f"mlx_serve_{worker}")
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    tempfile.tempdir = None  # re-read from TMPDIR

# property tests check what holds, not how fast an example runs: on a loaded 2-core box an example past Hypothesis'
# 200 ms deadline failed a run that passed on eleven reruns (session 52), so no test times its examples
settings.register_profile("mlx_serve", deadline=None)
settings.load_profile("mlx_serve")


def _build(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs) -> Path:
    from mlx_serve.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp(name) / name, **kwargs)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "qwen3", arch="qwen3", preset="tiny", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "llama", arch="llama", preset="tiny", seed=1, dtype="float32")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "qwen2", arch="qwen2", preset="tiny", seed=2, dtype="float32")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "mistral", arch="mistral", preset="tiny", seed=7, dtype="float32")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # MoE gather_mm runs only in float32 on MLX's CPU backend
    return _build(tmp_path_factory, "qwen3_moe", arch="qwen3_moe", preset="tiny", seed=3, dtype="float32")


@pytest.fixture(scope="session")
def tiny_qwen3_4bit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "qwen3_q4", arch="qwen3", preset="tiny", seed=4, dtype="float32", quantize_bits=4)


@pytest.fixture(scope="session")
def tiny_qwen3_8bit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "qwen3_q8", arch="qwen3", preset="tiny", seed=5, dtype="float32", quantize_bits=8)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_4bit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(
        tmp_path_factory, "qwen3_moe_q4", arch="qwen3_moe", preset="tiny", seed=6, dtype="float32", quantize_bits=4
    )


@pytest.fixture
def narrow_k_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the tiny models' 128/256-wide inputs split over K into 64-wide slices: exact on the CPU's kernels, not
    on CUDA's (`quantized_rows.QMM_MIN_SLICE_WIDTH`), so CPU tests only."""
    from mlx_serve import quantized_rows

    monkeypatch.setattr(quantized_rows, "SPLIT_MIN_WIDTH", 64)
    monkeypatch.setattr(quantized_rows, "QMM_MIN_SLICE_WIDTH", 64)
