"""Snapshots of a recurrent model's state at block boundaries, so the prefix cache can serve such a model.

A recurrent layer's state is not paged by position: a cached prefix's KV blocks cannot give the state at their end.
So where a prefill lane passes a block boundary, the runner copies the request's state there into a snapshot slot
(the lane's `snapshot`), under the chained hash of the block that ends there; a later request whose prefix hit
reaches that block starts from a copy of it (the lane's `restore_slot`), and hits are cut back to the longest
prefix that ends where a snapshot is kept. One snapshot a lane (at the last boundary its rows pass), so a prompt
leaves one where each of its chunks ends, the last just before its final partial block: what a chat's next turn
and a repeated prompt read back. Slots are this module's to hand out (the runner only copies), least recently used
first out; a snapshot being written (its step not yet reported) or about to be read (a request admitted on it
whose first lane has not been reported) is never evicted.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class StateSnapshots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # kept snapshots, least recently used first
        self._pending: dict[bytes, int] = {}  # being written by a step not yet reported
        self._pins: Counter[int] = Counter()  # slots a planned restore will read
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot_of(self, block_hash: bytes) -> int | None:
        """The slot of a kept snapshot at the end of this block (None: none kept)."""
        return self._slot_of.get(block_hash)

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot to write the snapshot of `block_hash` into; None where one is kept or being written already (the
        same tokens give the same state: it is marked used) or every slot is in use and none may go."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return None
        if block_hash in self._pending or (slot := self._take_slot()) is None:
            return None
        self._pending[block_hash] = slot
        return slot

    def confirm(self, block_hash: bytes) -> None:
        """The step that wrote it ran: the snapshot may be read."""
        slot = self._pending.pop(block_hash, None)
        if slot is not None:
            self._slot_of[block_hash] = slot

    def discard(self, block_hash: bytes) -> None:
        """The step that wrote it failed or its request left before it was reported: the slot is free again."""
        slot = self._pending.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def forget(self, block_hash: bytes) -> None:
        """Drop a kept snapshot whose content is not to be trusted (a step that wrote it failed after its update);
        one a restore has pinned stays until then (a request admitted on it reads what the failed step left)."""
        slot = self._slot_of.get(block_hash)
        if slot is not None and slot not in self._pins:
            del self._slot_of[block_hash]
            self._free.append(slot)

    def pin(self, block_hash: bytes) -> int:
        """Keep a snapshot from eviction until `unpin`, and mark it used; returns its slot."""
        slot = self._slot_of[block_hash]
        self._slot_of.move_to_end(block_hash)
        self._pins[slot] += 1
        return slot

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] <= 0:
            del self._pins[slot]

    def check_invariants(self) -> None:
        kept, pending = list(self._slot_of.values()), list(self._pending.values())
        slots = kept + pending + self._free
        assert sorted(slots) == list(range(self.capacity)), "a snapshot slot lost or handed out twice"
        assert all(slot in kept or slot in pending for slot in self._pins), "a pinned slot is not a kept snapshot"

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._slot_of.items():  # least recently used first
            if slot not in self._pins:
                del self._slot_of[block_hash]
                return slot
        return None
