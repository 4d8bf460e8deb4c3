"""A submitted request as its caller sees it: an iterator of events, and a way to cancel.

The engine thread pushes events; an asyncio caller reads them on the loop that submitted, a plain thread
reads them blocking. Nothing here touches MLX.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Protocol, TypeVar

from mlx_serve.types import GenerationRequest, TokenEvent


class Cancellable(Protocol):
    def cancel(self) -> None: ...


H = TypeVar("H", bound=Cancellable)


def submit_each(submit: Callable[[GenerationRequest], H], requests: Iterable[GenerationRequest]) -> list[H]:
    """Submit every request, or none: if one is refused, those submitted before it are cancelled before the
    error goes up (the engine's `submit_all`, and the server tests' fake engine)."""
    handles: list[H] = []
    try:
        for request in requests:
            handles.append(submit(request))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


class RequestHandle:
    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self.done = False
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._async_events: asyncio.Queue[TokenEvent] | None = asyncio.Queue() if self._loop else None
        self._sync_events: queue.Queue[TokenEvent] = queue.Queue()

    def push(self, event: TokenEvent) -> None:
        """Called by the engine thread."""
        if self._loop is not None and self._async_events is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_events.put_nowait, event)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                self._cancel(self.request_id)
        else:
            self._sync_events.put(event)

    def cancel(self) -> None:
        if not self.done:
            self._cancel(self.request_id)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        if self._async_events is None:
            raise RuntimeError("this request was submitted outside an event loop: iterate it with `for`")
        try:
            while True:
                event = await self._async_events.get()
                yield event
                if event.finish_reason is not None:
                    self.done = True
                    return
        finally:
            if not self.done:  # the consumer stopped early (client went away): free the slot at once
                self.cancel()

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._async_events is not None:
            raise RuntimeError("this request was submitted on an event loop: iterate it with `async for`")
        while True:
            event = self._sync_events.get()
            yield event
            if event.finish_reason is not None:
                self.done = True
                return
