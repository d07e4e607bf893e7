"""A replica's start in phases (app/serving/startup.py)."""

from __future__ import annotations

import time

import pytest

from app.serving.startup import StartupTimeline


def test_phases_keep_their_wall_clock_spans_in_order_and_a_failed_phase_is_kept():
    t = StartupTimeline()
    with t.phase("tower"):
        time.sleep(0.02)
    t.extend("engine", [("weights", 10.0, 11.0), ("graphs", 11.0, 12.5)])
    with pytest.raises(RuntimeError), t.phase("warm-up requests"):
        raise RuntimeError("a warm-up that fails still took its time")
    d = t.as_dict()
    assert [p["name"] for p in d["phases"]] == ["tower", "engine: weights", "engine: graphs", "warm-up requests"]
    tower = d["phases"][0]
    assert d["started_at"] <= tower["start"] and tower["end"] - tower["start"] >= 0.02
    assert d["phases"][2] == {"name": "engine: graphs", "start": 11.0, "end": 12.5}
    assert d["phases"][3]["end"] >= d["phases"][3]["start"] >= tower["end"]
