"""Prefill rows for one step: fill the row budget in prefill order, admitting waiting requests while KV allows.

- Waiting requests are admitted only while fewer than `max_running` hold KV.
- Every chunk must leave a reserve for the requests admitted before it: one block per decoding stream (so
  running decodes can grow) plus the blocks each running prefill still needs to finish its prompt. So the
  oldest running request can always proceed and a newcomer never strands anyone (no admission livelock).
- A chunk is cut to the budget left and to the blocks it may take. The first waiting request that cannot be
  admitted stops admission for the step; running prefills behind it still run. A request that could not get a
  row was blocked by memory, not passed by policy, so it is not counted as overtaken.
- A waiting request whose next `shared_prefill_tokens` uncached prompt tokens a running prefill is computing (the
  same tokens and salt: equal chained hashes) is not admitted yet: it waits for them to be published and then takes
  them from the prefix cache, instead of computing the shared prefix again beside it (a burst over one system
  prompt, n > 1). It holds no KV and stops no one's admission, and it chose to wait, so it is not counted as
  overtaken either. A shorter shared run is computed again: the wait would cost a step to save a few rows. A step
  holds at most as many requests as it has free running slots, so a long queue is not all hashed in one step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from scheduler.cost_models import PrefillChunk, StepShape
from scheduler.ordering import count_overtakes, order_prefill_candidates
from scheduler.plan import PENDING_TOKEN, Lane, LaneKind, Path
from scheduler.request import Request, RequestState

PREFIX_PROBE_BLOCKS = 16  # blocks hashed before the prefix cache is asked; doubled while all hit

if TYPE_CHECKING:
    from scheduler.core import Scheduler


def _is_waiting(request: Request) -> bool:
    return request.state in (RequestState.WAITING, RequestState.PREEMPTED)


class PendingBlocks:
    """Chained hashes of prompt blocks that running prefills have yet to compute, for `awaits_shared_block`: per
    span of blocks [first, last] asked about, the hash at `last` of every request that will compute the whole span.
    A burst's waiting requests ask about the same span, so each is one set lookup, not a scan of the prefills."""

    def __init__(self, scheduler: Scheduler, requests: list[Request]) -> None:
        self.scheduler = scheduler
        self.requests = list(requests)
        self._spans: dict[tuple[int, int], set[bytes]] = {}

    def add(self, request: Request) -> None:
        """A request admitted in this step: its chunk's blocks are pending for the requests behind it."""
        self.requests.append(request)
        for (first, last), hashes in self._spans.items():
            self._note(hashes, request, first, last)

    def computing(self, first: int, last: int, last_hash: bytes) -> bool:
        """Whether a request with hash `last_hash` at block `last` will compute blocks [first, last] whole."""
        hashes = self._spans.get((first, last))
        if hashes is None:
            hashes = self._spans[(first, last)] = set()
            for request in self.requests:
                self._note(hashes, request, first, last)
        return last_hash in hashes

    def _note(self, hashes: set[bytes], request: Request, first: int, last: int) -> None:
        size = self.scheduler.config.block_size
        if not request.num_computed < (first + 1) * size <= (last + 1) * size <= request.num_prompt_tokens:
            return  # it computed those blocks already (then they are cached), or will not compute them all
        if first - len(request.block_hashes) > PREFIX_PROBE_BLOCKS:
            return  # its chain ends far before the span: not worth hashing its prompt ahead for
        hashes.add(self.scheduler.block_hashes(request, last + 1)[last])


