"""Bad requests get their API's error status and body and leave the server serving; a full queue answers 429;
a client that disconnects mid-stream frees its request (seen in /v1/status and /metrics)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# small limits so the queue can be filled: 2 running + 1 waiting
ENGINE_CONFIG = {"max_running": 2, "queue_limit": 1, "kv_blocks": 512}

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


def _chat(**fields) -> dict:
    return {"model": "qwen3", "messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields}


BAD_OPENAI = [
    pytest.param(CHAT, b"{not json", 400, None, id="malformed-json"),
    pytest.param(CHAT, b"[1, 2]", 400, None, id="not-an-object"),
    pytest.param(CHAT, _chat(max_tokens="ten"), 400, "max_tokens", id="max_tokens-wrong-type"),
    pytest.param(CHAT, _chat(messages="hello"), 400, "messages", id="messages-wrong-type"),
    pytest.param(CHAT, _chat(temperature="hot"), 400, "temperature", id="temperature-wrong-type"),
    pytest.param(CHAT, _chat(stream="yes"), 400, "stream", id="stream-wrong-type"),
    pytest.param(CHAT, _chat(temperature=-1), 400, "temperature", id="negative-temperature"),
    pytest.param(CHAT, _chat(top_p=1.5), 400, "top_p", id="top_p-out-of-range"),
    pytest.param(CHAT, _chat(top_k=-3), 400, "top_k", id="negative-top_k"),
    pytest.param(CHAT, _chat(logit_bias={"999999": 5}), 400, "logit_bias", id="logit_bias-outside-vocab"),
    pytest.param(CHAT, _chat(n=0), 400, "n", id="n-zero"),
    pytest.param(CHAT, _chat(top_logprobs=3), 400, "top_logprobs", id="top_logprobs-without-logprobs"),
    pytest.param(CHAT, _chat(max_tokens=0), 400, "max_tokens", id="max_tokens-zero"),
    pytest.param(CHAT, _chat(stop=[""]), 400, "stop", id="empty-stop-string"),
    pytest.param(CHAT, _chat(model="no-such-model"), 404, "model", id="unknown-model"),
    pytest.param(CHAT, _chat(max_tokens=5000), 400, "max_tokens", id="max_tokens-past-context"),
    pytest.param("/v1/completions", {"model": "qwen3", "prompt": [5] * 5000, "max_tokens": 2}, 400, "prompt",
                 id="prompt-longer-than-context"),
    pytest.param("/v1/completions", {"model": "qwen3", "prompt": {"a": 1}}, 400, "prompt", id="prompt-wrong-type"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_OPENAI)
def test_bad_openai_input_gets_an_openai_error_and_the_server_carries_on(http, path, body, status, param):
    response = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    assert http.post(CHAT, json=_chat()).status_code == 200


def test_context_errors_carry_a_code(http):
    error = http.post("/v1/completions", json={"prompt": [5] * 5000}).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert http.post(CHAT, json=_chat(model="nope")).json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("body", "status", "kind"), [
    pytest.param(b"{oops", 400, "invalid_request_error", id="malformed-json"),
    pytest.param({"model": "qwen3", "messages": MESSAGES}, 400, "invalid_request_error", id="no-max_tokens"),
    pytest.param({"model": "qwen3", "messages": MESSAGES, "max_tokens": 4, "temperature": "x"}, 400,
                 "invalid_request_error", id="wrong-type"),
    pytest.param({"model": "other", "messages": MESSAGES, "max_tokens": 4}, 404, "not_found_error", id="model"),
])
def test_bad_anthropic_input_gets_an_anthropic_error(http, body, status, kind):
    response = http.post("/v1/messages", content=body) if isinstance(body, bytes) else \
        http.post("/v1/messages", json=body)
    assert response.status_code == status
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == kind


def test_unknown_route_gets_a_json_error(http):
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["message"] == "Invalid URL (GET /v1/nothing-here)"
    assert error["type"] == "invalid_request_error" and error["code"] is None  # not a model that was not found


def test_a_refused_request_is_logged_once(http, caplog):
    with caplog.at_level(logging.WARNING, logger="mlx_serve.server"):
        http.post(CHAT, json=_chat(temperature=-5))
    records = [r for r in caplog.records if "temperature" in r.getMessage()]
    assert len(records) == 1


def _wait_until(predicate, timeout_s: float = 30.0) -> bool:
    """Poll the server's own reports until they show the expected state."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _open_stream(http: httpx.Client, max_tokens: int = 3000) -> httpx.Response:
    request = http.build_request("POST", CHAT, json=_chat(max_tokens=max_tokens, stream=True, ignore_eos=True))
    response = http.send(request, stream=True)
    assert response.status_code == 200
    return response


