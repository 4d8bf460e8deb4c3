"""Events for streams read on event loops: handed over once per step (`Outbox`), in order, never lost; a closed
loop's requests cancelled; streams read blocking served at once. And the engine's streams read with `async for`
(the server's way) carry mlx-lm's tokens, with a disconnect freeing the slot."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.handle import Outbox, RequestHandle
from mlx_serve.types import GenerationRequest, TokenEvent
from tests.engine.reference import prompt_of, reference_tokens


class CountingLoop:
    """A running loop in its own thread that counts `call_soon_threadsafe` calls (the wake-ups)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wakeups = 0
        call = self.loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            self.wakeups += 1
            return call(*args, **kwargs)

        self.loop.call_soon_threadsafe = counted
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


async def _handle(request_id: str, cancelled: list[str]) -> RequestHandle:
    return RequestHandle(request_id, cancelled.append)  # made on the loop: read with `async for`


async def _read(handle: RequestHandle) -> list[TokenEvent]:
    return [event async for event in handle]


def _event(rid: str, token: int, last: bool = False) -> TokenEvent:
    return TokenEvent(rid, token, str(token), finish_reason="length" if last else None)


def test_a_steps_events_wake_each_reading_loop_once_and_keep_their_order():
    loops = [CountingLoop(), CountingLoop()]
    cancelled: list[str] = []
    try:
        handles = [loop.run(_handle(f"r{i}", cancelled)) for i, loop in enumerate(loops * 2)]  # two handles a loop
        outbox = Outbox()
        for step in range(3):  # three steps, each a token for every handle
            for handle in handles:
                outbox.post(handle, _event(handle.request_id, step, last=step == 2))
            assert len(outbox) == len(handles)
            before = [loop.wakeups for loop in loops]
            assert outbox.flush() == len(handles)
            assert [loop.wakeups - b for loop, b in zip(loops, before)] == [1, 1] and len(outbox) == 0
        for handle, loop in zip(handles, loops * 2):
            events = loop.run(_read(handle))
            assert [e.token_id for e in events] == [0, 1, 2] and events[-1].finish_reason == "length"
        assert cancelled == []
        before = [loop.wakeups for loop in loops]
        assert outbox.flush() == 0  # nothing posted: no wake-up
        assert [loop.wakeups for loop in loops] == before
    finally:
        for loop in loops:
            loop.close()


def test_a_handle_read_blocking_gets_its_event_without_a_flush():
    cancelled: list[str] = []
    handle = RequestHandle("sync", cancelled.append)  # no running loop here
    outbox = Outbox()
    outbox.post(handle, _event("sync", 7, last=True))
    assert len(outbox) == 0
    assert [e.token_id for e in handle] == [7]


def test_a_closed_loops_requests_are_cancelled_once_each():
    loop = CountingLoop()
    cancelled: list[str] = []
    handles = [loop.run(_handle(f"r{i}", cancelled)) for i in range(2)]
    loop.close()
    outbox = Outbox()
    for handle in handles:
        outbox.post(handle, _event(handle.request_id, 1))
        outbox.post(handle, _event(handle.request_id, 2))
    outbox.flush()
    assert sorted(cancelled) == ["r0", "r1"] and len(outbox) == 0


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    engine = Engine.load(EngineConfig(model=str(tiny_qwen3), block_size=16, kv_blocks=256))
    yield engine
    engine.shutdown()


def test_streams_read_on_a_loop_carry_mlx_lm_tokens_and_a_disconnect_frees_the_slot(engine, tiny_qwen3):
    prompts = [prompt_of(20 + 7 * i, seed=40 + i) for i in range(4)]

    async def read_all() -> tuple[list[list[int]], list[TokenEvent]]:
        handles = [engine.submit(GenerationRequest(prompt_ids=tuple(p), max_tokens=12)) for p in prompts]
        left = engine.submit(GenerationRequest(prompt_ids=tuple(prompt_of(30, seed=50)), max_tokens=500, ignore_eos=True))
        seen = []
        async for event in left:  # the reader goes away after three tokens: `async for` cancels it
            seen.append(event)
            if len(seen) == 3:
                break
        streams = await asyncio.gather(*(_read(h) for h in handles))
        return [[e.token_id for e in events if e.token_id is not None] for events in streams], seen

    tokens, seen = asyncio.run(asyncio.wait_for(read_all(), 120))  # an event never flushed would hang the readers
    for prompt, got in zip(prompts, tokens):
        assert got == reference_tokens(tiny_qwen3, prompt, 12)
    assert [e.index for e in seen] == [0, 1, 2]
    for _ in range(200):  # the cancellation is taken at the engine's next admission pass
        stats = engine.stats()
        if stats["running"] == 0:
            break
        threading.Event().wait(0.01)
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0
