"""LoRA adapters over HTTP: each served adapter is a `model` name of its own (listed with the base as its parent), a
request naming it gets mlx-lm's tokens with that adapter loaded, and answers under that name; the official `openai`
and `anthropic` clients are the callers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import openai
import pytest

from mlx_serve.adapter_specs import AdapterSpec
from mlx_serve.checkpoints.adapters import make_adapter
from tests.engine.reference import reference_adapter_tokens, reference_tokens
from tests.server.conftest import Served, serve_model
from tests.server.reference import chat_prompt_ids, greedy_text

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapter_dirs(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served-adapters")
    return {"alpha": make_adapter(tiny_qwen3, root / "alpha", seed=1),
            "beta": make_adapter(tiny_qwen3, root / "beta", rank=4, seed=2, keys=("mlp.down_proj",))}  # fmt: skip


@pytest.fixture(scope="module")
def served(tiny_qwen3: Path, adapter_dirs: dict[str, Path]) -> Iterator[Served]:
    specs = tuple(AdapterSpec(name, str(path)) for name, path in adapter_dirs.items())
    with serve_model(tiny_qwen3, kv_blocks=512, adapters=specs) as served:
        yield served


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)


def adapted_text(served: Served, adapter: Path | None, prompt_ids: list[int]) -> str:
    """mlx-lm's text with the adapter loaded (None: the base model), through its streaming detokenizer (as
    mlx_lm.generate prints it)."""
    tokenizer = served.engine.tokenizer
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tokens = (reference_adapter_tokens(served.model_path, adapter, prompt_ids, MAX_TOKENS) if adapter is not None
              else reference_tokens(served.model_path, prompt_ids, MAX_TOKENS))  # fmt: skip
    for token in tokens:
        if token not in tokenizer.eos_token_ids:
            detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def test_models_lists_each_adapter_with_the_base_as_parent(client, served):
    cards = {card.id: card for card in client.models.list()}
    assert set(cards) == {served.engine.model_id, "alpha", "beta"}
    assert cards["alpha"].parent == served.engine.model_id and cards["beta"].parent == served.engine.model_id
    assert client.models.retrieve("beta").parent == served.engine.model_id
    with pytest.raises(openai.NotFoundError, match="adapters alpha, beta"):
        client.models.retrieve("gamma")


def test_chat_streams_of_the_base_and_two_adapters_side_by_side_give_mlx_lms_text(client, served, adapter_dirs):
    messages = [{"role": "user", "content": "Tell me about colours."}]
    prompt = chat_prompt_ids(served.engine.tokenizer, messages)

    def stream(model: str) -> tuple[str, set[str]]:
        chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True))  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, {c.model for c in chunks}

    with ThreadPoolExecutor(3) as pool:
        base, alpha, beta = pool.map(stream, ["default", "alpha", "beta"])
    assert base == (greedy_text(served.model_path, served.engine.tokenizer, prompt, MAX_TOKENS)[0],
                    {served.engine.model_id})  # fmt: skip
    assert alpha == (adapted_text(served, adapter_dirs["alpha"], prompt), {"alpha"})
    assert beta == (adapted_text(served, adapter_dirs["beta"], prompt), {"beta"})
    assert len({base[0], alpha[0], beta[0]}) == 3


def test_completions_and_anthropic_messages_take_an_adapter_by_name(client, served, adapter_dirs):
    prompt = [11, 12, 13, 14, 15, 16]
    answer = client.completions.create(model="beta", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.model == "beta" and answer.choices[0].text == adapted_text(served, adapter_dirs["beta"], prompt)

    messages = [{"role": "user", "content": "Name a fruit."}]
    reply = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0).messages.create(
        model="alpha", max_tokens=MAX_TOKENS, messages=messages, extra_body={"temperature": 0})
    prompt = chat_prompt_ids(served.engine.tokenizer, messages)
    assert reply.model == "alpha" and reply.content[0].text == adapted_text(served, adapter_dirs["alpha"], prompt)


def test_an_unknown_model_names_the_adapters_served(client):
    with pytest.raises(openai.NotFoundError, match="serves '.*' and the adapters alpha, beta") as caught:
        client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert caught.value.body["param"] == "model"


@pytest.fixture(scope="module")
def loading(tiny_qwen3: Path) -> Iterator[Served]:
    """A server started with no adapter that may load them (vLLM's runtime LoRA routes)."""
    with serve_model(tiny_qwen3, {"adapter_loading": True}, kv_blocks=512, adapter_memory_gb=0.01) as served:
        yield served


def test_adapters_load_and_unload_at_runtime_and_answer_as_mlx_lm_would(loading, adapter_dirs):
    import httpx

    client = openai.OpenAI(base_url=loading.base_url, api_key="unused", max_retries=0)
    prompt = [21, 22, 23, 24, 25, 26, 27]
    http = httpx.Client(base_url=loading.url, timeout=60)

    def answer(model: str) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text

    reply = http.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(adapter_dirs["alpha"])})
    assert reply.status_code == 200 and "gamma" in reply.text
    assert "gamma" in {card.id for card in client.models.list()}
    assert http.get("/v1/status").json()["adapters"] == ["gamma"]
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(http.get("/metrics").text)
    gauges = {f.name: f.samples[0].value for f in families if f.type == "gauge" and f.samples}
    assert gauges["mlx_serve_adapter_bytes"] == loading.engine.adapter_bytes > 0
    assert gauges["mlx_serve_adapter_limit_bytes"] == loading.engine.adapter_limit_bytes
    assert answer("gamma") == adapted_text(loading, adapter_dirs["alpha"], prompt)
    # the same name twice, a directory that is not an adapter: 4xx naming the field, nothing changed
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(adapter_dirs["beta"])})
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": "/nonexistent"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora"
    # an adapter in use by an open stream stays until that stream is done
    stream = client.completions.create(model="gamma", prompt=prompt, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))
    busy = http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert busy.status_code == 400 and "in use by 1 open requests" in busy.text
    stream.close()
    for _ in range(100):  # the engine frees the request once the closed connection is noticed
        if http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200:
            break
        time.sleep(0.05)
    assert "gamma" not in {card.id for card in client.models.list()}
    with pytest.raises(openai.NotFoundError):
        answer("gamma")
    # the freed slot serves the next adapter, and the base model is untouched throughout
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "beta2", "lora_path": str(adapter_dirs["beta"])}
                     ).status_code == 200  # fmt: skip
    assert answer("beta2") == adapted_text(loading, adapter_dirs["beta"], prompt)
    assert answer("default") == adapted_text(loading, None, prompt)
    # a load the memory kept for adapters cannot hold: 400 naming the flag, and nothing changed
    kept, loading.engine.adapter_limit_bytes = loading.engine.adapter_limit_bytes, loading.engine.adapter_bytes
    try:
        full = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapter_dirs["alpha"])})
    finally:
        loading.engine.adapter_limit_bytes = kept
    assert full.status_code == 400 and "raise --adapter-memory-gb" in full.json()["error"]["message"]
    assert http.get("/v1/status").json()["adapters"] == ["beta2"]


def test_the_loading_routes_exist_only_when_allowed(served):
    import httpx

    reply = httpx.post(f"{served.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert reply.status_code == 404
