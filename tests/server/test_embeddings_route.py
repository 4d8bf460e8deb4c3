"""/v1/embeddings through the official `openai` client: strings and token ids, the client's default base64 and
plain floats, `dimensions`; each vector is mlx-lm's last hidden state, normalised. Bad input is a 400."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.engine.test_embeddings import reference_embedding


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)


def test_strings_and_token_ids_embed_as_mlx_lms_last_hidden_state(served, client):
    texts = ["The quick brown fox.", "A second, longer sentence about embeddings and vectors."]
    reply = client.embeddings.create(model="default", input=texts)  # the client asks for base64
    ids = [served.engine.tokenizer.encode(t) for t in texts]
    assert [d.index for d in reply.data] == [0, 1]
    for prompt, item in zip(ids, reply.data):
        np.testing.assert_allclose(item.embedding, reference_embedding(served.model_path, prompt, "last"), atol=2e-5)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    floats = client.embeddings.create(model="default", input=ids[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, reply.data[0].embedding, atol=1e-6)


def test_dimensions_keep_the_first_components_renormalised(served, client):
    full = np.array(client.embeddings.create(model="default", input="hello").data[0].embedding)
    cut = np.array(client.embeddings.create(model="default", input="hello", dimensions=16).data[0].embedding)
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    assert abs(np.linalg.norm(cut) - 1) < 1e-6


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], [10**9]]}, "input"),
    ({"input": ["a"] * 257}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": 100000}, "dimensions"),
    ({"input": "a", "model": "nope"}, "model"),
    ({"input": [[5] * 100_000]}, "input"),
])  # fmt: skip
def test_bad_input_is_a_4xx_naming_the_field(served, body, param):
    response = httpx.post(f"{served.url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code in (400, 404)
    assert response.json()["error"]["param"] == param
