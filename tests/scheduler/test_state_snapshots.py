"""A recurrent model's prefix cache: snapshots of the state where prefill lanes pass a block boundary, prefix hits cut
back to where one is kept, a restoring lane told which slot to start from, and slots that are never lost."""

from __future__ import annotations

import pytest
from scheduler_helpers import drain, fake_outcome, make_request, run_step

from scheduler import Scheduler, SchedulerConfig
from scheduler.state_snapshots import StateSnapshots


def recurrent(**kwargs) -> Scheduler:
    settings = dict(num_blocks=200, block_size=16, row_ceiling=48, row_floor=16, recurrent_state=True,
                    state_snapshots=8)  # fmt: skip
    return Scheduler(SchedulerConfig(**(settings | kwargs)))


def snapshot_positions(scheduler: Scheduler, request) -> list[int]:
    scheduler.add(request)
    positions = []
    for step in range(100):
        if not scheduler.has_work:
            break
        plan = run_step(scheduler, step * 0.01)
        positions += [lane.snapshot.position for lane in plan.lanes if lane.snapshot is not None]
    return positions


def test_each_chunk_leaves_a_snapshot_at_the_last_boundary_it_passes_and_decoding_keeps_its_latest() -> None:
    scheduler = recurrent()
    # 100 tokens in chunks of 48: 0-48 (boundary 48), 48-96 (96), 96-100 (none past 96); then the decode lanes whose
    # row ends a block (112, 128): each replaces the request's one before
    request = make_request("a", 100, max_tokens=40)
    assert snapshot_positions(scheduler, request) == [48, 96, 112, 128]
    assert len(scheduler.snapshots) == 3
    assert request.decode_snapshot == request.block_hashes[7]
    assert scheduler.snapshots.slot_of(request.block_hashes[6]) is None


def test_a_chats_next_turn_goes_on_from_where_the_answer_left_its_snapshot() -> None:
    scheduler = recurrent()
    first = make_request("a", 100, max_tokens=40)
    snapshot_positions(scheduler, first)
    follow = make_request("b", 150, max_tokens=1)
    follow.prompt_ids = list(first.prompt_ids) + list(first.output_ids) + [5000 + i for i in range(10)]
    scheduler.add(follow)
    plan = scheduler.schedule(9.0)
    assert follow.num_cached_tokens == 128  # the answer's last full block, not the prompt's (96)
    assert plan.lanes[0].restore_slot == scheduler.snapshots.slot_of(follow.block_hashes[7])


def test_a_prefix_hit_ends_where_a_snapshot_is_kept_and_its_first_lane_restores_it() -> None:
    scheduler = recurrent()
    snapshot_positions(scheduler, make_request("a", 100, max_tokens=1))
    follow = make_request("b", 90, max_tokens=1)  # a's first 90 tokens: its KV hits 5 blocks (80 tokens)
    scheduler.add(follow)
    plan = scheduler.schedule(1.0)
    [lane] = plan.lanes
    assert follow.num_cached_tokens == 48  # cut back to a's snapshot at 48
    assert lane.start == 48 and lane.restore_slot == scheduler.snapshots.slot_of(follow.block_hashes[2])
    assert lane.snapshot.position == 80  # and it leaves one of its own at its last boundary
    scheduler.update(plan, fake_outcome(plan), 1.01)
    assert scheduler.snapshots.slot_of(follow.block_hashes[4]) == lane.snapshot.slot


def test_without_snapshots_a_recurrent_model_takes_no_hit_and_an_attention_model_takes_every_one() -> None:
    for config, cached in ((dict(state_snapshots=0), 0), (dict(recurrent_state=False, state_snapshots=0), 80)):
        scheduler = recurrent(**config)
        snapshot_positions(scheduler, make_request("a", 100, max_tokens=1))
        follow = make_request("b", 90, max_tokens=1)
        scheduler.add(follow)
        assert all(lane.snapshot is None and lane.restore_slot is None for lane in scheduler.schedule(1.0).lanes)
        assert follow.num_cached_tokens == cached


def test_a_snapshot_of_a_lane_that_did_not_run_is_never_read() -> None:
    scheduler = recurrent()
    first = make_request("a", 60, max_tokens=1)
    scheduler.add(first)
    plan = scheduler.schedule(0.0)
    assert plan.lanes[0].snapshot.position == 48
    scheduler.cancel("a")  # gone before its step was reported: the snapshot's slot is free again, unread
    scheduler.update(plan, fake_outcome(plan), 0.01)
    assert len(scheduler.snapshots) == 0
    scheduler.snapshots.check_invariants()
    again = make_request("b", 60, max_tokens=1)
    scheduler.add(again)
    drain(scheduler)
    assert again.num_cached_tokens == 0


def test_a_step_that_never_ran_gives_back_what_its_lanes_reserved() -> None:
    scheduler = recurrent()
    snapshot_positions(scheduler, make_request("a", 100, max_tokens=1))
    follow = make_request("b", 90, max_tokens=1)
    scheduler.add(follow)
    plan = scheduler.schedule(1.0)  # restores a's snapshot at 48, writes one at 80
    scheduler.abandon(plan)  # its submission failed: the engine cancels b
    scheduler.cancel("b")
    scheduler.snapshots.check_invariants()
    assert scheduler.snapshots.slot_of(follow.block_hashes[4]) is None  # never written, never readable
    # every slot can be handed out again: none is left pinned or pending
    assert None not in [scheduler.snapshots.reserve(bytes([i]) * 4) for i in range(8)]


def test_a_step_that_failed_after_its_update_leaves_no_snapshot_to_read() -> None:
    scheduler = recurrent()
    first = make_request("a", 60, max_tokens=1)
    scheduler.add(first)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, fake_outcome(plan), 0.01)  # updated at once (left in flight); then its read-back fails
    assert len(scheduler.snapshots) == 1
    scheduler.abandon(plan, updated=True)
    scheduler.cancel("a")
    assert len(scheduler.snapshots) == 0
    scheduler.snapshots.check_invariants()


def test_the_least_recently_used_snapshot_goes_first_and_a_pinned_one_never() -> None:
    snapshots = StateSnapshots(2)
    slots = {name: snapshots.reserve(name) for name in (b"a", b"b")}
    assert snapshots.reserve(b"c") is None  # both being written
    for name, slot in slots.items():
        snapshots.confirm(slot, name)
    pinned = snapshots.pin(b"a")  # a is read next: used most recently, and held
    assert snapshots.reserve(b"a") is None  # kept already: the same tokens give the same state
    assert (c := snapshots.reserve(b"c")) == slots[b"b"]  # b went
    assert snapshots.reserve(None) is None  # a is pinned, c is being written
    snapshots.unpin(pinned)
    snapshots.confirm(c, b"c")
    decode = snapshots.reserve(None)  # a decode lane's: its block is hashed when its step is reported
    assert decode == slots[b"a"]
    snapshots.confirm(decode, b"c")  # the same block kept already: this slot goes back
    assert len(snapshots) == 1 and snapshots.slot_of(b"c") == c
    snapshots.check_invariants()


def test_snapshots_need_a_recurrent_model() -> None:
    with pytest.raises(ValueError, match="state_snapshots"):
        SchedulerConfig(num_blocks=10, state_snapshots=3)
