"""Python's collections timed through `gc.callbacks`: does a collector pause sit inside a stream's longest gap?

A collection holds the GIL; the engine thread reacquires the GIL when MLX's `async_eval` returns, so a collection
run by any thread while a step is being encoded lengthens that step's submission as the engine thread sees it.
Times are `time.perf_counter()` seconds.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class GcPause:
    generation: int
    start: float
    end: float
    thread: str
    collected: int

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3


class GcPauses:
    """Every collection between `start()` and `stop()`, in any thread."""

    def __init__(self) -> None:
        self.pauses: list[GcPause] = []
        self._started: dict[int, float] = {}  # thread ident -> the running collection's start

    def _callback(self, phase: str, info: dict) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = time.perf_counter()
            return
        began = self._started.pop(ident, None)
        if began is not None:
            name = threading.current_thread().name
            self.pauses.append(
                GcPause(info["generation"], began, time.perf_counter(), name, info["collected"])
            )

    def start(self) -> GcPauses:
        self.pauses.clear()
        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> list[GcPause]:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        return list(self.pauses)


def summary(pauses: list[GcPause]) -> dict:
    """Per generation: how many collections, their total and longest ms."""
    out: dict[str, dict] = {}
    for generation in sorted({p.generation for p in pauses}):
        ms = [p.ms for p in pauses if p.generation == generation]
        out[str(generation)] = {"count": len(ms), "total_ms": round(sum(ms), 2), "max_ms": round(max(ms), 2)}
    return out


def overlapping(pauses: list[GcPause], start: float, end: float) -> list[GcPause]:
    return [p for p in pauses if p.end >= start and p.start <= end]
