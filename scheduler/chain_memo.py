"""The block-hash chains of recently finished requests, with the tokens they cover, so that a request repeating a
known prefix (a chat's next turn, a shared document) takes its chain by comparing tokens instead of hashing again.

A chain's hashes depend only on the cache salt and the tokens (`kv_blocks.extend_hash_chain`), so equal tokens give
equal hashes: the whole blocks a new prompt shares with a remembered chain are found by comparing packed tokens (C
speed), and their hashes are copied; blocks past them are hashed as before. Why: hashing is a Python loop of one
blake2b call a block, and a cached prefix's continuation hashes all of it before its one step is planned, on the
engine thread, while every stream waits (8k tokens: 0.35-0.45 ms on the project's box; the H200 host's planning of
that continuation took 1.1-2.2 ms of a 7-12 ms TTFT on Qwen3-0.6B, thirty-first run).

Bounded in tokens (8 bytes each, packed) and in chains (`MAX_CHAINS`, so a look-up compares with few): a chain that
a newer one extends (the last turn of the same chat) is dropped, then the oldest while either bound is passed.
Chains of fewer than `MIN_BLOCKS` blocks are not kept: hashing them again costs less than remembering them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.kv_blocks import BlockHash, pack_int64
from scheduler.request import Request

MAX_CHAINS = 64
MIN_BLOCKS = 32


@dataclass(frozen=True, slots=True)
class _Chain:
    salt: str | None
    packed: bytes  # the tokens of its blocks, packed
    hashes: tuple[BlockHash, ...]


class ChainMemo:
    def __init__(self, max_tokens: int, block_size: int) -> None:
        self.max_tokens = max_tokens  # 0: off
        self.block_size = block_size
        self._chains: deque[_Chain] = deque()  # oldest first

    @property
    def num_chains(self) -> int:
        return len(self._chains)

    def remember(self, request: Request) -> None:
        """Keep a request's chain (as it leaves) for later prompts to compare against."""
        hashes = request.block_hashes
        if not self.max_tokens or not MIN_BLOCKS <= len(hashes) <= self.max_tokens // self.block_size:
            return
        salt, width = request.cache_salt, 8 * self.block_size
        if len(request.hashed_tokens) != len(hashes) * width:
            return  # a chain grown without its tokens (not the scheduler's): its hashes cannot be checked
        packed = bytes(request.hashed_tokens)
        if any(c.salt == salt and _extends(c.packed, packed, width) for c in self._chains):
            return  # a remembered chain already covers it
        self._chains = deque(c for c in self._chains if not (c.salt == salt and _extends(packed, c.packed, width)))
        self._chains.append(_Chain(salt, packed, tuple(hashes)))
        tokens = sum(len(c.hashes) for c in self._chains) * self.block_size
        while tokens > self.max_tokens or len(self._chains) > MAX_CHAINS:
            tokens -= len(self._chains.popleft().hashes) * self.block_size

    def recall(self, request: Request) -> int:
        """Give a request with no chain yet the hashes of its leading whole blocks that the remembered chain sharing
        most of them covers (and their packed tokens); returns how many blocks (0 where none shares its first)."""
        if request.block_hashes:
            return 0
        size = self.block_size
        width = 8 * size
        full = request.num_tokens // size
        if full < MIN_BLOCKS or not self._chains:
            return 0
        head = pack_int64(request.tokens(0, size))
        candidates = [c for c in self._chains if c.salt == request.cache_salt and c.packed.startswith(head)]
        if not candidates:
            return 0
        packed = pack_int64(request.tokens(0, full * size))
        best, best_blocks = None, 0
        for chain in reversed(candidates):  # newest first: a tie goes to the most recent
            blocks = min(len(chain.hashes), full)
            # to share more than the best so far a chain must share its next block: one short comparison rules out
            # the many chains that share a long document or system prompt and differ past it
            next_block = chain.packed[best_blocks * width : (best_blocks + 1) * width]
            if blocks > best_blocks and packed.startswith(next_block, best_blocks * width):
                common = common_blocks(packed, chain.packed, blocks, width)
                if common > best_blocks:
                    best, best_blocks = chain, common
        if best is None:
            return 0
        request.block_hashes = list(best.hashes[:best_blocks])
        request.hashed_tokens = bytearray(packed[: best_blocks * width])
        return best_blocks


def _extends(longer: bytes, shorter: bytes, width: int) -> bool:
    """Whether `longer` starts with `shorter`: their last shared block compared first, so chains that share a long
    document and differ past it are told apart without comparing the document."""
    end = len(shorter)
    return len(longer) >= end and longer[end - width : end] == shorter[-width:] and longer.startswith(shorter)


def common_blocks(a: bytes, b: bytes, blocks: int, width: int) -> int:
    """How many leading blocks of `width` bytes (at most `blocks`) `a` and `b` share: ranges of doubling length
    compared in turn, then a binary search inside the first that differs, so the work is about twice the common
    prefix."""
    done, step = 0, 1
    while done < blocks:
        end = min(blocks, done + step)
        if not a.startswith(b[done * width : end * width], done * width):
            low, high = done, end  # blocks [0, low) are shared; [low, high) holds a difference
            while high - low > 1:
                middle = (low + high) // 2
                if a.startswith(b[low * width : middle * width], low * width):
                    low = middle
                else:
                    high = middle
            return low
        done, step = end, 2 * step
    return done
