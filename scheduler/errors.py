"""Refusals the scheduler raises from `add()`; the engine maps them onto `mlx_serve.errors`."""

from __future__ import annotations


class QueueFull(Exception):
    """The waiting queue is at its limit (HTTP 429): try again later."""


class RequestTooLarge(Exception):
    """The prompt needs more KV blocks than the whole pool holds: it can never run."""
