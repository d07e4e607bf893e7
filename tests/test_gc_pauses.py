"""app/serving/gc_pauses.py: every collection's pause is counted in its generation, once per process."""

import gc

from app.serving.gc_pauses import GcPauses, watch


def test_pauses_are_counted_per_generation():
    pauses = GcPauses()
    gc.callbacks.append(pauses.callback)
    try:
        gc.collect(2)
        gc.collect(2)
        gc.collect(0)
    finally:
        gc.callbacks.remove(pauses.callback)
    assert pauses.collections[2] >= 2 and pauses.collections[0] >= 1
    assert pauses.max_s[2] > 0 and pauses.total_s[2] >= pauses.max_s[2]
    snap = pauses.snapshot()
    assert snap["collections"] == pauses.collections
    assert snap["pause_ms_max"][2] == round(1e3 * pauses.max_s[2], 3)
    assert snap["frozen_objects"] == gc.get_freeze_count()


def test_a_stop_without_its_start_is_not_counted():
    pauses = GcPauses()
    pauses.callback("stop", {"generation": 2})
    assert pauses.collections == [0, 0, 0]


def test_watch_installs_one_counter_per_process():
    first = watch()
    assert watch() is first
    assert gc.callbacks.count(first.callback) == 1
    before = first.collections[2]
    gc.collect(2)
    assert first.collections[2] == before + 1


def test_the_frozen_objects_are_counted_until_some_are_then_kept(monkeypatch):
    """The count walks every frozen object with the GIL held: asked every second by the benchmarks, it is
    taken while it reads 0 (before Ray Serve's freeze, and free then) and kept once it finds some."""
    counts = iter([0, 0, 1234, 99999])
    calls = []

    def freeze_count():
        calls.append(1)
        return next(counts)

    monkeypatch.setattr(gc, "get_freeze_count", freeze_count)
    pauses = GcPauses()
    assert [pauses.snapshot()["frozen_objects"] for _ in range(2)] == [0, 0]
    assert [pauses.snapshot()["frozen_objects"] for _ in range(3)] == [1234, 1234, 1234]
    assert len(calls) == 3
