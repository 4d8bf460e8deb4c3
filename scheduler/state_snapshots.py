"""Snapshots of a recurrent model's state at block boundaries, so the prefix cache can serve such a model.

A recurrent layer's state is not paged by position: a cached prefix's KV blocks cannot give the state at their end.
So where a prefill lane passes a block boundary, the runner copies the request's state there into a snapshot slot
(the lane's `snapshot`), under the chained hash of the block that ends there; a later request whose prefix hit
reaches that block starts from a copy of it (the lane's `restore_slot`), and hits are cut back to the longest
prefix that ends where a snapshot is kept. One snapshot a lane (at the last boundary its rows pass), so a prompt
leaves one where each of its chunks ends, the last just before its final partial block; and a decode lane whose row
ends a block leaves one too, each replacing the request's one before, so a finished answer leaves its last full
block's: where a chat's next turn (the conversation so far and a new message) goes on. A decode lane's block ends
with the token the step before it samples, which a step left in flight has not returned when the lane is planned: its
slot is reserved then and its hash taken when the step is reported. Slots are this module's to hand out (the runner only copies), least recently used
first out; a snapshot being written (its step not yet reported) or about to be read (a request admitted on it
whose first lane has not been reported) is never evicted.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class StateSnapshots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # kept snapshots, least recently used first
        # slots being written by a step not yet reported -> the block's hash (None: a decode lane's, whose block ends
        # with the token the step before it samples: hashed when the step is reported)
        self._pending: dict[int, bytes | None] = {}
        self._pins: Counter[int] = Counter()  # slots a planned restore will read
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot_of(self, block_hash: bytes) -> int | None:
        """The slot of a kept snapshot at the end of this block (None: none kept)."""
        return self._slot_of.get(block_hash)

    def reserve(self, block_hash: bytes | None) -> int | None:
        """A slot to write the snapshot of `block_hash` into (None: a block whose hash is known only once the step is
        reported); None where one is kept or being written already (the same tokens give the same state: it is marked
        used) or every slot is in use and none may go."""
        if block_hash is not None and block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return None
        if block_hash is not None and block_hash in self._pending.values():
            return None
        if (slot := self._take_slot()) is None:
            return None
        self._pending[slot] = block_hash
        return slot

    def confirm(self, slot: int, block_hash: bytes) -> None:
        """The step that wrote the slot ran: the snapshot may be read (one kept already stays; this slot goes)."""
        if slot not in self._pending:
            return
        del self._pending[slot]
        if block_hash in self._slot_of:
            self._free.append(slot)
        else:
            self._slot_of[block_hash] = slot

    def discard(self, slot: int) -> None:
        """The step that wrote it failed or its request left before it was reported: the slot is free again."""
        if slot in self._pending:
            del self._pending[slot]
            self._free.append(slot)

    def forget(self, block_hash: bytes | None = None, slot: int | None = None) -> None:
        """Drop a kept snapshot (by its block's hash or its slot) no longer worth a slot or whose content is not to be
        trusted (a step that wrote it failed after its update); one a restore has pinned stays until then."""
        if block_hash is None:
            block_hash = next((h for h, s in self._slot_of.items() if s == slot), None)
        kept = self._slot_of.get(block_hash) if block_hash is not None else None
        if kept is not None and kept not in self._pins:
            del self._slot_of[block_hash]
            self._free.append(kept)

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
        kept, pending = list(self._slot_of.values()), list(self._pending)
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
