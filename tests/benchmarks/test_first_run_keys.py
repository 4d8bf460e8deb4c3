"""`first_run_keys` on the CPU with the tiny shape: each shape of the sequence runs its repeats in one runner, and
what was new about it is named by its buckets (the times mean nothing here)."""

from __future__ import annotations

from benchmarks.gpu.first_run_keys import REPEATS, probe


def test_each_shape_names_what_was_new_about_it():
    sequence = ((64, 64), (64, 1100), (128, 64), (128, 1100), (96, 1200), (90, 1300), (90, 1300, 1), (64, 64, 2))
    rows = probe("tiny", 2, "fused", sequence)
    new = ["rows+history+lanes", "history", "rows", "pair", "rows", "none", "lanes", "none"]
    assert [r["new"] for r in rows] == new
    assert [(r["rows_bucket"], r["history_bucket"]) for r in rows][-4:-2] == [(96, 2048), (96, 2048)]
    assert [r["lanes"] for r in rows] == [2] * 6 + [1, 2]  # an entry's own lane count, else the probe's
    for r in rows:
        assert len(r["ms"]) == REPEATS and all(ms > 0 for ms in r["ms"])
        assert r["first_over_ms"] == round(r["ms"][0] - min(r["ms"][1:]), 2)