class PrefillPlanner:
    def __init__(self, scheduler: Scheduler, decode_lanes: list[Lane]) -> None:
        self.scheduler = scheduler
        self.config = scheduler.config
        self.decode_lanes = decode_lanes
        running = scheduler.running_requests()
        prefilling = [r for r in running if r.state is RequestState.PREFILLING and r.in_flight_path is None]
        self.has_room = len(running) < self.config.max_running
        waiting = scheduler.waiting_requests() if self.has_room else []
        # a request preempted while its last token is still being sampled waits until the engine fills it in
        waiting = [r for r in waiting if r.token_at(r.num_tokens - 1) != PENDING_TOKEN]
        self.ordered = order_prefill_candidates([*prefilling, *waiting], self.config.max_overtakes)
        self._pending = PendingBlocks(scheduler, [r for r in running if r.state is RequestState.PREFILLING])

    def prefix_hits(self, request: Request) -> list[int]:
        """Cached blocks for the request's leading full blocks, never covering its last token.

        The hash chain grows (doubling) only while every block so far is cached: a new 30k-token prompt without a
        cached prefix hashes 16 blocks on the engine thread, not 1,900 (the rest as its chunks complete)."""
        if not self.config.enable_prefix_cache or not request.reads_prefix_cache:
            return []
        max_blocks = (request.num_tokens - 1) // self.config.block_size
        # a prompt with no chain yet that repeats a remembered one copies its hashes (`chain_memo.py`)
        self.scheduler.stats.recalled_hash_blocks += self.scheduler.chains.recall(request)
        want = min(max_blocks, PREFIX_PROBE_BLOCKS)
        hits: list[int] = []
        while True:  # each round matches only the blocks past the last one's hits
            hits = self.scheduler.blocks.match_prefix(self.scheduler.block_hashes(request, want)[:want], hits)
            if len(hits) < want or want == max_blocks:
                return self.scheduler.recurrent_prefix(request, self.scheduler.windowed_prefix(request, hits))
            want = min(max_blocks, 2 * want)

    def awaits_shared_block(self, request: Request, hits: list[int], pending: PendingBlocks) -> bool:
        """Whether the waiting request's next `shared_prefill_tokens` past `hits` (its cached prefix) are ones a
        request of `pending` has yet to compute, over the same tokens and salt (see the module's rules)."""
        size, first = self.config.block_size, len(hits)
        wanted = -(-self.config.shared_prefill_tokens // size)  # blocks
        last = first + wanted - 1  # equal chained hashes there: equal tokens and salt up to it
        if not wanted or not self.config.enable_prefix_cache or last >= (request.num_tokens - 1) // size:
            return False  # off, or fewer full blocks left before its last token (hits never cover it)
        if not request.reads_prefix_cache:
            return False  # it computes every row whatever is cached
        return pending.computing(first, last, self.scheduler.block_hashes(request, last + 1)[last])

    def demand(self) -> list[PrefillChunk]:
        """Rows each candidate wants, in order (for the budget's prediction only)."""
        room = self.config.max_running - self.scheduler.num_running
        chunks = []
        pending = PendingBlocks(self.scheduler, self._pending.requests)  # and the waiting ones this step would admit
        for request in self.ordered:
            if _is_waiting(request):
                if room <= 0:
                    continue
                room -= 1  # a held one counts too, as in `plan`
                hits = self.prefix_hits(request)
                if self.awaits_shared_block(request, hits, pending):
                    continue
                pending.add(request)
                start = len(hits) * self.config.block_size
            else:
                start = request.num_computed
            chunks.append(PrefillChunk(rows=request.num_tokens - start, history=start))
        return chunks

    def plan(self, row_budget: int) -> tuple[list[Lane], list[Request]]:
        """The prefill lanes for `row_budget` rows, and the requests overtaken by them."""
        if row_budget <= 0:
            return [], []
        left = min(row_budget, self.config.row_ceiling - sum(lane.rows for lane in self.decode_lanes))
        lanes: list[Lane] = []
        eligible: list[Request] = []  # could have run this step: only these can be overtaken
        admitting = True
        # waiting requests held for a shared prefix, at most as many as there are free running slots: the rest of a
        # burst's queue is looked at (and its prompts hashed) in later steps, not all in this one
        holds = self.config.max_running - self.scheduler.num_running
        for request in self.ordered:
            waiting = _is_waiting(request)
            if waiting and not admitting:
                continue
            if left <= 0:
                eligible.append(request)
                continue
            hits: list[int] = []
            if waiting and self.scheduler.num_running < self.config.max_running:
                hits = self.prefix_hits(request)
                if self.awaits_shared_block(request, hits, self._pending):
                    self.scheduler.stats.shared_prefill_waits += 1
                    holds -= 1
                    admitting = holds > 0
                    continue
            lane = self._plan_one(request, left, hits)
            if lane is not None:
                eligible.append(request)
                lanes.append(lane)
                left -= lane.rows
                if waiting:  # admitted: the blocks of its chunk are pending for those behind it in this step too
                    self._pending.add(request)
            elif waiting:
                admitting = False  # out of KV or running slots: stop admitting, keep feeding running prefills
        overtaken = count_overtakes(eligible, {lane.request_id for lane in lanes})
        return self._place_paths(lanes), overtaken

    def _reserve(self, request: Request) -> tuple[int, int]:
        """Blocks the request must leave free for those admitted before it: one per decoding stream (its next
        row may open a block) and what each prefilling one still needs to finish its prompt. So the oldest
        running request can always proceed, and a newcomer never strands anyone. Second, the same in the window
        space, where a prefill that frees its blocks behind as it goes is kept at most a window's worth."""
        size = self.config.block_size
        reserve = window_reserve = 0
        for other in self.scheduler.running_requests():
            if other is request:
                break
            if other.state is RequestState.DECODING:
                reserve += 1
                window_reserve += 1
            else:
                needs = max(0, -(-other.num_tokens // size) - len(other.block_ids))
                reserve += needs
                window_reserve += min(needs, self.config.window_span_blocks)
        return reserve, window_reserve

    def _plan_one(self, request: Request, left: int, hits: list[int]) -> Lane | None:
        """A lane of up to `left` rows for the request, admitting it if it waits (`hits`: its cached prefix); None
        if it gets no row."""
        size = self.config.block_size
        blocks, windows = self.scheduler.blocks, self.scheduler.window_space
        waiting = _is_waiting(request)
        reserve, window_reserve = self._reserve(request)
        window_hits: list[int] | None = None
        if waiting:
            if self.scheduler.num_running >= self.config.max_running:
                return None
            start, have = len(hits) * size, len(hits)
            available = blocks.num_free_blocks - blocks.num_evictable_among(hits) - reserve
            if windows is not None:
                window_hits = self.scheduler.window_hits(request, len(hits))
                held = window_hits[self.scheduler.window_first(start) :]
                window_available = windows.num_free_blocks - windows.num_evictable_among(held) - window_reserve
        else:
            start, have = request.num_computed, len(request.block_ids)
            available = blocks.num_free_blocks - reserve
            window_available = windows.num_free_blocks - window_reserve if windows is not None else 0
        if windows is not None:  # both tables grow by the same blocks
            available = min(available, window_available)
        rows = min(request.num_tokens - start, left, (have + available) * size - start)
        if rows <= 0:
            return None
        if waiting:
            self.scheduler.admit(request, hits, window_hits)
        if not self.scheduler.grow(request, start + rows):
            raise RuntimeError("KV accounting error: a fitted chunk could not get its blocks")
        return self.scheduler.make_lane(request, LaneKind.PREFILL, rows)

    def _place_paths(self, lanes: list[Lane]) -> list[Lane]:
        """With the ANE lane on and idle, move the last prefill chunk there if it is predicted to finish first
        alone on the ANE than with the rest of the step on the GPU (ties and unknowns stay on the GPU)."""
        if not self.config.ane_lane or not lanes:
            return lanes
        if any(r.in_flight_path == Path.ANE.value for r in self.scheduler.running_requests()):
            return lanes
        candidate = lanes[-1]
        if self.scheduler.get(candidate.request_id).gpu_only:
            return lanes
        model = self.scheduler.cost_model
        gpu_chunks = tuple(PrefillChunk(lane.rows, lane.history) for lane in lanes)
        gpu_ms = model.predict(StepShape(gpu_chunks, len(self.decode_lanes), Path.GPU))
        ane_ms = model.predict(StepShape((PrefillChunk(candidate.rows, candidate.history),), 0, Path.ANE))
        if gpu_ms is None or ane_ms is None or ane_ms >= gpu_ms:
            return lanes
        return [*lanes[:-1], replace(candidate, path=Path.ANE)]
