"""Trace sinks. The default `NullSink` does nothing and never reads the clock."""

from __future__ import annotations

import time
from typing import Protocol


class TraceSink(Protocol):
    enabled: bool

    def now(self) -> float: ...

    def emit(self, event: object) -> None: ...


class NullSink:
    """Tracing off: callers check `enabled` before building events, so the hot path pays nothing."""

    enabled = False

    def now(self) -> float:
        return 0.0

    def emit(self, event: object) -> None:
        pass


NULL_SINK = NullSink()


class MemorySink:
    """A bounded in-memory capture: never writes during a workload, counts what overflowed."""

    enabled = True

    def __init__(self, capacity: int = 1_000_000) -> None:
        self.capacity = capacity
        self.events: list[object] = []
        self.dropped = 0
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def emit(self, event: object) -> None:
        if len(self.events) < self.capacity:
            self.events.append(event)
        else:
            self.dropped += 1
