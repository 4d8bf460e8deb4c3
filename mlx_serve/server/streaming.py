"""Engine handles to HTTP: submitting the choices of one request, merging their event streams, SSE framing,
and cancelling on client disconnect so KV is freed at once."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request

from mlx_serve.types import GenerationRequest, TokenEvent

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


def submit_all(engine: Any, requests: Sequence[GenerationRequest]) -> list[Handle]:
    """Submit every choice, or none: if one is refused the others are cancelled before the error goes up."""
    handles: list[Handle] = []
    try:
        for request in requests:
            handles.append(engine.submit(request))
    except BaseException:
        cancel_all(handles)
        raise
    return handles


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


async def guard_stream(handles: Sequence[Handle], chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass chunks through; however the stream ends (done, disconnect, error) cancel what is still running."""
    finished = False
    try:
        async for chunk in chunks:
            yield chunk
        finished = True
    finally:
        if not finished:
            log.info("stream ended early (client disconnected?): cancelling %d request(s)", len(handles))
        cancel_all(handles)


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
    gathering.result()
    return events


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
