"""The scheduler: every step, which decode lanes run, which prompts get prefill rows and how many, and where.

The engine loop is three calls: `plan = scheduler.schedule(now)`, `outcome = runner.execute(plan)`,
`scheduler.update(plan, outcome, now)`. Rules (SCHEDULER.md): decode lanes first (a stream that cannot get a
block preempts the newest running request by recomputation); then prefill rows, priority class first, then
overtaken-K-times, then shortest remaining; a row budget from `budget.py`; KV admission with a decode reserve.
Requests at the pool's edge finish LENGTH: a request never grows past the whole pool.

Window space (a model with sliding-window layers, `SchedulerConfig.window_blocks`): those layers' KV lives in a second
block space, one table per request index for index with the first. A block there is freed once it falls more than
`window_tokens` behind the request's next row (a published one stays cached), so a long request holds a window of
blocks there, not its length. A prefix hit counts only as far as the window space also holds the window before its
end: the hit is cut back to the longest cached prefix whose last `window_tokens` positions are cached in both.
"""

from __future__ import annotations

from scheduler.budget import (
    RATE_GROWTH_CAP,
    BudgetDecision,
    choose_row_budget,
    fill_stand_in,
    slack_allowance_ms,
    stream_in_debt,
)
from scheduler.chain_memo import ChainMemo
from scheduler.config import SchedulerConfig
from scheduler.cost_models import make_cost_model
from scheduler.errors import QueueFull, RequestTooLarge
from scheduler.first_runs import FirstRunPrice
from scheduler.kv_blocks import BlockManager, extend_hash_chain
from scheduler.learning import predict_planned_gpu_ms, train_cost_model
from scheduler.plan import NO_BLOCK, Lane, LaneKind, SnapshotPoint, StepOutcome, StepPlan
from scheduler.prefill import PrefillPlanner
from scheduler.request import FinishReason, Request, RequestState
from scheduler.speculation import DraftSource, PromptLookup
from scheduler.state_snapshots import StateSnapshots
from scheduler.stats import SchedulerStats
from scheduler.step_target import StepTarget
from scheduler.traced_shapes import TracedShapes
from scheduler.tracing_hooks import emit_admitted, emit_step_planned
from tracing.sink import NULL_SINK, TraceSink

