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

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that submitted the request and reads its events (None: read blocking)."""
        return self._loop

    def push(self, event: TokenEvent) -> None:
        """From the engine thread, for a handle read blocking (`Outbox.post`)."""
        self._sync_events.put(event)

    def receive(self, event: TokenEvent) -> None:
        """On the caller's loop, for a handle read with `async for` (`Outbox.flush`)."""
        if self._async_events is not None:
            self._async_events.put_nowait(event)

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


class Outbox:
    """The engine thread's events for handles read on event loops, handed over once per step: one wake-up of each
    caller's loop per step, not one per token. `call_soon_threadsafe` writes the loop's self-pipe each time, about
    9 us on the project's box, and every wake-up contends for the GIL with the engine thread (CPU, 64 streams read
    with `async for`: 3.6-4.1 ms of the engine thread a step before, 1.9-2.1 after; `benchmarks/stream_delivery.py`,
    RESULTS). Handles read blocking get theirs at once (a queue put is ~1 us)."""

    def __init__(self) -> None:
        self._batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, TokenEvent]]] = {}

    def post(self, handle: RequestHandle, event: TokenEvent) -> None:
        """Queue `event` for `handle` until `flush` (at once where the handle is read blocking)."""
        if handle.loop is None:
            handle.push(event)
        else:
            self._batches.setdefault(handle.loop, []).append((handle, event))

    def flush(self) -> int:
        """Hand every queued event to its loop, in order, one call per loop; returns how many. A closed loop's
        readers are gone: their requests are cancelled."""
        batches, self._batches = self._batches, {}
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_receive_all, batch)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                for handle in {handle.request_id: handle for handle, _ in batch}.values():
                    handle.cancel()
        return sum(len(batch) for batch in batches.values())

    def __len__(self) -> int:
        return sum(len(batch) for batch in self._batches.values())


def _receive_all(batch: list[tuple[RequestHandle, TokenEvent]]) -> None:
    """On the reading loop: each event into its handle's queue."""
    for handle, event in batch:
        handle.receive(event)
