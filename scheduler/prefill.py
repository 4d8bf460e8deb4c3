"""Prefill rows for one step: fill the row budget in prefill order, admitting waiting requests while KV allows.

- Waiting requests are admitted only while fewer than `max_running` hold KV, and only when their chunk's blocks
  fit with a reserve of one block per decoding stream left over (so running decodes can grow).
- A chunk is cut to the budget left, and to the blocks the pool can give; the first candidate that cannot get a
  single row stops the fill, so order is never broken to squeeze someone in.
- When nothing at all could be planned (no decodes, no rows), requests already holding KV are tried alone,
  oldest-useful first, so that waiting requests can never deadlock the running ones.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from scheduler.cost_models import PrefillChunk, StepShape
from scheduler.ordering import count_overtakes, order_prefill_candidates
from scheduler.plan import Lane, LaneKind, Path
from scheduler.request import Request, RequestState

if TYPE_CHECKING:
    from scheduler.core import Scheduler


def _is_waiting(request: Request) -> bool:
    return request.state in (RequestState.WAITING, RequestState.PREEMPTED)


class PrefillPlanner:
    def __init__(self, scheduler: Scheduler, decode_lanes: list[Lane]) -> None:
        self.scheduler = scheduler
        self.config = scheduler.config
        self.decode_lanes = decode_lanes
        running = scheduler.running_requests()
        prefilling = [r for r in running if r.state is RequestState.PREFILLING and r.in_flight_path is None]
        self.has_room = len(running) < self.config.max_running
        waiting = scheduler.waiting_requests() if self.has_room else []
        self.ordered = order_prefill_candidates([*prefilling, *waiting], self.config.max_overtakes)

    def prefix_hits(self, request: Request) -> list[int]:
        """Cached blocks for the request's leading full blocks, never covering its last token."""
        max_blocks = (request.num_tokens - 1) // self.config.block_size
        hashes = self.scheduler.block_hashes(request, max_blocks) if self.config.enable_prefix_cache else []
        return self.scheduler.blocks.match_prefix(hashes[:max_blocks])

    def demand(self) -> list[PrefillChunk]:
        """Rows each candidate wants, in order (for the budget's prediction only)."""
        room = self.config.max_running - self.scheduler.num_running
        chunks = []
        for request in self.ordered:
            if _is_waiting(request):
                if room <= 0:
                    continue
                room -= 1
                start = len(self.prefix_hits(request)) * self.config.block_size
            else:
                start = request.num_computed
            chunks.append(PrefillChunk(rows=request.num_tokens - start, history=start))
        return chunks

    def plan(self, row_budget: int) -> tuple[list[Lane], list[Request]]:
        """The prefill lanes for `row_budget` rows, and the requests overtaken by them."""
        if row_budget <= 0:
            return [], []
        left = min(row_budget, self.config.row_ceiling - len(self.decode_lanes))
        reserve = len(self.scheduler.decoding_streams())
        lanes: list[Lane] = []
        for request in self.ordered:
            if left <= 0:
                break
            lane = self._plan_one(request, left, reserve)
            if lane is None:
                break
            lanes.append(lane)
            left -= lane.rows
        overtaken = count_overtakes(self.ordered, {lane.request_id for lane in lanes})
        if not lanes and not self.decode_lanes:
            lanes = self._plan_running_alone(row_budget)
        return self._place_paths(lanes), overtaken

    def _plan_one(self, request: Request, left: int, reserve: int) -> Lane | None:
        size = self.config.block_size
        blocks = self.scheduler.blocks
        if _is_waiting(request):
            if self.scheduler.num_running >= self.config.max_running:
                return None
            hits = self.prefix_hits(request)
            start, have = len(hits) * size, len(hits)
            available = blocks.num_free_blocks - blocks.num_evictable_among(hits) - reserve
        else:
            start, have = request.num_computed, len(request.block_ids)
            available = blocks.num_free_blocks
        rows = min(request.num_tokens - start, left, (have + available) * size - start)
        if rows <= 0:
            return None
        if _is_waiting(request):
            self.scheduler.admit(request, hits)
        if not self.scheduler.grow(request, start + rows):
            raise RuntimeError("KV accounting error: a fitted chunk could not get its blocks")
        return self.scheduler.make_lane(request, LaneKind.PREFILL, rows)

    def _plan_running_alone(self, row_budget: int) -> list[Lane]:
        left = min(row_budget, self.config.row_ceiling)
        lanes = []
        for request in self.ordered:
            if left <= 0:
                break
            if _is_waiting(request):
                continue
            lane = self._plan_one(request, left, reserve=0)
            if lane is not None:
                lanes.append(lane)
                left -= lane.rows
        return lanes

    def _place_paths(self, lanes: list[Lane]) -> list[Lane]:
        """With the ANE lane on and idle, move the last prefill chunk there if it is predicted to finish first
        alone on the ANE than with the rest of the step on the GPU (ties and unknowns stay on the GPU)."""
        if not self.config.ane_lane or not lanes:
            return lanes
        if any(r.in_flight_path == Path.ANE.value for r in self.scheduler.running_requests()):
            return lanes
        candidate = lanes[-1]
        model = self.scheduler.cost_model
        gpu_chunks = tuple(PrefillChunk(lane.rows, lane.history) for lane in lanes)
        gpu_ms = model.predict(StepShape(gpu_chunks, len(self.decode_lanes), Path.GPU))
        ane_ms = model.predict(StepShape((PrefillChunk(candidate.rows, candidate.history),), 0, Path.ANE))
        if gpu_ms is None or ane_ms is None or ane_ms >= gpu_ms:
            return lanes
        return [*lanes[:-1], replace(candidate, path=Path.ANE)]
