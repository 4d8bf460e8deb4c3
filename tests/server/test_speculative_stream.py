"""Speculative decoding behind the server: a greedy stream whose steps commit several tokens at once still streams
mlx-lm's text, token by token, and /metrics counts the drafts."""

from __future__ import annotations

import httpx
import openai

from tests.server.reference import greedy_text

ENGINE_CONFIG = {"speculative_tokens": 4}
MAX_TOKENS = 64


def test_a_greedy_stream_with_drafts_gives_mlx_lms_text(served):
    client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    text, n_tokens, reason = greedy_text(served.model_path, served.engine.tokenizer, prompt, MAX_TOKENS)
    chunks = list(client.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == n_tokens
    metrics = httpx.get(f"{served.url}/metrics").text
    drafted = next(line for line in metrics.splitlines() if line.startswith("mlx_serve_draft_tokens_total"))
    assert float(drafted.split()[-1]) > 0
