import gc
import threading

from benchmarks.gpu.gc_pauses import GcPauses, overlapping, summary


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_full_collection_is_recorded_with_its_thread_and_what_it_freed() -> None:
    recorder = GcPauses().start()
    for _ in range(100):
        _Cycle()  # garbage only a collection frees
    gc.collect()
    pauses = recorder.stop()
    full = [p for p in pauses if p.generation == 2]
    assert full and full[-1].collected >= 100 and full[-1].thread == threading.current_thread().name
    assert all(p.end >= p.start for p in pauses)
    assert summary(pauses)["2"]["count"] == len(full)
    assert overlapping(pauses, full[-1].start, full[-1].end)[-1] == full[-1]
    assert overlapping(pauses, full[-1].end + 1.0, full[-1].end + 2.0) == []


def test_nothing_is_recorded_after_stop() -> None:
    recorder = GcPauses().start()
    recorder.stop()
    gc.collect()
    assert recorder.pauses == [] and recorder._callback not in gc.callbacks
