"""The GPU bench's engine observer wakes the measuring thread once, when what it waits for has happened."""

import threading
import time

from benchmarks.gpu.ours import Recorder


def _engine_thread(recorder: Recorder, steps: int, streams: int) -> threading.Thread:
    def run() -> None:
        while recorder._wanted is None:  # records only once the measuring thread waits
            time.sleep(0.001)
        for _ in range(steps):
            for _ in range(streams):
                recorder.on_token_gap(0.001)
            recorder.on_step(1.0, streams, 0, streams, 0)
        recorder.on_step(1.0, streams + 16, 16, streams, 0)  # a step with prefill rows is not decode-only

    return threading.Thread(target=run)


def test_the_waiting_thread_is_woken_once_not_per_token():
    recorder = Recorder()
    wakes = []
    notify = recorder._cond.notify_all
    recorder._cond.notify_all = lambda: (wakes.append(len(recorder.gaps)), notify())
    engine = _engine_thread(recorder, steps=50, streams=8)
    engine.start()
    recorder.wait_until(lambda: len(recorder.gaps) >= 400, timeout_s=30)
    engine.join()
    assert len(recorder.gaps) == 400 and wakes == [400]


def test_decode_only_steps_are_counted_by_lanes():
    recorder = Recorder()
    engine = _engine_thread(recorder, steps=20, streams=4)
    engine.start()
    assert recorder.wait_for(lambda: recorder.decode_only_steps(4) >= 20, timeout_s=30)
    engine.join()
    assert recorder.decode_only_steps(4) == 20 and recorder.decode_only_steps(8) == 0 and recorder.steps == 21
    recorder.reset()
    assert recorder.decode_only_steps(4) == 0 and recorder.gaps == [] and recorder.first == []


def test_a_wait_that_is_never_met_times_out():
    recorder = Recorder()
    assert recorder.wait_for(lambda: len(recorder.first) > 0, timeout_s=0.05) is False
    assert recorder._wanted is None  # the next records check nothing
    recorder.on_first_token(0.5)
    assert recorder.first == [0.5]
