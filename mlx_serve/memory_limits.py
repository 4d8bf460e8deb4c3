"""MLX's allocator held to the memory budget. The KV pool is sized to fit the budget, but MLX also keeps freed buffers
in a cache for reuse (by default as large as its memory limit), so after a long prefill the process can hold far more
than the budget. With `--memory-budget-gb` given, MLX's memory limit becomes the budget (past it, MLX waits for
running work to free memory before it allocates) and its cache is held to what the budget leaves after the weights,
the pool and the shares kept for adapters and a draft model (or MLX's own cache limit, where that is less: 32 MiB
on its CPU backend). On Metal, the working set is wired as mlx-lm's generate wires it, so macOS does not page the
weights out between requests.

Without a budget MLX's memory limit stands, but its cache is held to half of what that limit leaves after the same
held bytes (`UNBUDGETED_CACHE_SHARE`). Left at MLX's default the cache fills the device: on an H100 (forty-seventh
run, 8B 4-bit) a bench process held 59 GB of cached buffers beside 17 GB in use, at MLX's limit, and every step then
waited for the one in flight to free memory: decode steps took 7.7-8.3 ms against 5.0, and a 16k prompt beside 8
streams 1.73x its solo time. Emptied first (30-36 GB cached at the pass's start): 5.6-5.9 ms, and 1.29x and 1.50x.
mlx-lm's generation empties the cache after each prefill chunk and every 256 tokens instead.

MLX's limits are process-wide, so engines in one process take turns: the newest engine's limits apply, and when it
shuts down the next newest's come back, or MLX's own once none is left (`_HOLDERS`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import mlx.core as mx

LEAST_CACHE_BYTES = 64 << 20  # a step's buffers are reused even where the budget is tight
# without a budget, the cache's share of what MLX's memory limit leaves after the held bytes: the rest is for the
# buffers steps in flight use (8B 4-bit on an H100: 9 GB above the engine's held bytes at the peak of a contended pass)
UNBUDGETED_CACHE_SHARE = 0.5
NO_LIMIT = 1 << 62


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """What an engine holds MLX to (None: left as MLX has it)."""

    memory: int | None = None
    cache: int | None = None
    wired: int | None = None

    def restore(self) -> None:
        """This engine is done: the limits of the engine before it (or MLX's own) come back."""
        _HOLDERS.release(self)

    def describe(self) -> str:
        parts = [f"{name} {value / (1 << 30):.2f} GiB" for name, value in
                 (("memory limit", self.memory), ("buffer cache", self.cache)) if value is not None]  # fmt: skip
        parts += ["working set wired"] if self.wired is not None else []
        return f"MLX {', '.join(parts)}" if parts else "MLX limits left as they were"


class _Holders:
    """The engines whose limits MLX holds, oldest first, and MLX's own limits from before the first of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[MemoryLimits] = []
        self._original = MemoryLimits()

    def hold(self, limits: MemoryLimits) -> None:
        with self._lock:
            previous = _set(limits)
            if not self._held:
                self._original = previous
            self._held.append(limits)

    def memory_limit(self) -> int:
        """MLX's memory limit in force now (a budgeted engine's, else MLX's own)."""
        with self._lock:
            current = mx.set_memory_limit(NO_LIMIT)  # read by setting it: more, never less, for that instant
            mx.set_memory_limit(current)
            return current

    def mlx_cache_limit(self) -> int:
        """MLX's own cache limit (from before any engine set one)."""
        with self._lock:
            if self._held and self._original.cache is not None:
                return self._original.cache
            current = mx.set_cache_limit(0)
            mx.set_cache_limit(current)
            return current

    def release(self, limits: MemoryLimits) -> None:
        with self._lock:
            if not any(held is limits for held in self._held):
                return
            self._held = [held for held in self._held if held is not limits]
            newest = self._held[-1] if self._held else MemoryLimits()
            original = self._original
            # what the newest remaining engine leaves alone goes back to MLX's own
            _set(MemoryLimits(*(mine if mine is not None else theirs for mine, theirs in
                                zip((newest.memory, newest.cache, newest.wired),
                                    (original.memory, original.cache, original.wired)))))  # fmt: skip


def _set(limits: MemoryLimits) -> MemoryLimits:
    """Set the limits given; returns MLX's values before, for those set."""
    return MemoryLimits(
        mx.set_memory_limit(limits.memory) if limits.memory is not None else None,
        mx.set_cache_limit(limits.cache) if limits.cache is not None else None,
        mx.set_wired_limit(limits.wired) if limits.wired is not None else None,
    )


_HOLDERS = _Holders()


def mlx_memory_limit() -> int:
    """MLX's memory limit in force now, in bytes (a budgeted engine's, else MLX's own default)."""
    return _HOLDERS.memory_limit()


def apply_limits(budget_bytes: int | None, held_bytes: int) -> MemoryLimits:
    """Hold MLX to `budget_bytes` (None: no budget given, MLX's memory limit stands and its cache gets
    `UNBUDGETED_CACHE_SHARE` of what that limit leaves), `held_bytes` of it taken for good (weights, the pool, the kept
    shares); wire the working set where the device recommends one (Metal), as mlx-lm does."""
    memory = wired = None
    if budget_bytes is not None:
        memory, cache = budget_bytes, max(budget_bytes - held_bytes, LEAST_CACHE_BYTES)
    else:
        cache = max(int((_HOLDERS.memory_limit() - held_bytes) * UNBUDGETED_CACHE_SHARE), LEAST_CACHE_BYTES)
    cache = min(cache, _HOLDERS.mlx_cache_limit())  # never more than MLX keeps (its CPU backend: 32 MiB)
    if mx.metal.is_available():
        wired = mx.device_info().get("max_recommended_working_set_size")
    limits = MemoryLimits(memory, cache, int(wired) if wired is not None else None)
    if limits != MemoryLimits():
        _HOLDERS.hold(limits)
    return limits
