"""Fixtures for the HTTP layer: the tiny model's tokenizer and an app over the fake engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Served:
    """A real engine on the tiny model behind a real hypercorn server on loopback."""

    url: str
    engine: Any
    metrics: ServerMetrics
    model_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@contextmanager
def serve_model(model_path: Path, app_settings: dict[str, Any] | None = None, **engine_settings: Any) -> Iterator[Served]:
    """A real engine on `model_path` (EngineConfig `engine_settings`) behind a hypercorn server on loopback."""
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.server.http import BackgroundServer

    metrics = ServerMetrics()
    engine = Engine.load(EngineConfig(model=str(model_path), observer=metrics, **engine_settings))
    server = BackgroundServer(create_app(engine, metrics, **(app_settings or {})))
    try:
        yield Served(server.url, engine, metrics, model_path)
    finally:
        server.close()
        engine.shutdown(timeout_s=2.0)


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tiny_qwen3: Path) -> Iterator[Served]:
    """One server per test module; a module may set ENGINE_CONFIG (EngineConfig overrides)."""
    with serve_model(tiny_qwen3, **{"kv_blocks": 1024, **getattr(request.module, "ENGINE_CONFIG", {})}) as served:
        yield served
