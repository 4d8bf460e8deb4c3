"""The stack sampler that places the engine thread's host time on the lent GPU machine (no profiler there)."""

from __future__ import annotations

import threading
import time

from benchmarks.gpu.host_samples import Sample, StackSampler, runs, time_in


def test_runs_merge_consecutive_samples_of_one_stack_within_the_window():
    samples = [Sample(1.000, ("a:1 f",)), Sample(1.001, ("a:1 f",)), Sample(1.002, ("a:2 f",)),
               Sample(1.003, ("a:1 f",)), Sample(2.0, ("a:1 f",))]  # fmt: skip
    assert runs(samples, 1.0, 1.5, origin=1.0) == [[0.0, 1.0, "a:1 f"], [2.0, 2.0, "a:2 f"], [3.0, 3.0, "a:1 f"]]
    assert runs(samples, 1.5, 1.9, origin=1.0) == []


def test_the_sampler_sees_where_a_thread_waits():
    """A thread sleeps 60 ms on one line, then spins 30 ms on another: the samples show both lines, in order,
    for about those times."""
    go = threading.Event()

    def work() -> None:
        go.wait()
        time.sleep(0.06)  # the sleeping line
        end = time.perf_counter() + 0.03
        while time.perf_counter() < end:  # the spinning line
            pass

    worker = threading.Thread(target=work)
    worker.start()
    sampler = StackSampler(worker.ident, interval_s=0.001).start()
    while not sampler.samples:  # the worker starts its timed lines once the sampler runs
        time.sleep(0.001)
    go.set()
    worker.join()
    samples = sampler.stop()
    merged = runs(samples, 0.0, float("inf"), samples[0].t)
    lines = [run[2].split(" ")[0] for run in merged if len(run) > 2]
    first = work.__code__.co_firstlineno
    sleeping = f"test_host_samples.py:{first + 2}"
    spinning = [i for i, line in enumerate(lines) if line in {f"test_host_samples.py:{first + n}" for n in (4, 5)}]
    assert sleeping in lines and spinning and lines.index(sleeping) < spinning[0]
    slept = sum(run[1] - run[0] for run in merged if len(run) > 2 and run[2].startswith(sleeping))
    assert 30.0 <= slept <= 80.0


def test_time_in_counts_each_matching_sample_until_the_next():
    samples = [Sample(1.000, ("r.py:5 q",)), Sample(1.002, ("r.py:5 q",)), Sample(1.003, ("x.py:1 f",)),
               Sample(1.006, ("r.py:5 q", "e.py:2 s"))]  # fmt: skip
    in_q = lambda frame: frame.endswith(" q")  # noqa: E731
    assert abs(time_in(samples, 1.0, 1.010, in_q) - 7.0) < 1e-9  # 1.000-1.003, then 1.006 to the end
    assert time_in(samples, 1.0, 1.010, lambda frame: False) == 0.0
    assert abs(time_in(samples, 1.001, 1.004, lambda frame: frame.startswith("x.py:")) - 1.0) < 1e-9


def test_the_queue_frames_are_the_runners_queue_only():
    from benchmarks.gpu.ours import _in_queue

    assert _in_queue("runner.py:467 _queue") and not _in_queue("runner.py:342 submit")
    assert not _in_queue("sampling.py:50 _queue")
