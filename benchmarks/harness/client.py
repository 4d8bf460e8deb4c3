"""A streaming OpenAI `/v1/completions` client that timestamps every chunk as the client sees it."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from benchmarks.harness.workload import RequestSpec


@dataclass
class RequestResult:
    name: str
    role: str
    expected_prompt_tokens: int
    sent: float = 0.0  # perf_counter when the request was sent
    done: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def output_hash(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


def request_body(spec: RequestSpec, model: str, salted: bool, logit_bias: dict[int, float]) -> dict:
    body = {
        "model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if logit_bias:
        body["logit_bias"] = {str(k): v for k, v in logit_bias.items()}  # keep outputs at max_tokens
    if salted:
        body["cache_salt"] = spec.cache_salt
    return body


def absorb(result: RequestResult, payload: dict, now: float) -> bool:
    """Fold one SSE payload into the result; True if it carried text."""
    usage = payload.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens", 0)
    carried = False
    for choice in payload.get("choices") or ():
        text = choice.get("text") or ""
        if text:
            result.text += text
            result.chunk_times.append(now)
            carried = True
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    if "error" in payload:
        result.error = json.dumps(payload["error"])[:300]
    return carried


async def stream_completion(client: httpx.AsyncClient, url: str, spec: RequestSpec, body: dict,
                            on_chunk: Callable[[], None] | None = None) -> RequestResult:
    result = RequestResult(spec.name, spec.role, spec.prompt_tokens)
    result.sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                if absorb(result, json.loads(data), time.perf_counter()) and on_chunk:
                    on_chunk()
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.done = time.perf_counter()
    return result
