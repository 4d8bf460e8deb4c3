"""Prompt-lookup drafts: the index, fed a request's tokens as they grow, proposes what a brute-force search over all
its earlier tokens proposes, and rests after drafts the model rejects whole."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Request
from scheduler.speculation import NgramIndex


def brute_force(tokens: list[int], shortest: int, longest: int, most: int) -> tuple[int, ...]:
    """The tokens after the latest earlier occurrence of the longest tail n-gram (n from longest down to shortest)."""
    total = len(tokens)
    for n in range(min(longest, total), shortest - 1, -1):
        tail = tokens[total - n :]
        for end in range(total - 1, n - 1, -1):  # the n-gram ending at `end` has a token after it
            if tokens[end - n : end] == tail:
                return tuple(tokens[end : min(end + most, total)])
    return ()


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    outputs=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=12),
    shortest=st.integers(1, 2),
    longest=st.integers(2, 4),
    most=st.integers(1, 6),
)
def test_proposals_match_a_brute_force_search_as_tokens_arrive(prompt, outputs, shortest, longest, most):
    request = Request("r", list(prompt), max_tokens=100)
    index = NgramIndex(shortest, longest)
    assert index.propose(request, most) == brute_force(request.prompt_ids, shortest, longest, most)
    for chunk in outputs:  # tokens committed a step at a time (accepted drafts commit several)
        request.output_ids.extend(chunk)
        tokens = request.prompt_ids + request.output_ids
        assert index.propose(request, most) == brute_force(tokens, shortest, longest, most)


def test_the_longest_matching_tail_wins_and_the_latest_occurrence():
    request = Request("r", [1, 2, 3, 9, 2, 3, 7, 1, 2, 3], max_tokens=10)
    # "1 2 3" occurred first at 0 (followed by 9); "2 3" last at 4 (followed by 7): the longer match wins
    assert NgramIndex(2, 3).propose(request, 4) == (9, 2, 3, 7)
    assert NgramIndex(2, 2).propose(request, 4) == (7, 1, 2, 3)
    assert NgramIndex(2, 3).propose(Request("s", [1, 2, 3, 4], max_tokens=10), 4) == ()


def test_rejected_drafts_rest_the_request_longer_each_time_until_one_is_accepted():
    request = Request("r", [5, 6] * 8, max_tokens=10)
    index = NgramIndex(2, 3)
    rests = []
    for _ in range(5):
        assert index.propose(request, 2)
        index.observe(0)  # rejected whole
        skipped = 0
        while not index.propose(request, 2):
            skipped += 1
        rests.append(skipped)
    assert rests == [1, 3, 3, 3, 3]
    index.observe(1)
    assert index.propose(request, 2)  # an accepted draft ends the rest at once


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), min_size=2, max_size=60),
    outputs=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), max_size=10),
    backlog=st.integers(1, 8),
)
def test_a_prompt_indexed_a_little_a_call_proposes_only_true_continuations_then_all(prompt, outputs, backlog):
    request = Request("r", list(prompt), max_tokens=100)
    index = NgramIndex(2, 3, backlog=backlog)
    for chunk in [[], *outputs]:
        request.output_ids.extend(chunk)
        tokens = request.prompt_ids + request.output_ids
        drafts = index.propose(request, 4)
        if drafts:  # what it proposes followed an earlier occurrence of a tail of the tokens
            assert any(tokens[end : end + len(drafts)] == list(drafts) and tokens[end - n : end] == tokens[-n:]
                       for n in (3, 2) for end in range(n, len(tokens)))  # fmt: skip
    while index.low > index.shortest:  # the backlog drains: then proposals are the full search's
        index.propose(request, 4)
    tokens = request.prompt_ids + request.output_ids
    assert index.propose(request, 4) == brute_force(tokens, 2, 3, 4)
