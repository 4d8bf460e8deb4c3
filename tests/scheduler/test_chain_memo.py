"""Remembered hash chains (`scheduler.chain_memo`): a prompt that repeats a finished request's tokens takes exactly
the hashes hashing would give it, and only for the whole blocks it shares."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Scheduler, SchedulerConfig
from scheduler.chain_memo import MAX_CHAINS, MIN_BLOCKS, ChainMemo, common_blocks
from scheduler.kv_blocks import extend_hash_chain, pack_int64
from scheduler.request import Request
from tests.scheduler.scheduler_helpers import drain

BLOCK = 4


def finished(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    """A request as it leaves: its chain covers every full block of its tokens."""
    request = Request(request_id, tokens, 1, cache_salt=salt)
    extend_hash_chain(request.block_hashes, request, len(tokens) // BLOCK, BLOCK, request.hashed_tokens)
    return request


def recalled(memo: ChainMemo, tokens: list[int], salt: str | None = None) -> int:
    return memo.recall(Request("new", tokens, 1, cache_salt=salt))


def fresh(request: Request) -> list[bytes]:
    return extend_hash_chain([], request, request.num_tokens // BLOCK, BLOCK)


@settings(max_examples=150, deadline=None)
@given(
    # a few long stems; each request is a stem cut somewhere in its last 48 tokens, then a tail of its own
    stems=st.lists(st.lists(st.integers(0, 2**40), min_size=(MIN_BLOCKS + 12) * BLOCK,
                            max_size=(MIN_BLOCKS + 24) * BLOCK), min_size=1, max_size=3),  # fmt: skip
    seen=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 48), st.lists(st.integers(0, 9), max_size=30),
                            st.sampled_from([None, "tenant"])), max_size=6),  # fmt: skip
    asked=st.tuples(st.integers(0, 2), st.integers(0, 48), st.lists(st.integers(0, 9), max_size=30),
                    st.sampled_from([None, "tenant"])),  # fmt: skip
    max_tokens=st.sampled_from([(MIN_BLOCKS + 24) * BLOCK, 4 * MIN_BLOCKS * BLOCK, 1 << 18]),
)
def test_a_recalled_chain_is_the_chain_hashing_gives(stems, seen, asked, max_tokens):
    memo = ChainMemo(max_tokens, BLOCK)

    def tokens(stem: int, cut: int, tail: list[int]) -> list[int]:
        base = stems[stem % len(stems)]
        return base[: max(1, len(base) - cut)] + tail

    for i, (stem, cut, tail, salt) in enumerate(seen):
        memo.remember(finished(f"r{i}", tokens(stem, cut, tail), salt))
    stem, cut, tail, salt = asked
    request = Request("new", tokens(stem, cut, tail), 1, cache_salt=salt)
    blocks = memo.recall(request)
    expected = fresh(request)
    assert request.block_hashes == expected[:blocks] and len(request.block_hashes) == blocks
    assert bytes(request.hashed_tokens) == pack_int64(request.tokens(0, blocks * BLOCK))
    # extended past what it recalled, the chain (and its packed tokens) are the fresh ones
    extend_hash_chain(request.block_hashes, request, len(expected), BLOCK, request.hashed_tokens)
    assert request.block_hashes == expected
    assert bytes(request.hashed_tokens) == pack_int64(request.tokens(0, len(expected) * BLOCK))


def test_only_whole_shared_blocks_of_the_same_salt_are_recalled():
    base = list(range(1000, 1000 + BLOCK * (MIN_BLOCKS + 8)))
    memo = ChainMemo(1 << 16, BLOCK)
    memo.remember(finished("a", base))
    # the tokens differ inside block MIN_BLOCKS + 2: the two blocks before it are the last shared
    changed = list(base)
    changed[BLOCK * (MIN_BLOCKS + 2) + 1] = 7
    assert recalled(memo, changed) == MIN_BLOCKS + 2
    assert recalled(memo, [*base, 5, 6, 7, 8, 9]) == MIN_BLOCKS + 8
    assert recalled(memo, base, salt="other") == 0
    assert recalled(memo, [0, *base[1:]]) == 0  # the first block differs
    assert recalled(memo, base[: BLOCK * (MIN_BLOCKS - 1)]) == 0  # too short to be worth it
    hashed = finished("g", base)
    assert memo.recall(hashed) == 0 and len(hashed.block_hashes) == MIN_BLOCKS + 8  # a chain of its own is kept


def test_a_chain_extended_by_a_newer_one_is_dropped_and_the_bounds_hold():
    turn = list(range(500, 500 + BLOCK * MIN_BLOCKS))
    memo = ChainMemo(BLOCK * MIN_BLOCKS * 3, BLOCK)
    memo.remember(finished("turn1", turn))
    memo.remember(finished("turn2", [*turn, *range(BLOCK * 4)]))  # the next turn of the same chat
    assert memo.num_chains == 1
    memo.remember(finished("turn1-again", turn))  # covered by turn2: nothing to add
    assert memo.num_chains == 1
    memo.remember(finished("short", turn[: BLOCK * (MIN_BLOCKS - 1)]))  # under MIN_BLOCKS: not kept
    assert memo.num_chains == 1
    unpacked = Request("unpacked", [7, *turn], 1)  # hashed without its tokens kept: nothing to compare, not kept
    extend_hash_chain(unpacked.block_hashes, unpacked, MIN_BLOCKS, BLOCK)
    memo.remember(unpacked)
    assert memo.num_chains == 1
    for i in range(3):  # three other documents of 32 blocks: with the chat's 36 they pass the 96-block bound
        memo.remember(finished(f"doc{i}", [10_000 * (i + 1) + t for t in range(BLOCK * MIN_BLOCKS)]))
    assert memo.num_chains == 3
    assert recalled(memo, [*turn, 1, 2, 3, 4]) == 0  # the oldest went first
    assert recalled(memo, [10_000 + t for t in range(BLOCK * MIN_BLOCKS)]) == MIN_BLOCKS
    many = ChainMemo(1 << 30, BLOCK)
    for i in range(MAX_CHAINS + 5):
        many.remember(finished(f"m{i}", [1_000_000 * (i + 1) + t for t in range(BLOCK * MIN_BLOCKS)]))
    assert many.num_chains == MAX_CHAINS


@given(a=st.binary(max_size=64), b=st.binary(max_size=64), width=st.integers(1, 5))
def test_common_blocks_counts_the_leading_equal_blocks(a, b, width):
    blocks = min(len(a), len(b)) // width
    naive = 0
    while naive < blocks and a[naive * width : (naive + 1) * width] == b[naive * width : (naive + 1) * width]:
        naive += 1
    assert common_blocks(a, b, blocks, width) == naive


def test_packing_is_little_endian_int64():
    assert pack_int64((1, 2**40)) == (1).to_bytes(8, "little") + (2**40).to_bytes(8, "little")


def continuation_hits(recent_chain_tokens: int) -> tuple[int, int]:
    """A 1,024-token prompt runs to the end, then its continuation arrives: (prefix-hit tokens, recalled blocks)."""
    config = SchedulerConfig(num_blocks=512, block_size=16, recent_chain_tokens=recent_chain_tokens)
    scheduler = Scheduler(config)
    prefix = [3000 + i for i in range(1024)]
    scheduler.add(Request("cold", [*prefix, 1, 2, 3], max_tokens=2))
    drain(scheduler)
    hits_before = scheduler.stats.prefix_hit_tokens
    warm = Request("warm", [*prefix, 4, 5, 6, 7], max_tokens=2)
    scheduler.add(warm)
    drain(scheduler)
    # what it hashed or recalled is its chain, whole: the tokens the next turn is compared with
    assert warm.block_hashes == extend_hash_chain([], warm, warm.num_tokens // 16, 16)
    assert bytes(warm.hashed_tokens) == pack_int64(warm.tokens(0, len(warm.block_hashes) * 16))
    return scheduler.stats.prefix_hit_tokens - hits_before, scheduler.stats.recalled_hash_blocks


def test_a_continuation_takes_its_prefix_hashes_from_the_finished_request():
    hits, recalled = continuation_hits(1 << 18)
    assert (hits, recalled) == (1024, 64)  # the whole 64-block prefix: matched, and not hashed again
    assert continuation_hits(0) == (1024, 0)  # off: the same hits, every block hashed
