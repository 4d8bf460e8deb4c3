"""A checking harness for property tests: a fake KV store that remembers what each block holds, and the checks
that every plan and every state must pass (the invariants of SCHEDULER.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler import LaneKind, Request, RequestState, Scheduler, StepOutcome, StepPlan
from scheduler.ordering import prefill_order_key
from scheduler.plan import NO_BLOCK


@dataclass
class Harness:
    scheduler: Scheduler
    kv: dict[tuple[int, int], tuple[str | None, int]] = field(default_factory=dict)  # (block, slot) -> (salt, token)
    window_kv: dict[tuple[int, int], tuple[str | None, int]] = field(default_factory=dict)  # the window space's
    steps_without_token: dict[str, int] = field(default_factory=dict)
    # a recurrent model's fake state: what (salt, tokens) each request's state has read, and each snapshot slot's
    states: dict[str, tuple] = field(default_factory=dict)
    snapshot_states: dict[int, tuple] = field(default_factory=dict)
    finished: dict[str, Request] = field(default_factory=dict)
    admitted: set[str] = field(default_factory=set)
    max_decode_wait: int = 0
    check_kv: bool = True  # replay every lane's history against the fake KV (quadratic: small runs only)

    @property
    def config(self):
        return self.scheduler.config

    # ---- one step with checks
    def step(self, now: float, elapsed_ms: float, token_for: dict[str, int] | None = None, accept: int = 0) -> StepPlan:
        """One step; a drafted lane's first `accept` drafts are agreed with (speculative decoding)."""
        before = {r.request_id: prefill_order_key(r, self.config.max_overtakes) for r in self.scheduler.requests()}
        decoding_before = {r.request_id for r in self.scheduler.requests() if r.state is RequestState.DECODING}
        plan = self.scheduler.schedule(now)
        for request_id in plan.preempted_request_ids:  # ordered after preemption, by its whole length
            priority, forced, _, seq = before[request_id]
            request = self.scheduler.get(request_id)
            before[request_id] = (priority, forced, 0 if forced == 0 else request.num_tokens, seq)
        self.check_plan(plan, before)
        self.check_blocks()
        self.write_kv(plan)
        self.run_states(plan)
        sampled = {lane.request_id: (token_for or {}).get(lane.request_id, 3) for lane in plan.lanes if lane.samples}
        accepted = {lane.request_id: lane.token_ids[1 : 1 + min(accept, lane.drafts)] for lane in plan.lanes
                    if lane.drafts}  # fmt: skip
        got = self.scheduler.update(plan, StepOutcome(sampled, elapsed_ms, accepted_drafts=accepted), now + 0.001)
        self.track_streams(plan, decoding_before, got)
        self.check_blocks()
        return plan

    def track_streams(self, plan: StepPlan, decoding_before: set[str], got: list[Request]) -> None:
        got_ids = {r.request_id for r in got}
        for request in got:
            if request.is_finished:
                self.finished[request.request_id] = request
        for request_id in decoding_before:
            request = self.scheduler.get(request_id)
            still_streaming = request is not None and request.state is RequestState.DECODING
            if request_id in got_ids or not still_streaming:
                self.steps_without_token.pop(request_id, None)
            elif plan.lanes:
                waited = self.steps_without_token.get(request_id, 0) + 1
                self.steps_without_token[request_id] = waited
                self.max_decode_wait = max(self.max_decode_wait, waited)
        for lane in plan.lanes:
            self.admitted.add(lane.request_id)

    def write_kv(self, plan: StepPlan) -> None:
        """What a runner would do: write each row's token into its block slot."""
        size = self.config.block_size
        for lane in plan.lanes:
            salt = self.scheduler.get(lane.request_id).cache_salt
            for offset, token in enumerate(lane.token_ids):
                position = lane.start + offset
                self.kv[(lane.block_ids[position // size], position % size)] = (salt, token)
                if self.scheduler.window_space is not None:
                    self.window_kv[(lane.window_block_ids[position // size], position % size)] = (salt, token)

    def run_states(self, plan: StepPlan) -> None:
        """What a runner does with a recurrent model's state: each lane starts from zeros at position 0, from the
        snapshot it restores, or from its request's own state, which must hold exactly the tokens before its first
        row; it leaves a snapshot where the lane says and its state after its last row."""
        if self.scheduler.snapshots is None:
            return
        size = self.config.block_size
        for lane in plan.lanes:
            request = self.scheduler.get(lane.request_id)
            salt = request.cache_salt
            if lane.restore_slot is not None:
                state = self.snapshot_states[lane.restore_slot]
            else:
                state = (salt, ()) if lane.start == 0 else self.states[lane.request_id]
            assert state == (salt, tuple(request.tokens(0, lane.start))), "a lane's state is not its own history"
            assert lane.restore_slot is None or lane.start > 0
            if lane.snapshot is not None:
                position = lane.snapshot.position
                assert lane.start < position <= lane.end and position % size == 0
                if lane.snapshot.block_hash is not None:  # a decode lane's block is hashed when it is reported
                    assert lane.snapshot.block_hash == request.block_hashes[position // size - 1]
                else:
                    assert lane.kind is LaneKind.DECODE and position == lane.end
                self.snapshot_states[lane.snapshot.slot] = (salt, tuple(request.tokens(0, position)))
            self.states[lane.request_id] = (salt, tuple(request.tokens(0, lane.end)))

    # ---- checks
    def check_plan(self, plan: StepPlan, keys_before: dict[str, tuple]) -> None:
        config, size = self.config, self.config.block_size
        assert plan.num_rows <= config.row_ceiling
        assert len({lane.request_id for lane in plan.lanes}) == len(plan.lanes), "one lane per request"
        for lane in plan.lanes:
            request = self.scheduler.get(lane.request_id)
            assert request is not None and request.state in (RequestState.PREFILLING, RequestState.DECODING)
            assert lane.start == request.num_computed and lane.rows >= 1
            known = lane.end - lane.drafts  # drafted rows run past the known tokens; no other row does
            assert known <= request.num_tokens, "a lane never runs past the known tokens"
            assert lane.samples == (known == request.num_tokens)
            assert lane.token_ids[: lane.rows - lane.drafts] == request.tokens(lane.start, known)
            assert known + lane.drafts + len(request.output_ids) - request.num_tokens < request.max_tokens or not lane.drafts
            assert request.num_tokens + lane.drafts < config.max_model_len or not lane.drafts
            assert len(lane.block_ids) == -(-lane.end // size)
            assert list(lane.block_ids) == request.block_ids[: len(lane.block_ids)]
            for position in range(lane.start if self.check_kv else 0):  # the history the lane attends to is this request's own tokens
                held = self.kv.get((lane.block_ids[position // size], position % size))
                assert held == (request.cache_salt, request.token_at(position)), f"KV mismatch at {position}"
            if self.scheduler.window_space is not None:
                self.check_window(lane, request)
            if lane.kind is LaneKind.DECODE:
                assert lane.rows == 1 + lane.drafts and lane.drafts <= request.speculate
            else:
                assert lane.drafts == 0
        self.check_prefill_order(plan, keys_before)

    def check_window(self, lane, request: Request) -> None:
        """The window space holds every position the lane's rows attend to, and its own rows' blocks."""
        size, window = self.config.block_size, self.config.window_tokens
        assert list(lane.window_block_ids) == request.window_block_ids[: len(lane.block_ids)]
        first = max(0, lane.start - window + 1)
        assert all(block != NO_BLOCK for block in lane.window_block_ids[first // size :])
        for position in range(first, lane.start):
            held = self.window_kv.get((lane.window_block_ids[position // size], position % size))
            assert held == (request.cache_salt, request.token_at(position)), f"window KV mismatch at {position}"

    def check_prefill_order(self, plan: StepPlan, keys_before: dict[str, tuple]) -> None:
        """Prefill lanes follow (priority, overtaken-K-times first, shortest remaining, arrival)."""
        keys = [keys_before[lane.request_id] for lane in plan.lanes if lane.kind is LaneKind.PREFILL]
        assert keys == sorted(keys), f"prefill lanes out of order: {keys}"

    def check_blocks(self) -> None:
        blocks = self.scheduler.blocks
        blocks.check_invariants()
        holders: dict[int, int] = {}
        for request in self.scheduler.requests():
            if request.state not in (RequestState.PREFILLING, RequestState.DECODING):
                assert request.block_ids == []
            for block_id in request.block_ids:
                holders[block_id] = holders.get(block_id, 0) + 1
            assert request.times_overtaken <= self.config.max_overtakes
            assert request.num_cached_tokens <= request.num_prompt_tokens - 1
        for block_id in range(blocks.num_blocks):
            assert blocks.ref_count(block_id) == holders.get(block_id, 0), "ref count != holders"
            if holders.get(block_id, 0) > 1:
                assert blocks.block_hash(block_id) is not None, "only cached blocks are shared"
        assert blocks.num_free_blocks + blocks.num_used_blocks == blocks.num_blocks
        if self.scheduler.window_space is not None:
            self.check_window_blocks()
        if self.scheduler.snapshots is not None:
            self.scheduler.snapshots.check_invariants()

    def check_window_blocks(self) -> None:
        """Each running request holds its window space's blocks from its window's first block on, and none before."""
        windows = self.scheduler.window_space
        windows.check_invariants()
        holders: dict[int, int] = {}
        for request in self.scheduler.requests():
            table = request.window_block_ids
            assert len(table) == len(request.block_ids)
            if not table:
                continue
            assert request.window_first == self.scheduler.window_first(request.num_computed)
            assert table[: request.window_first] == [NO_BLOCK] * request.window_first
            for block_id in table[request.window_first :]:
                assert block_id != NO_BLOCK
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id in range(windows.num_blocks):
            assert windows.ref_count(block_id) == holders.get(block_id, 0), "window ref count != holders"
