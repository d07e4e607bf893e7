"""app/serving/gc_pauses.py: the heap frozen after start-up is out of the collector's reach, what is made
later is still collected, and every collection's pause is counted in its generation."""

import gc
import weakref

import pytest

from app.config import AppConfig
from app.serving.gc_pauses import GcPauses, freeze_heap, watch


@pytest.fixture
def thawed():
    """Each test starts and ends with nothing frozen, so that it cannot change what the suite's other
    tests collect."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_takes_every_live_object_out_of_the_collectors_lists(thawed):
    kept = ["made at start-up", []]  # a list is always tracked (a dict of strings is not)
    assert any(o is kept for o in gc.get_objects())
    done = freeze_heap("test")
    assert done["frozen_objects"] == gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # a full collection no longer walks it


def test_garbage_made_after_the_freeze_is_still_collected(thawed):
    freeze_heap("test")
    node = _Node()
    gone = weakref.ref(node)
    del node
    assert gone() is not None  # the cycle keeps it alive until a collection
    gc.collect()
    assert gone() is None


def test_garbage_left_before_the_freeze_is_collected_by_it(thawed):
    node = _Node()
    gone = weakref.ref(node)
    del node
    freeze_heap("test")
    assert gone() is None  # collected first, not frozen alive for ever


def test_off_freezes_nothing(thawed):
    assert freeze_heap("test", enabled=False) is None
    assert gc.get_freeze_count() == 0


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


def test_the_freeze_is_on_by_default_and_can_be_turned_off():
    assert AppConfig().gc_freeze is True
    assert AppConfig(gc_freeze=False).gc_freeze is False