_HOLDS_KV = (RequestState.PREFILLING, RequestState.DECODING)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, trace: TraceSink = NULL_SINK, traced_shapes: TracedShapes | None = None,
        drafts: DraftSource | None = None,
    ) -> None:
        self.config = config
        # speculative decoding's drafts (requests with `speculate` > 0): prompt lookup unless the engine has a draft model
        self.drafts = drafts or PromptLookup(config.speculative_ngram)
        self.trace = trace
        self.traced_shapes = traced_shapes  # which steps the engine runs compiled (None: it compiles no prefill)
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_cache)
        self.window_space = (
            BlockManager(config.window_blocks, config.block_size, config.enable_prefix_cache)
            if config.window_blocks
            else None
        )
        # a recurrent model's state at block boundaries, where prefix hits of such a model must end
        self.snapshots = StateSnapshots(config.state_snapshots) if config.recurrent_state else None
        self.chains = ChainMemo(config.recent_chain_tokens if config.enable_prefix_cache else 0, config.block_size)
        self.cost_model = make_cost_model(
            config.resolved_cost_model(), config.kv_bucket, config.cost_trust_factor, config.pads_history,
            config.cost_residual_weight,
        )
        self.step_target = StepTarget(config.step_target_ms, config.step_target_factor, config.step_target_floor_ms)
        self.first_runs = FirstRunPrice()  # what one-off steps ran over their prices (`config.price_first_runs`)
        self.stats = SchedulerStats()
        self.max_len = min(config.max_model_len, config.pool_tokens)
        self._waiting: list[Request] = []  # WAITING or PREEMPTED: no KV held
        self._running: list[Request] = []  # PREFILLING or DECODING: hold KV, oldest admission first
        self._live: dict[str, Request] = {}
        self._released: list[str] = []
        self._arrivals = 0
        self._step_id = 0
        self._last_step_was_debt = False
        self._last_update_had_prefill = False  # a slow last gap is prefill's fault only if it carried some
        # whether the last planned / the last reported step was grown for its prefill rate (`grow_for_rate`)
        self._planned_rate_grown = False
        self._reported_rate_grown = False

    # ---- queries
    @property
    def has_work(self) -> bool:
        return bool(self._live)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def get(self, request_id: str) -> Request | None:
        return self._live.get(request_id)

    def requests(self) -> list[Request]:
        """Every unfinished request, running ones first."""
        return [*self._running, *self._waiting]

    # ---- arrivals and departures
    def add(self, request: Request) -> None:
        """Queue a request; raises QueueFull past the queue limit, RequestTooLarge if it can never fit."""
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already queued or running")
        if not request.prompt_ids or request.max_tokens < 1:
            raise ValueError("a request needs a non-empty prompt and max_tokens >= 1")
        needed = -(-len(request.prompt_ids) // self.config.block_size)
        if needed > self.config.num_blocks:
            raise RequestTooLarge(
                f"prompt of {len(request.prompt_ids)} tokens needs {needed} KV blocks; the pool has "
                f"{self.config.num_blocks} ({self.config.pool_tokens} tokens)"
            )
        if len(self._waiting) >= self.config.queue_limit:
            raise QueueFull(f"{len(self._waiting)} requests are waiting (limit {self.config.queue_limit})")
        request.state = RequestState.WAITING
        request.arrival_seq = self._arrivals
        self._arrivals += 1
        self._waiting.append(request)
        self._live[request.request_id] = request

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> Request | None:
        """Finish a request in any state, freeing its KV at once; None if it is unknown or already finished."""
        request = self._live.get(request_id)
        if request is None:
            return None
        self._finish(request, reason)
        return request

    # ---- the step
    def schedule(self, now: float) -> StepPlan:
        """Plan one step (possibly empty)."""
        self._step_id += 1
        preempted: list[str] = []
        while True:
            decode_lanes = self._plan_decodes(preempted)
            planner = PrefillPlanner(self, decode_lanes)
            decision = self._choose_budget(planner, decode_lanes, now)
            prefill_lanes, overtaken = planner.plan(decision.row_budget)
            if decode_lanes or prefill_lanes or not self._stalled():
                break
            preempted.append(self._preempt(self._running[-1]).request_id)
        self._last_step_was_debt = decision.reason == "decode-debt"
        self._planned_rate_grown = "+rate" in decision.reason
        self.stats.decode_debt_steps += self._last_step_was_debt
        self.stats.budget_halvings += decision.halvings
        self.stats.overtakes += len(overtaken)
        lanes = (*decode_lanes, *prefill_lanes)
        for lane in lanes:
            self._live[lane.request_id].in_flight_path = lane.path.value
        plan = StepPlan(
            step_id=self._step_id,
            lanes=lanes,
            row_budget=decision.row_budget,
            budget_reason=decision.reason,
            predicted_ms=(
                predict_planned_gpu_ms(self.cost_model, lanes, self.traced_shapes,
                                       decision.limit_ms if self.config.price_stand_in_runs else None)
                if prefill_lanes and "+stand-in" not in decision.reason  # a stand-in's step costs its trace's run
                else decision.predicted_ms
            ),
            contended=decision.reason != "uncontended",
            released_request_ids=tuple(self._released),
            preempted_request_ids=tuple(preempted),
            limit_ms=decision.limit_ms,
        )
        self._released.clear()
        if self.trace.enabled:
            emit_step_planned(self.trace, plan, decision, overtaken)
        return plan

    def update(self, plan: StepPlan, outcome: StepOutcome, now: float) -> list[Request]:
        """Apply a step's outcome; returns the requests that got a token (finished ones are FINISHED)."""
        got_token: list[Request] = []
        for lane in plan.lanes:
            request = self._live.get(lane.request_id)
            ran = request is not None and request.state in _HOLDS_KV and request.num_computed == lane.start
            self._settle_snapshots(lane, request, ran and lane.request_id not in outcome.failed)
            if not ran:
                continue  # cancelled (or otherwise released) while the step ran
            request.in_flight_path = None
            if lane.request_id in outcome.failed:
                self._finish(request, FinishReason.ERROR)
                continue
            self.stats.count_lane(lane, plan.contended)
            # a draft's KV counts where the model agreed with it; the rest is written over by the next rows
            accepted = outcome.accepted_drafts.get(lane.request_id, ())[: lane.drafts]
            request.num_computed = lane.end - lane.drafts + len(accepted)
            self.stats.accepted_draft_tokens += len(accepted)
            if lane.drafts:
                self.drafts.observe(request, len(accepted))
            self._publish_full_blocks(request)
            self._drop_behind_window(request)
            if not lane.samples:
                request.state = RequestState.PREFILLING
                continue
            token = outcome.sampled_tokens.get(lane.request_id)
            if token is None:
                self._finish(request, FinishReason.ERROR)
                continue
            before = len(request.output_ids)
            for committed in (*accepted, token):
                self._append_token(request, committed, now)
                if request.state is RequestState.FINISHED:
                    break
            request.new_tokens = len(request.output_ids) - before
            got_token.append(request)
        for request_id in outcome.failed:
            if request_id in self._live:
                self._finish(self._live[request_id], FinishReason.ERROR)
        if plan.lanes:
            self.stats.steps += 1
            self._last_update_had_prefill = plan.prefill_rows > 0
            self._reported_rate_grown = "+rate" in plan.budget_reason
        self._learn(plan, outcome)
        return got_token

    def abandon(self, plan: StepPlan, updated: bool = False) -> None:
        """A planned step that failed (the engine cancels its requests): the snapshots its lanes were to write are
        dropped and those they were to read let go; `updated`: it failed after its update (a step left in flight), so
        the snapshots it wrote are kept already: they are forgotten, what they hold unknown."""
        if self.snapshots is None:
            return
        for lane in plan.lanes:
            if not updated:
                self._settle_snapshots(lane, None, ran=False)
            elif lane.snapshot is not None:
                self.snapshots.forget(slot=lane.snapshot.slot)

    def observe(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """Learn a step's measured time when it was updated before it was known (a step left in flight is updated
        with placeholder tokens and no time, which the cost model and the step target ignore)."""
        self._learn(plan, outcome)

    def _learn(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """A step's measured time: the cost model learns contended steps, the step target decode-only ones."""
        train_cost_model(self.cost_model, plan, outcome)
        if self.config.price_first_runs:
            self.first_runs.observe(plan, outcome)
        self.step_target.observe(plan, outcome)

    # ---- internals used by PrefillPlanner
    def admit(self, request: Request, hit_blocks: list[int], window_hits: list[int] | None = None) -> None:
        """Move a waiting request to running, holding its prefix-cache hits (`grow` adds fresh blocks) and, with a
        window space, the window's blocks before their end (`window_hits`' table)."""
        self.blocks.acquire(hit_blocks)
        cached_tokens = len(hit_blocks) * self.config.block_size
        request.block_ids = list(hit_blocks)
        if self.window_space is not None:
            table = self.window_hits(request, len(hit_blocks)) if window_hits is None else window_hits
            request.window_first = self.window_first(cached_tokens)
            self.window_space.acquire(table[request.window_first :])
            request.window_block_ids = list(table)
        request.num_computed = cached_tokens
        request.num_published_blocks = len(hit_blocks)
        if self.snapshots is not None and hit_blocks:  # its first lane reads the state where the hit ends
            request.restore_slot = self.snapshots.pin(request.block_hashes[len(hit_blocks) - 1])
        if request.times_preempted == 0:
            request.num_cached_tokens = cached_tokens
        request.state = RequestState.PREFILLING
        self.stats.prefix_hit_tokens += cached_tokens
        self._waiting.remove(request)
        self._running.append(request)
        if self.trace.enabled:
            emit_admitted(self.trace, request, cached_tokens)

    def recurrent_prefix(self, request: Request, hits: list[int]) -> list[int]:
        """`hits` (which `windowed_prefix` cut) cut back to the longest prefix ending where a snapshot of the recurrent
        state is kept and the window space still holds the window before its end (all of `hits` for a model without
        recurrent layers)."""
        if self.snapshots is None:
            return hits
        for count in range(len(hits), 0, -1):
            if self.snapshots.slot_of(request.block_hashes[count - 1]) is not None and self._window_holds(request, count):
                return hits[:count]
        return []

    def _window_holds(self, request: Request, num_blocks: int) -> bool:
        """Whether the window space keeps every block the window before a prefix of `num_blocks` blocks reaches."""
        if self.window_space is None:
            return True
        first = self.window_first(num_blocks * self.config.block_size)
        return all(self.window_space.cached_block(h) is not None for h in request.block_hashes[first:num_blocks])

    def window_first(self, next_position: int) -> int:
        """The first block a request whose next row is at `next_position` keeps in the window space: the one holding
        the earliest position that row's window reaches (later rows reach no earlier)."""
        return max(0, next_position - self.config.window_tokens + 1) // self.config.block_size

    def window_hits(self, request: Request, num_blocks: int) -> list[int]:
        """The window-space table of a prefix hit of `num_blocks` blocks (which `windowed_prefix` checked cached)."""
        first = self.window_first(num_blocks * self.config.block_size)
        hashes = request.block_hashes[first:num_blocks]
        return [NO_BLOCK] * first + [self.window_space.cached_block(block_hash) for block_hash in hashes]

    def windowed_prefix(self, request: Request, hits: list[int]) -> list[int]:
        """`hits` cut back to the longest prefix the window space can continue: its window's blocks before its end
        cached there too (all of `hits` without a window space)."""
        if self.window_space is None or not hits:
            return hits
        best = run = 0
        for index, block_hash in enumerate(request.block_hashes[: len(hits)]):
            run = run + 1 if self.window_space.cached_block(block_hash) is not None else 0
            if run >= index + 1 - self.window_first((index + 1) * self.config.block_size):
                best = index + 1
        return hits[:best]

    def waiting_requests(self) -> list[Request]:
        return list(self._waiting)

    def running_requests(self) -> list[Request]:
        return list(self._running)

    def decoding_streams(self) -> list[Request]:
        return [r for r in self._running if r.state is RequestState.DECODING]

    # ---- internals
    def _plan_decodes(self, preempted: list[str]) -> list[Lane]:
        """One lane per decoding stream, oldest admission first; the newest running request is preempted
        whenever a stream cannot get the block its next row needs (never for a draft's rows)."""
        lanes: list[Lane] = []
        rows = 0
        for request in list(self._running):
            if rows >= self.config.row_ceiling:
                break
            if request.state is not RequestState.DECODING or request.in_flight_path is not None:
                continue
            while not self.grow(request, request.num_computed + 1):
                preempted.append(self._preempt(self._newest_preemptable()).request_id)
                if request.state is not RequestState.DECODING:
                    break
            if request.state is RequestState.DECODING:
                drafts = self._drafts(request, self.config.row_ceiling - rows - 1)
                lanes.append(self.make_lane(request, LaneKind.DECODE, 1, drafts))
                rows += 1 + len(drafts)
        return lanes

    def _drafts(self, request: Request, most_rows: int) -> tuple[int, ...]:
        """Tokens to verify after the request's next row: as many as it may still generate past the next one, within
        the rows left and the blocks free (a draft never preempts)."""
        if not request.speculate:
            return ()
        most = min(request.speculate, most_rows, request.max_tokens - len(request.output_ids) - 1,
                   self.max_len - request.num_tokens - 1)  # fmt: skip
        if most <= 0:
            return ()
        drafts = self.drafts.propose(request, most)
        return drafts if drafts and self.grow(request, request.num_computed + 1 + len(drafts)) else ()

    def _choose_budget(self, planner: PrefillPlanner, decode_lanes: list[Lane], now: float) -> BudgetDecision:
        in_debt = False
        target = self.step_target.ms
        shapes = self.traced_shapes
        traced = None if shapes is None else lambda chunks: shapes.traced(chunks, decode_lanes)
        met = None if shapes is None else lambda chunks: shapes.met(chunks, decode_lanes)
        stand_in_ms = (
            (lambda chunks, limit: shapes.stand_in_run_ms(chunks, decode_lanes, limit))
            if self.config.price_stand_in_runs and shapes is not None
            else None
        )
        demand = planner.demand()
        contended = bool(decode_lanes) or bool(self.decoding_streams())  # a stream in flight still streams
        # what a contended step may take: the budget plans to it and decode debt counts from it
        allowance = (
            slack_allowance_ms(self.config, self.cost_model, demand, len(decode_lanes), target, traced)
            if contended
            else target
        )
        if self.config.decode_debt and decode_lanes and not self._last_step_was_debt:
            # a step grown for its prefill rate may be predicted at up to RATE_GROWTH_CAP x the allowance: a gap
            # that long is the plan, not a debt (else every grown step is followed by a decode-only one)
            grown = RATE_GROWTH_CAP if self._planned_rate_grown or self._reported_rate_grown else 1.0
            debt_ms = allowance * grown * self.config.debt_tolerance
            in_debt = any(
                stream_in_debt(now - r.last_token_time, r.last_token_gap if self._last_update_had_prefill else None,
                               debt_ms)
                for r in self.decoding_streams()
                if r.last_token_time is not None
            )
        decision = choose_row_budget(
            self.config, self.cost_model, demand, len(decode_lanes), in_debt, contended, target, traced, allowance, met,
            self.first_runs.extra_ms if self.config.price_first_runs else 0.0, stand_in_ms,
        )
        if decision.wanted and shapes is not None:
            shapes.want(decision.wanted, decode_lanes)
            self.stats.traces_wanted += 1
        if self.config.fill_stand_ins and shapes is not None and decision.row_budget:
            limit = decision.limit_ms
            decision = fill_stand_in(decision, demand, lambda chunks: shapes.stand_in(chunks, decode_lanes, limit))
        return decision

    def _stalled(self) -> bool:
        """Nothing could be planned although requests hold KV and none of them is in flight."""
        return bool(self._running) and all(r.in_flight_path is None for r in self._running)

    def _newest_preemptable(self) -> Request:
        for request in reversed(self._running):
            if request.in_flight_path is None:
                return request
        raise RuntimeError("every running request is in flight: nothing can be preempted")

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Give `request` blocks covering `num_tokens` positions; False (changing nothing) if the pool is out."""
        needed = -(-num_tokens // self.config.block_size) - len(request.block_ids)
        if needed <= 0:
            return True
        windows = self.window_space
        if windows is not None and not windows.can_allocate(needed):
            return False
        fresh = self.blocks.allocate(needed)
        if fresh is None:
            return False
        request.block_ids.extend(fresh)
        if windows is not None:
            request.window_block_ids.extend(windows.allocate(needed))
        return True

    def make_lane(self, request: Request, kind: LaneKind, rows: int, drafts: tuple[int, ...] = ()) -> Lane:
        start = request.num_computed
        end = start + rows
        blocks = -(-(end + len(drafts)) // self.config.block_size)
        restore, request.restore_slot = request.restore_slot, None
        return Lane(
            request_id=request.request_id,
            kind=kind,
            token_ids=request.tokens(start, end) + drafts,
            start=start,
            block_ids=tuple(request.block_ids[:blocks]),
            samples=end == request.num_tokens,
            drafts=len(drafts),
            window_block_ids=tuple(request.window_block_ids[:blocks]),
            restore_slot=restore,
            snapshot=self._snapshot_point(request, kind, start, end + len(drafts)),
        )

    def _snapshot_point(self, request: Request, kind: LaneKind, start: int, end: int) -> SnapshotPoint | None:
        """Where a lane leaves a snapshot of its state: a prefill lane at the last block boundary its rows pass, a
        decode lane where its row ends a block (None: neither, the model has no recurrent state, or no slot is free).
        A decode lane's block ends with the token the step before samples: it is hashed when this step is reported."""
        if self.snapshots is None:
            return None
        size = self.config.block_size
        boundary = end // size * size
        if boundary <= start or (kind is LaneKind.DECODE and boundary != end):
            return None
        block_hash = self.block_hashes(request, boundary // size)[boundary // size - 1] if kind is LaneKind.PREFILL else None
        slot = self.snapshots.reserve(block_hash)
        return SnapshotPoint(boundary, slot, block_hash) if slot is not None else None

    def _settle_snapshots(self, lane: Lane, request: Request | None, ran: bool) -> None:
        """After a lane's step: the snapshot it read may go, the one it wrote may be read (or is dropped unwritten).
        A request keeps one snapshot from its decode lanes, the latest: where its next turn's prompt may go on."""
        if self.snapshots is None:
            return
        if lane.restore_slot is not None:
            self.snapshots.unpin(lane.restore_slot)
        point = lane.snapshot
        if point is None:
            return
        if not ran or request is None:
            self.snapshots.discard(point.slot)
            return
        size = self.config.block_size
        block_hash = point.block_hash or self.block_hashes(request, point.position // size)[point.position // size - 1]
        self.snapshots.confirm(point.slot, block_hash)
        if lane.kind is LaneKind.DECODE:
            if request.decode_snapshot is not None and request.decode_snapshot != block_hash:
                self.snapshots.forget(request.decode_snapshot)
            request.decode_snapshot = block_hash

    def _preempt(self, request: Request) -> Request:
        self._release_blocks(request)
        request.num_computed = 0
        request.state = RequestState.PREEMPTED
        request.times_preempted += 1
        self._running.remove(request)
        self._waiting.append(request)
        self._released.append(request.request_id)
        self.stats.preemptions += 1
        return request

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.state in _HOLDS_KV:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.chains.remember(request)
        self._release_blocks(request)
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.in_flight_path = None
        del self._live[request.request_id]
        self._released.append(request.request_id)

    def _release_blocks(self, request: Request) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []
        request.num_published_blocks = 0
        if self.window_space is not None:
            self.window_space.free(request.window_block_ids[request.window_first :])
            request.window_block_ids = []
            request.window_first = 0

    def _drop_behind_window(self, request: Request) -> None:
        """Free the window-space blocks no later row of the request reads (published ones stay cached)."""
        if self.window_space is None:
            return
        first = self.window_first(request.num_computed)
        if first <= request.window_first:
            return
        table = request.window_block_ids
        self.window_space.free(table[request.window_first : first])
        table[request.window_first : first] = [NO_BLOCK] * (first - request.window_first)
        request.window_first = first

    def _append_token(self, request: Request, token: int, now: float) -> None:
        request.output_ids.append(token)
        if request.last_token_time is not None:
            request.last_token_gap = now - request.last_token_time
        request.last_token_time = now
        request.state = RequestState.DECODING
        if token in request.stop_token_ids:
            self._finish(request, FinishReason.STOP)
        elif len(request.output_ids) >= request.max_tokens or request.num_tokens >= self.max_len:
            self._finish(request, FinishReason.LENGTH)

    def _publish_full_blocks(self, request: Request) -> None:
        """Offer every full, computed block to the prefix cache once."""
        full = request.num_computed // self.config.block_size
        if full <= request.num_published_blocks or not self.config.enable_prefix_cache:
            return
        hashes = self.block_hashes(request, full)
        windows = self.window_space
        for index in range(request.num_published_blocks, full):
            self.blocks.register(request.block_ids[index], hashes[index])
            if windows is not None and index >= request.window_first:
                windows.register(request.window_block_ids[index], hashes[index])
        request.num_published_blocks = full

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The chained hashes of the request's first `num_blocks` full blocks (computed once, kept)."""
        return extend_hash_chain(request.block_hashes, request, num_blocks, self.config.block_size, request.hashed_tokens)
