"""OpenAI's /v1/embeddings: each input's prompt pooled by the engine into a unit vector (`GenerationRequest.pooling`).

Inputs are a string, a list of token ids, or a list of either; `encoding_format` float or base64 (little-endian
float32, which the official client asks for by default); `dimensions` keeps the first N components, renormalised
(Matryoshka-trained models such as Qwen3-Embedding are meant to be cut so).
"""

from __future__ import annotations

import base64
import math
import struct
import uuid
from dataclasses import dataclass, replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_serve.errors import InvalidRequest, MlxServeError
from mlx_serve.server.protocol import ModelInfo, Prompt, parse_json_object, read_int, read_prompts
from mlx_serve.server.streaming import collect_events
from mlx_serve.types import GenerationRequest

MAX_INPUTS = 256  # inputs in one call


@dataclass(frozen=True, slots=True)
class EmbeddingJob:
    prompts: list[Prompt]
    adapter: str | None
    encoding: str  # "float" | "base64"
    dimensions: int | None


def parse_embeddings(body: dict[str, Any], tokenizer: Any, model: ModelInfo) -> EmbeddingJob:
    adapter = model.adapter_for(body.get("model"))
    if "input" not in body:
        raise InvalidRequest("input is required", param="input")
    prompts = read_prompts(body["input"], tokenizer, model.vocab_size, param="input", most=MAX_INPUTS)
    limit = min(model.context_length, model.kv_capacity)
    if (longest := max(len(p.ids) for p in prompts)) >= limit:
        raise InvalidRequest(f"an input has {longest} tokens; this model embeds at most {limit - 1}", param="input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise InvalidRequest(f"encoding_format must be float or base64, not {encoding!r}", param="encoding_format")
    return EmbeddingJob(prompts, adapter, encoding, read_int(body, "dimensions", low=1))


async def embeddings(request: Request) -> Response:
    engine, model = request.state.engine, request.state.model
    job = await run_in_threadpool(parse_embeddings, parse_json_object(await request.body()), engine.tokenizer, model)
    job_id = f"embd-{uuid.uuid4().hex}"
    base = GenerationRequest(prompt_ids=(0,), max_tokens=1, pooling=model.pooling, adapter=job.adapter)
    handles = engine.submit_all([replace(base, prompt_ids=tuple(p.ids), request_id=f"{job_id}-{i}")
                                 for i, p in enumerate(job.prompts)])  # fmt: skip
    data = []
    for index, events in enumerate(await collect_events(handles, request)):
        vector = next((e.embedding for e in events if e.embedding is not None), None)
        if vector is None:  # the engine failed the request: say so rather than answer without it
            raise MlxServeError(next((e.error for e in events if e.error), None) or "embedding failed")
        data.append({"object": "embedding", "index": index, "embedding": _encoded(_cut(vector, job), job.encoding)})
    tokens = sum(len(p.ids) for p in job.prompts)
    return JSONResponse({"object": "list", "data": data, "model": job.adapter or model.model_id,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


def _cut(vector: tuple[float, ...], job: EmbeddingJob) -> list[float]:
    if job.dimensions is None:
        return list(vector)
    if job.dimensions > len(vector):
        raise InvalidRequest(f"dimensions must be at most {len(vector)}, got {job.dimensions}", param="dimensions")
    kept = vector[: job.dimensions]
    norm = math.sqrt(sum(v * v for v in kept)) or 1.0
    return [v / norm for v in kept]


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
