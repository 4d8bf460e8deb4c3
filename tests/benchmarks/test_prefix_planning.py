"""`benchmarks/prefix_planning.py` on a short prefix: the continuations it times recall their chain, or hash it
when remembering is off."""

from __future__ import annotations

from benchmarks.prefix_planning import continuation_plan_ms


def test_each_continuation_recalls_the_whole_prefix_only_when_chains_are_remembered():
    on = continuation_plan_ms(1024, 1 << 18, rounds=3, seed=0)
    off = continuation_plan_ms(1024, 0, rounds=3, seed=0)
    assert on["recalled_blocks"] == 3 * 64  # each round's continuation: the 64 blocks of the shared 1,024 tokens
    assert off["recalled_blocks"] == 0
    assert on["plan_ms_p50"] > 0 and off["plan_ms_p50"] > 0
