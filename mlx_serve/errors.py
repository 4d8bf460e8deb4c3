"""Errors a caller can act on. Each maps to one HTTP status in the server."""

from __future__ import annotations

import json
from typing import Any


class MlxServeError(Exception):
    status_code = 500
    error_type = "server_error"
    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param


class InvalidRequest(MlxServeError):
    """Bad input: wrong type, invalid sampling value, empty prompt."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus max_tokens, where the caller asked for it) does not fit the model's context."""

    error_type = "invalid_request_error"


class Unauthorized(MlxServeError):
    """No API key, or the wrong one, where the server was started with one."""

    status_code = 401
    error_type = "invalid_request_error"


class ModelNotFound(MlxServeError):
    status_code = 404
    error_type = "not_found_error"


class NotFound(MlxServeError):
    """A stored object (a response) that does not exist, or no longer."""

    status_code = 404
    error_type = "invalid_request_error"


class RouteNotFound(InvalidRequest):
    """No endpoint at this method and path (OpenAI answers "Invalid URL" as an invalid request, with a 404)."""

    status_code = 404


class UnsupportedModel(MlxServeError):
    status_code = 400
    error_type = "invalid_request_error"


class QueueFull(MlxServeError):
    """The waiting queue is at its limit: try again later."""

    status_code = 429
    error_type = "rate_limit_error"


class EngineStopped(MlxServeError):
    status_code = 503
    error_type = "server_error"


def parse_client_json(text: str | bytes, what: str, param: str | None = None) -> Any:
    """JSON that a client sent, or `InvalidRequest`: json.loads also fails with a plain ValueError (a number of over
    4,300 digits) or RecursionError (deep nesting), the client's fault as much as a syntax error is."""
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors too
        raise InvalidRequest(f"{what} is not valid JSON: {exc}", param=param) from None
    except RecursionError:
        raise InvalidRequest(f"{what} is nested too deeply", param=param) from None
