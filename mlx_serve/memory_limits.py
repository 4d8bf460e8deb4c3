"""MLX's allocator held to the memory budget. The KV pool is sized to fit the budget, but MLX also keeps freed buffers
in a cache for reuse (by default as large as its memory limit), so after a long prefill the process can hold far more
than the budget. With `--memory-budget-gb` given, MLX's memory limit becomes the budget (past it, MLX waits for
running work to free memory before it allocates) and its cache is held to what the budget leaves after the weights,
the pool and the shares kept for adapters and a draft model (or MLX's own cache limit, where that is less: 32 MiB
on its CPU backend). On Metal, the working set is wired as mlx-lm's generate
wires it, so macOS does not page the weights out between requests. Every setting is process-wide: the engine puts the
previous values back when it shuts down.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.utils import maybe_set_recommended_wired_limit

LEAST_CACHE_BYTES = 64 << 20  # a step's buffers are reused even where the budget is tight


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """The limits set, and MLX's values before them (None: left alone)."""

    memory: int | None = None
    cache: int | None = None
    wired: bool = False
    previous_memory: int | None = None
    previous_cache: int | None = None
    previous_wired: int | None = None

    def restore(self) -> None:
        if self.previous_memory is not None:
            mx.set_memory_limit(self.previous_memory)
        if self.previous_cache is not None:
            mx.set_cache_limit(self.previous_cache)
        if self.previous_wired is not None:
            mx.set_wired_limit(self.previous_wired)

    def describe(self) -> str:
        parts = [f"{name} {value / (1 << 30):.2f} GiB" for name, value in
                 (("memory limit", self.memory), ("buffer cache", self.cache)) if value is not None]  # fmt: skip
        parts += ["working set wired"] if self.wired else []
        return f"MLX {', '.join(parts)}" if parts else "MLX limits left as they were"


def apply_limits(budget_bytes: int | None, held_bytes: int) -> MemoryLimits:
    """Hold MLX to `budget_bytes` (None: no budget given, limits untouched), `held_bytes` of it taken for good (weights,
    the pool, the kept shares); wire the working set where the device recommends one (Metal), as mlx-lm does."""
    memory = cache = previous_memory = previous_cache = None
    if budget_bytes is not None:
        memory, cache = budget_bytes, max(budget_bytes - held_bytes, LEAST_CACHE_BYTES)
        previous_memory, previous_cache = mx.set_memory_limit(memory), mx.set_cache_limit(cache)
        if previous_cache < cache:  # never more than MLX kept before (its CPU backend keeps 32 MiB)
            cache = previous_cache
            mx.set_cache_limit(cache)
    previous_wired = maybe_set_recommended_wired_limit() if mx.metal.is_available() else None
    return MemoryLimits(memory, cache, previous_wired is not None, previous_memory, previous_cache, previous_wired)
