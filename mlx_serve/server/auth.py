"""An API key in front of the model routes (`serve --api-key`), as vLLM's: every path under /v1 asks for it, as
`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's); /health, /metrics and the
tokenizer routes stay open for probes. A pure ASGI middleware, so streamed answers pass through untouched."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_serve.errors import Unauthorized

GUARDED_PREFIX = "/v1/"


class RequireApiKey:
    def __init__(self, app: ASGIApp, api_key: str, respond: Any) -> None:
        self.app = app
        self._key = api_key.encode()
        self._respond = respond  # (request, error) -> the error in the caller's API dialect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX) or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        error = Unauthorized("Incorrect or missing API key: send it as 'Authorization: Bearer KEY' (or x-api-key)")
        await self._respond(Request(scope), error)(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        bearer = headers.get(b"authorization", b"")
        given = bearer[7:].strip() if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(given, self._key)
