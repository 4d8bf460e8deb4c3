"""Serving beyond loopback: an API key on every /v1 route (`--api-key`, as vLLM's), CORS for browser clients
(`--allowed-origins`) and HTTPS (`--ssl-certfile`/`--ssl-keyfile`), through the official clients."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import Served, serve_model

KEY = "sk-local-test"
ORIGIN = "https://chat.example"


@pytest.fixture(scope="module")
def guarded(tiny_qwen3: Path) -> Iterator[Served]:
    with serve_model(tiny_qwen3, {"api_key": KEY, "allowed_origins": [ORIGIN]}, kv_blocks=256) as served:
        yield served


def _chat(served: Served, key: str) -> str:
    client = openai.OpenAI(base_url=served.base_url, api_key=key, max_retries=0)
    reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, temperature=0)  # fmt: skip
    return reply.choices[0].message.content


def test_every_v1_route_asks_for_the_key_in_either_header(guarded):
    assert isinstance(_chat(guarded, KEY), str)
    for wrong in ("sk-other", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as caught:
            _chat(guarded, wrong)
        assert caught.value.body["code"] == "invalid_api_key"
    bare = httpx.post(f"{guarded.base_url}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert bare.status_code == 401 and bare.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.base_url, api_key="nope", max_retries=0).models.list()
    # Anthropic's client sends x-api-key, and reads its own error type
    messages = [{"role": "user", "content": "hi"}]
    good = anthropic.Anthropic(base_url=guarded.url, api_key=KEY, max_retries=0)
    assert good.messages.create(model="default", max_tokens=3, messages=messages).content
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=guarded.url, api_key="nope", max_retries=0).messages.create(
            model="default", max_tokens=3, messages=messages)
    assert caught.value.body["error"]["type"] == "authentication_error"
    # a stream with the key flows as without one
    client = openai.OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0)
    chunks = list(client.chat.completions.create(model="default", messages=messages, max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None


def test_probes_stay_open_and_a_refusal_is_counted(guarded):
    assert httpx.get(f"{guarded.url}/health").json()["status"] == "ok"
    before = httpx.get(f"{guarded.url}/metrics").text
    assert httpx.post(f"{guarded.base_url}/completions", json={"prompt": "x"}).status_code == 401
    after = httpx.get(f"{guarded.url}/metrics").text

    def refusals(text: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith("mlx_serve_http_errors_total") and '"401"' in line]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    assert refusals(after) == refusals(before) + 1


def test_a_browser_origin_allowed_gets_cors_headers_and_its_preflight_needs_no_key(guarded):
    preflight = httpx.options(f"{guarded.base_url}/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})  # fmt: skip
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{guarded.base_url}/chat/completions", headers={
        "Origin": "https://elsewhere.example", "Access-Control-Request-Method": "POST"})  # fmt: skip
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    reply = httpx.get(f"{guarded.base_url}/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == ORIGIN


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate to serve HTTPS with")
    root = tmp_path_factory.mktemp("tls")
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)  # fmt: skip
    return cert, key


def test_https_serves_the_same_routes(guarded, certificate):
    from mlx_serve.server import ServerMetrics, create_app
    from mlx_serve.server.http import BackgroundServer

    cert, key = certificate
    server = BackgroundServer(create_app(guarded.engine, ServerMetrics()), certfile=str(cert), keyfile=str(key))
    try:
        assert server.url.startswith("https://")
        http = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)))
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, http_client=http)
        reply = client.completions.create(model="default", prompt=[1, 2, 3], max_tokens=2, temperature=0)
        assert reply.choices[0].finish_reason == "length"
        with pytest.raises(httpx.TransportError):  # plain HTTP is not answered
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
    finally:
        server.close()


@pytest.mark.parametrize(("flags", "message"), [
    (["--ssl-certfile", "cert.pem"], "--ssl-certfile and --ssl-keyfile go together"),
    (["--ssl-certfile", "missing.pem", "--ssl-keyfile", "missing.pem"], "cannot use missing.pem and missing.pem"),
])  # fmt: skip
def test_tls_flags_are_checked_before_the_model_loads(tmp_path, flags, message):
    done = subprocess.run([sys.executable, "-m", "mlx_serve", "serve", "--port", "0", "--model", "/never/read", *flags],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1 and message in done.stderr
