"""The reader of `host_waits.c`: untimed `pthread_cond_wait` calls (MLX's waits), timed by an LD_PRELOAD shim.

Times come back in `time.perf_counter()` seconds: the shim reads CLOCK_MONOTONIC, which is perf_counter's clock on
Linux. `HostWaits.load()` is None in a process started without the shim.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable


class HostWaits:
    """The shim's records in this process, read through ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._count = lib.host_waits_count
        self._read = lib.host_waits_read
        self._clear = lib.host_waits_clear
        self._dropped = lib.host_waits_dropped
        self._count.restype = self._read.restype = self._dropped.restype = ctypes.c_long
        self._read.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_long]
        self._clear.restype = None

    @classmethod
    def load(cls) -> HostWaits | None:
        """The shim's reader, or None when the shim is not preloaded here."""
        try:
            return cls(ctypes.CDLL(None))
        except AttributeError:
            return None

    def clear(self) -> None:
        """Forget every wait recorded so far."""
        self._clear()

    def dropped(self) -> int:
        """Waits not recorded since the last clear: the shim's array was full."""
        return int(self._dropped())

    def read(self, tid: int | None = None) -> list[tuple[float, float]]:
        """(start, end) of each recorded wait in perf_counter seconds; `tid`: only that native thread's."""
        n = int(self._count())
        buf = (ctypes.c_longlong * (3 * n))()
        n = int(self._read(buf, n))
        waits = []
        for i in range(n):
            start, end, who = buf[3 * i], buf[3 * i + 1], buf[3 * i + 2]
            if start and (tid is None or who == tid):  # start 0: a record still being written
                waits.append((start / 1e9, end / 1e9))
        return waits


def overlap_ms(waits: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Total ms of the waits inside [start, end], each clipped to it (seconds in, ms out)."""
    return 1e3 * sum(max(0.0, min(b, end) - max(a, start)) for a, b in waits)
