"""Where one thread's host time goes, sampled from its Python stack (the lent H200 has no py-spy, perf or nsys).

A daemon thread reads `sys._current_frames()` every `interval_s`. MLX releases the GIL inside `eval` and
`async_eval`, so a long submission shows up as consecutive samples on the line that queued it; pure-Python
stretches are sampled at the interpreter's switch interval, which `StackSampler` shortens while it runs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # perf_counter seconds
    frames: tuple[str, ...]  # "file:line function", innermost first


class StackSampler:
    """Samples the Python stack of the thread `ident` (`threading.Thread.ident`) until `stop`."""

    def __init__(self, ident: int, interval_s: float = 0.0005, depth: int = 3) -> None:
        self.ident, self.interval_s, self.depth = ident, interval_s, depth
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._switch = sys.getswitchinterval()

    def start(self) -> StackSampler:
        sys.setswitchinterval(min(self._switch, self.interval_s))
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        return self.samples

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.ident)
            frames = []
            while frame is not None and len(frames) < self.depth:
                code = frame.f_code
                frames.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            self.samples.append(Sample(time.perf_counter(), tuple(frames)))


def runs(samples: list[Sample], start: float, end: float, origin: float) -> list[list]:
    """The samples in [start, end] merged into runs of one innermost-frames stack: [from ms, to ms, frames...],
    in ms from `origin`."""
    merged: list[list] = []
    for sample in samples:
        if not start <= sample.t <= end:
            continue
        ms = round((sample.t - origin) * 1e3, 2)
        if merged and merged[-1][2:] == list(sample.frames):
            merged[-1][1] = ms
        else:
            merged.append([ms, ms, *sample.frames])
    return merged


def time_in(samples: list[Sample], start: float, end: float, where: Callable[[str], bool]) -> float:
    """Ms of [start, end] whose samples' innermost frame ("file:line function") satisfies `where`: each sample
    stands for the time to the next one."""
    inside = [sample for sample in samples if start <= sample.t <= end]
    ms = 0.0
    for sample, after in zip(inside, [*inside[1:], None]):
        if sample.frames and where(sample.frames[0]):
            ms += ((after.t if after is not None else end) - sample.t) * 1e3
    return ms
