"""`first_run_logs`: each one-off eager step of a measured pass, split by whether its rows bucket (and lanes) ran
in an earlier step, the last warm pass's included."""

from __future__ import annotations

from benchmarks.gpu.first_run_logs import first_run_excess, table


def result(warm: list[list], measured: list[list], shape: str = "0.6b") -> dict:
    steps = lambda rows: {"steps": {"prefill_steps": rows}}  # noqa: E731
    return {"shape": shape, "ours": {"contended_warm": steps(warm), "contended": steps(measured)}}


def test_first_runs_split_by_what_ran_before():
    # [rows, decode lanes, history, ms, predicted ms, prefill lanes, one-off, compiled]
    warm = [[1024, 8, 0, 14.0, 14.0, 1, False, False]]
    measured = [
        [1024, 4, 0, 16.0, 14.0, 1, True, False],  # bucket ran (at 8 lanes): +2
        [1536, 8, 2048, 30.0, 20.0, 1, True, False],  # new bucket: +10
        [1536, 8, 4096, 21.0, 20.0, 1, True, False],  # ran one step earlier: +1
        [768, 8, 0, 40.0, 10.0, 1, True, True],  # compiled: not an eager first run
        [512, 8, 0, 11.0, 10.0, 1, False, False],  # not one-off
        [96, 8, 0, 9.0, None, 1, True, False],  # never priced
    ]
    excess = first_run_excess([result(warm, measured), result(warm, measured, "8b")], "0.6b")
    assert excess[("rows bucket", True)] == [2.0, 1.0]
    assert excess[("rows bucket", False)] == [10.0]
    assert excess[("rows bucket and lanes", False)] == [2.0, 10.0]  # 1,024 rows had run at 8 lanes, not at 4
    assert excess[("rows bucket and lanes", True)] == [1.0]
    lines = table(excess).splitlines()
    assert "| no | rows bucket | 1 | 10.0 | 10.0 | 10.0 |" in lines and len(lines) == 2 + len(excess)
