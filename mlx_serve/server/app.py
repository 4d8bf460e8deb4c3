"""The starlette app: routes, shared objects from the lifespan, and one error path for both APIs.

Each refused request is answered with its API's error body and logged once; nothing a request does can
stop the engine, which is owned (loaded and shut down) by whoever calls `create_app`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_serve.errors import InvalidRequest, MlxServeError, RouteNotFound
from mlx_serve.server import anthropic_routes, embedding_routes, openai_routes, responses_routes
from mlx_serve.server.auth import RequireApiKey
from mlx_serve.server.metrics import ServerMetrics
from mlx_serve.server.protocol import ModelInfo, anthropic_error_body, openai_error_body
from mlx_serve.server.streaming import ClientDisconnected

log = logging.getLogger("mlx_serve.server")


def model_info(engine: Any, aliases: Iterable[str] = (), split_reasoning: bool = True,
               pooling: str = "last") -> ModelInfo:  # fmt: skip
    """The served model's names: its id, the checkpoint folder's name, "default", and any aliases given."""
    names = {Path(engine.model_id).name, "default", *aliases}
    kv = engine.status()["kv"]
    return ModelInfo(engine.model_id, frozenset(names), engine.context_length, engine.vocab_size,
                     kv_capacity=kv["blocks_total"] * kv["block_size"], split_reasoning=split_reasoning, pooling=pooling,
                     adapter_names=lambda: tuple(getattr(engine, "adapters", ())))  # fmt: skip


def create_app(engine: Any, metrics: ServerMetrics | None = None, aliases: Iterable[str] = (),
               split_reasoning: bool = True, adapter_loading: bool = False, pooling: str = "last",
               api_key: str | None = None, allowed_origins: Sequence[str] = ()) -> Starlette:  # fmt: skip
    """The HTTP app over a loaded engine. `metrics` should be the engine's observer, so histograms fill;
    `split_reasoning`: chat answers put a thinking model's reasoning in `reasoning_content`; `adapter_loading`: the
    routes that load and unload LoRA adapters (vLLM's) exist (they read paths on this machine: opt-in); `pooling`:
    how /v1/embeddings pools a prompt ("last" or "mean"); `api_key`: what every /v1 route asks for (`auth`);
    `allowed_origins`: the browser origins CORS lets call it ("*": any)."""
    metrics = metrics or ServerMetrics()
    metrics.watch(engine.stats)
    shared = {"engine": engine, "model": model_info(engine, aliases, split_reasoning, pooling), "metrics": metrics,
              "responses": responses_routes.ResponseStore()}  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        log.info("serving %s", engine.model_id)
        yield shared
        log.info("HTTP server stopped")

    routes = [
        Route("/v1/chat/completions", openai_routes.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_routes.completions, methods=["POST"]),
        Route("/v1/embeddings", embedding_routes.embeddings, methods=["POST"]),
        Route("/v1/responses", responses_routes.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses_routes.retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses_routes.delete_response, methods=["DELETE"]),
        Route("/v1/models", openai_routes.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", openai_routes.retrieve_model, methods=["GET"]),
        Route("/v1/messages", anthropic_routes.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_routes.count_tokens, methods=["POST"]),
        Route("/v1/status", status, methods=["GET"]),
        Route("/tokenize", openai_routes.tokenize, methods=["POST"]),
        Route("/detokenize", openai_routes.detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus_metrics, methods=["GET"]),
    ]
    if adapter_loading:
        routes += [Route("/v1/load_lora_adapter", openai_routes.load_lora_adapter, methods=["POST"]),
                   Route("/v1/unload_lora_adapter", openai_routes.unload_lora_adapter, methods=["POST"])]
    handlers = {MlxServeError: api_error, HTTPException: http_error, ClientDisconnected: client_gone,
                Exception: unexpected_error}
    middleware = []
    if allowed_origins:  # outermost: a browser's preflight carries no key
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                                     allow_headers=["*"]))  # fmt: skip
    if api_key:
        middleware.append(Middleware(RequireApiKey, api_key=api_key, respond=error_response))
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=middleware)


async def health(request: Request) -> Response:
    """200 while the engine serves; 503 with the reason once its loop has stopped on its own."""
    failure = getattr(request.state.engine, "failure", None)
    if failure:
        return JSONResponse({"status": "failed", "model": request.state.model.model_id, "error": failure},
                            status_code=503)  # fmt: skip
    return JSONResponse({"status": "ok", "model": request.state.model.model_id})


async def status(request: Request) -> Response:
    return JSONResponse(request.state.engine.status())


async def prometheus_metrics(request: Request) -> Response:
    return Response(request.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def error_response(request: Request, exc: MlxServeError) -> JSONResponse:
    """The error in the caller's API dialect (Anthropic under /v1/messages, OpenAI elsewhere)."""
    anthropic = request.url.path.startswith("/v1/messages")
    body = anthropic_error_body(exc) if anthropic else openai_error_body(exc)
    metrics: ServerMetrics | None = getattr(request.state, "metrics", None)
    if metrics is not None:
        metrics.on_http_error(exc.status_code)
    return JSONResponse(body, status_code=exc.status_code)


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, MlxServeError)
    log.warning("%s %s -> %d %s: %s", request.method, request.url.path, exc.status_code,
                type(exc).__name__, exc.message)
    return error_response(request, exc)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = RouteNotFound(f"Invalid URL ({request.method} {request.url.path})") if exc.status_code == 404 else \
        InvalidRequest(str(exc.detail))
    error.status_code = exc.status_code
    return error_response(request, error)


async def client_gone(request: Request, exc: Exception) -> Response:
    log.info("%s %s: client disconnected; its requests were cancelled", request.method, request.url.path)
    return Response(status_code=499)


async def unexpected_error(request: Request, exc: Exception) -> Response:
    # starlette re-raises after this handler so that hypercorn logs the traceback once; no log here
    return error_response(request, MlxServeError(f"internal error: {type(exc).__name__}: {exc}"))