def test_full_queue_answers_429_and_recovers(http, served):
    streams = [_open_stream(http) for _ in range(3)]  # 2 running + 1 waiting = the limit
    try:
        refused = http.post(CHAT, json=_chat())
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "rate_limit_error"
        anthropic = http.post("/v1/messages", json={"model": "qwen3", "messages": MESSAGES, "max_tokens": 2})
        assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == "rate_limit_error"
    finally:
        for stream in streams:
            stream.close()
    assert _wait_until(lambda: http.get("/v1/status").json()["requests"] == [])
    assert http.post(CHAT, json=_chat()).status_code == 200


def _metric(http: httpx.Client, name: str, labels: dict | None = None) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and (labels is None or all(sample.labels.get(k) == v for k, v in labels.items())):
                return sample.value
    return 0.0


def test_disconnect_mid_stream_cancels_and_frees_kv(http, served):
    cancelled_before = _metric(http, "mlx_serve_requests_finished_total", {"reason": "cancelled"})
    stream = _open_stream(http)
    lines = stream.iter_lines()
    assert next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
    status = http.get("/v1/status").json()
    assert [r["phase"] for r in status["requests"]] == ["decoding"]
    assert status["kv"]["blocks_used"] > 0
    stream.close()
    assert _wait_until(lambda: http.get("/v1/status").json()["requests"] == [])
    assert http.get("/v1/status").json()["kv"]["blocks_used"] == 0
    assert _metric(http, "mlx_serve_requests_finished_total", {"reason": "cancelled"}) == cancelled_before + 1
    assert _metric(http, "mlx_serve_kv_blocks_used") == 0
    assert _metric(http, "mlx_serve_running_requests") == 0
    assert _wait_until(lambda: _metric(http, "mlx_serve_requests_finished_total", {"reason": "cancelled"})
                       == cancelled_before + 1)
    assert _metric(http, "mlx_serve_generation_tokens_total") < 3000  # stopped long before max_tokens


def test_metrics_parse_with_prometheus_client(http):
    http.post(CHAT, json=_chat(stream=True))
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("mlx_serve_queue_depth", "mlx_serve_running_requests", "mlx_serve_kv_blocks_used",
                 "mlx_serve_kv_blocks_cached", "mlx_serve_prefix_hit_rate", "mlx_serve_compiled_shapes",
                 "mlx_serve_compiled_shapes_waiting"):
        assert families[name].type == "gauge"
    for name in ("mlx_serve_prompt_tokens", "mlx_serve_generation_tokens", "mlx_serve_budget_halvings",
                 "mlx_serve_steps"):
        assert families[name].type == "counter"
    for name in ("mlx_serve_time_to_first_token_seconds", "mlx_serve_inter_token_seconds",
                 "mlx_serve_step_seconds"):
        assert families[name].type == "histogram"
        count = next(s.value for s in families[name].samples if s.name == f"{name}_count")
        assert count > 0
    assert 0.0 <= families["mlx_serve_prefix_hit_rate"].samples[0].value <= 1.0


@pytest.mark.parametrize("name", ["default", "qwen3", None])
def test_the_model_may_be_named_by_alias_or_left_out(http, served, name):
    body = {k: v for k, v in _chat(model=name).items() if v is not None}
    assert http.post(CHAT, json=body).status_code == 200


def test_health_models_and_status(http, served):
    assert http.get("/health").json()["status"] == "ok"
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [served.engine.model_id]
    assert http.post(CHAT, json=_chat()).status_code == 200  # at least one step, whichever tests ran before
    status = http.get("/v1/status").json()
    assert set(status) >= {"model", "requests", "counters", "kv", "step_target_ms"}
    assert status["counters"]["steps"] > 0


def test_a_non_streaming_client_that_gives_up_cancels_its_request(http, served):
    cancelled_before = _metric(http, "mlx_serve_requests_finished_total", {"reason": "cancelled"})
    with pytest.raises(httpx.ReadTimeout):  # the client closes its connection when it stops waiting
        httpx.post(f"{served.url}{CHAT}", json=_chat(max_tokens=3000, ignore_eos=True), timeout=0.5)
    assert _wait_until(lambda: http.get("/v1/status").json()["requests"] == [])
    assert http.get("/v1/status").json()["kv"]["blocks_used"] == 0
    assert _metric(http, "mlx_serve_requests_finished_total", {"reason": "cancelled"}) == cancelled_before + 1


def test_status_shows_a_long_prefill_running_beside_a_decoding_stream(http, served):
    before = http.get("/v1/status").json()["counters"]["contended_prefill_rows"]
    stream = _open_stream(http)
    try:
        lines = stream.iter_lines()
        assert next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
        long_prompt = [7 + i % 500 for i in range(1500)]
        reply = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1, "temperature": 0})
        assert reply.status_code == 200
    finally:
        stream.close()
    after = http.get("/v1/status").json()["counters"]["contended_prefill_rows"]
    assert after - before >= 1500 - 16  # all its rows ran in steps that also decoded the stream
