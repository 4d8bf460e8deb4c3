"""Trace sinks. The default `NullSink` does nothing and never reads the clock.

`MemorySink` keeps events in a bounded list and writes nothing until `close()`, so tracing never adds file I/O to
a workload. `sink_from_env()` is how the engine and the server's `--trace FILE` flag turn a capture on.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

TRACE_ENV = "MLX_SERVE_TRACE"  # path of the JSONL dump written at engine shutdown
CAPACITY_ENV = "MLX_SERVE_TRACE_CAPACITY"
DEFAULT_CAPACITY = 1_000_000


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

    def close(self, complete: bool = True) -> None:
        pass


NULL_SINK = NullSink()


class MemorySink:
    """A bounded in-memory capture: never writes during a workload, counts what overflowed."""

    enabled = True

    def __init__(self, capacity: int = DEFAULT_CAPACITY, path: str | Path | None = None) -> None:
        self.capacity = capacity
        self.path = Path(path) if path is not None else None
        self.events: list[object] = []
        self.dropped = 0
        self.closed = False
        self._t0 = time.perf_counter()

    @property
    def overflowed(self) -> bool:
        return self.dropped > 0

    @property
    def origin(self) -> float:
        """The `time.perf_counter()` reading that event times count from."""
        return self._t0

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def emit(self, event: object) -> None:
        if len(self.events) < self.capacity:
            self.events.append(event)
        else:
            self.dropped += 1

    def close(self, complete: bool = True) -> Path | None:
        """End the capture; dump it to `path` (if set) with a footer saying whether it ended cleanly."""
        if self.closed:
            return None
        self.closed = True
        if self.path is None:
            return None
        from tracing.jsonl import dump

        return dump(self, self.path, complete=complete)


def sink_from_env(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> NullSink | MemorySink:
    """The sink a process should trace into: `path` (the `--trace FILE` flag) wins, then `$MLX_SERVE_TRACE`.

    With neither, tracing is off (`NULL_SINK`). A capture that is never closed is still dumped at interpreter exit,
    marked incomplete, so the report can refuse it with a clear reason instead of finding no file.
    """
    env = os.environ if environ is None else environ
    target = path or env.get(TRACE_ENV)
    if not target:
        return NULL_SINK
    capacity = int(env.get(CAPACITY_ENV, DEFAULT_CAPACITY))
    sink = MemorySink(capacity=capacity, path=target)
    atexit.register(sink.close, complete=False)
    return sink
