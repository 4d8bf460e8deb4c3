"""Fixtures for the HTTP layer: the tiny model's tokenizer and an app over the fake engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlx_serve.server import ServerMetrics, create_app
from tests.server.fake_engine import FakeEngine


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_qwen3: Path) -> Any:
    from mlx_lm.tokenizer_utils import load

    return load(tiny_qwen3)


@pytest.fixture
def fake_engine(tiny_tokenizer: Any) -> FakeEngine:
    return FakeEngine(tiny_tokenizer)


@pytest.fixture
def fake_client(fake_engine: FakeEngine) -> Iterator[TestClient]:
    app = create_app(fake_engine, ServerMetrics())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
