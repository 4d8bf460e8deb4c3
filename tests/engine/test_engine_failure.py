"""A bug that escapes the engine loop (outside any step, whose failures only fail that step's requests) must not
leave a stream hanging: every open and queued request finishes with an error, later submissions are refused with
the reason, and /health says 503."""

from __future__ import annotations

import threading

import pytest
from starlette.testclient import TestClient

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.errors import EngineStopped
from mlx_serve.server import ServerMetrics, create_app
from mlx_serve.types import GenerationRequest
from tests.engine.reference import prompt_of


def test_a_failed_loop_finishes_every_request_with_its_reason(tiny_qwen3):
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=64))
    try:
        def broken(*args):
            raise RuntimeError("a bug in publishing")

        engine.delivery.publish = broken  # every token, pipelined or not, passes here on the engine thread
        handles = [engine.submit(GenerationRequest(prompt_ids=tuple(prompt_of(12, seed=s)), max_tokens=20))
                   for s in range(3)]  # fmt: skip
        finals = [list(h)[-1] for h in handles]  # each ends, none hangs
        assert all(e.finish_reason == "error" and "a bug in publishing" in e.error for e in finals)
        with pytest.raises(EngineStopped, match="a bug in publishing"):
            engine.submit(GenerationRequest(prompt_ids=(1, 2, 3)))
        with TestClient(create_app(engine, ServerMetrics())) as client:
            reply = client.get("/health")
        assert reply.status_code == 503 and "a bug in publishing" in reply.json()["error"]
    finally:
        engine.shutdown(timeout_s=1.0)


def test_a_loop_that_fails_while_admitting_fails_the_requests_it_had_taken(tiny_qwen3):
    """The loop takes every queued submission at once: one that breaks admission must not strand the others taken
    with it (they were out of the queue and not yet open, and hung)."""
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), kv_blocks=64))
    try:
        accept = engine._accept

        def broken(sub):
            if sub.request.max_tokens == 7:
                raise RuntimeError("a bug in admission")
            accept(sub)

        engine._accept = broken
        requests = [GenerationRequest(prompt_ids=tuple(prompt_of(12, seed=s)), max_tokens=n)
                    for s, n in enumerate((20, 7, 20))]  # fmt: skip
        handles = engine.submit_all(requests)  # one batch: taken by one admission
        finals: list = []
        reader = threading.Thread(target=lambda: finals.extend(list(h)[-1] for h in handles), daemon=True)
        reader.start()
        reader.join(60)
        assert len(finals) == 3, "a request taken with the broken one hangs"
        assert all(e.finish_reason == "error" and "a bug in admission" in e.error for e in finals)
    finally:
        engine.shutdown(timeout_s=1.0)
