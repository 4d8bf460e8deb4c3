"""Tiny models and their ANE packages, built once per session (a few seconds each)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ane_reference import build, load


@pytest.fixture(scope="session")
def qwen3_model(tiny_qwen3: Path):
    return load(tiny_qwen3)


@pytest.fixture(scope="session")
def qwen3_package(qwen3_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(qwen3_model, tmp_path_factory.mktemp("ane") / "qwen3.mlpackage")
