"""The scheduler's view of a request: token ids, progress and state. No text, no MLX."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, nothing computed yet
    PREFILLING = "prefilling"  # some prompt rows computed, more to go
    DECODING = "decoding"  # every known token is in KV but the last sampled one
    PREEMPTED = "preempted"  # KV dropped; waits to be recomputed from its tokens
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens or the context length
    CANCELLED = "cancelled"  # the client went away or asked
    ERROR = "error"  # the engine failed this request (others carry on)


class Priority(enum.IntEnum):
    """Lower value is served first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2


@dataclass(eq=False)
class Request:
    """A request as the scheduler tracks it.

    Its tokens are `prompt_ids + output_ids`; `num_computed` of them have KV in the pool. Prefill and decode are
    the same thing here: a request needs `num_tokens - num_computed` rows computed, and a decode lane is the
    case where that is 1. Preemption by recomputation sets `num_computed` back to 0.
    """

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    priority: int = Priority.NORMAL
    cache_salt: str | None = None
    stop_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    # progress, owned by the scheduler
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    block_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    times_overtaken: int = 0
    times_preempted: int = 0
    last_token_time: float | None = None  # when its last token was committed (decode debt)
    in_flight_path: str | None = None  # a chunk committed to a lane that has not reported yet
    # scheduler bookkeeping (added after the first contract; nothing above changed)
    last_token_gap: float | None = None  # seconds between its last two tokens (decode debt)
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # chained hashes of its full blocks
    hashed_tokens: bytearray = field(default_factory=bytearray, repr=False)  # those blocks' tokens, packed as hashed
    num_published_blocks: int = 0  # leading blocks already offered to the prefix cache
    arrival_seq: int = 0  # order of add() calls: ties and overtakes are judged by it
    # its prompt is scored row by row (prompt log-probabilities): every row's hidden state is needed, which the ANE
    # lane does not return, so its chunks stay on the GPU path
    gpu_only: bool = False
    # speculative decoding: at most this many drafted tokens a step, verified by the model (0: none; the engine sets
    # it for requests without logits processors or a grammar); `ngrams` finds them (`speculation.NgramIndex`)
    speculate: int = 0
    ngrams: Any = field(default=None, repr=False)
    new_tokens: int = 0  # tokens the last update appended (more than one where drafts were accepted)
    # the window space's blocks (`SchedulerConfig.window_blocks`), index for index with `block_ids`: those behind its
    # window are `NO_BLOCK`, from index 0 up to `window_first`
    window_block_ids: list[int] = field(default_factory=list)
    window_first: int = 0
    # False: every prompt row is computed (its rows' hidden states are needed: prompt scores, mean pooling), no prefix
    # hit is taken; its blocks are still published for others
    reads_prefix_cache: bool = True
    # a recurrent model's state snapshot its prefix hit ends at (`state_snapshots.py`): its first lane starts from a
    # copy of that slot; None: it starts from zeros (or goes on from its own state)
    restore_slot: int | None = None
    decode_snapshot: bytes | None = None  # the block hash of the latest snapshot its decode lanes left

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_remaining(self) -> int:
        """Rows that still need computing before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.state is RequestState.DECODING

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def tokens(self, start: int, end: int) -> tuple[int, ...]:
        # slices, not token_at per position: hashing a 16k prompt's blocks runs on the engine thread
        n = len(self.prompt_ids)
        if end <= n:
            return tuple(self.prompt_ids[start:end])
        outputs = self.output_ids[max(0, start - n) : end - n]
        return (*self.prompt_ids[start:n], *outputs) if start < n else tuple(outputs)
