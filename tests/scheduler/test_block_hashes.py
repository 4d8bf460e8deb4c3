"""A request's tokens by range and its chained block hashes: the prefix cache's keys."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.kv_blocks import extend_hash_chain
from scheduler.request import Request


@given(
    prompt=st.lists(st.integers(0, 2**31), min_size=1, max_size=40),
    outputs=st.lists(st.integers(0, 2**31), max_size=40),
    data=st.data(),
)
def test_tokens_of_a_range_are_the_tokens_at_its_positions(prompt, outputs, data):
    request = Request("r", prompt, 64, output_ids=list(outputs))
    total = len(prompt) + len(outputs)
    start = data.draw(st.integers(0, total))
    end = data.draw(st.integers(start, total))
    assert request.tokens(start, end) == tuple(request.token_at(i) for i in range(start, end))


@given(
    prompt=st.lists(st.integers(0, 2**62), min_size=1, max_size=70),
    outputs=st.lists(st.integers(0, 2**62), max_size=30),
    cut=st.integers(0, 25),
    salt=st.sampled_from([None, "", "tenant-a"]),
)
def test_a_chain_grown_in_steps_equals_one_grown_at_once(prompt, outputs, cut, salt):
    block = 4
    request = Request("r", prompt, 64, cache_salt=salt, output_ids=list(outputs))
    blocks = (len(prompt) + len(outputs)) // block
    at_once = extend_hash_chain([], request, blocks, block)
    in_steps = extend_hash_chain(extend_hash_chain([], request, min(cut, blocks), block), request, blocks, block)
    assert at_once == in_steps and len(at_once) == blocks and len(set(at_once)) == blocks


def test_the_chain_depends_on_every_earlier_token_and_the_salt():
    base = list(range(16))
    hashes = extend_hash_chain([], Request("a", base, 1), 4, 4)
    changed = extend_hash_chain([], Request("b", [99, *base[1:]], 1), 4, 4)
    assert all(h != c for h, c in zip(hashes, changed))  # one token in block 0 changes every later hash
    same_tail = extend_hash_chain([], Request("c", [*base[:12], 99, *base[13:]], 1), 4, 4)
    assert same_tail[:3] == hashes[:3] and same_tail[3] != hashes[3]
    salted = extend_hash_chain([], Request("d", base, 1, cache_salt="x"), 4, 4)
    assert not set(salted) & set(hashes)
