"""Engine handles to HTTP: merging the event streams of one request's choices, SSE framing,
and cancelling on client disconnect so KV is freed at once."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mlx_serve.types import TokenEvent

log = logging.getLogger(__name__)


class Handle(Protocol):
    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...


class ClientDisconnected(Exception):
    """The client went away before a non-streaming answer was ready."""


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event; `data` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def cancel_all(handles: Sequence[Handle]) -> None:
    for handle in handles:
        handle.cancel()


@dataclass(frozen=True, slots=True)
class _Item:
    index: int
    event: TokenEvent | None  # None: that choice's stream ended
    error: BaseException | None = None


async def merge_events(handles: Sequence[Handle]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(choice index, event) from all handles in arrival order."""
    if len(handles) == 1:
        async for event in handles[0]:
            yield 0, event
        return
    queue: asyncio.Queue[_Item] = asyncio.Queue()

    async def pump(index: int, handle: Handle) -> None:
        try:
            async for event in handle:
                queue.put_nowait(_Item(index, event))
            queue.put_nowait(_Item(index, None))
        except Exception as exc:  # handed to the consumer, which re-raises it in its own task
            queue.put_nowait(_Item(index, None, exc))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        open_streams = len(handles)
        while open_streams:
            item = await queue.get()
            if item.error is not None:
                raise item.error
            if item.event is None:
                open_streams -= 1
            else:
                yield item.index, item.event
    finally:
        for task in tasks:
            task.cancel()


class EventStreamResponse(StreamingResponse):
    """An SSE response that cancels its engine requests however it ends: finished, client gone (even before
    the first chunk), or failed. Cancelling a finished request does nothing."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], handles: Sequence[Handle]) -> None:
        super().__init__(chunks, headers={"Cache-Control": "no-cache"})
        self.handles = handles

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if any(not getattr(h, "done", False) for h in self.handles):
                log.info("stream ended early (client disconnected?): cancelling %d request(s)", len(self.handles))
            cancel_all(self.handles)


async def collect_events(handles: Sequence[Handle], request: Request) -> list[list[TokenEvent]]:
    """All events of every choice; a client disconnect cancels the requests and raises ClientDisconnected."""
    events: list[list[TokenEvent]] = [[] for _ in handles]

    async def gather() -> None:
        async for index, event in merge_events(handles):
            events[index].append(event)

    gathering = asyncio.create_task(gather())
    watching = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({gathering, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not gathering.done():
            gathering.cancel()
            cancel_all(handles)
    if not gathering.done() or gathering.cancelled():
        raise ClientDisconnected()
    if gathering.exception() is not None:
        cancel_all(handles)  # one choice's stream failed: the others must not run on unobserved
        raise gathering.exception()
    return events


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
