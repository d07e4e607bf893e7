"""app/serving/loop_lag.py: how late an event loop runs what is due, counted in buckets, and the window's
share of it (benchmarks/goodput.py's `loop_lag`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.serving.loop_lag import BOUNDS_MS, LoopLag, lag_delta
from benchmarks.goodput import gc_cell, loop_lag_delta


def test_a_blocked_loop_shows_as_lag():
    lag = LoopLag(interval_s=0.005)

    async def go():
        lag.ensure_started()
        lag.ensure_started()  # once only: a second call schedules no second series of ticks
        await asyncio.sleep(0.05)
        quiet = lag.snapshot()
        time.sleep(0.06)  # the loop is held: the tick due meanwhile runs late by about this much
        await asyncio.sleep(0.03)
        return quiet, lag.snapshot()

    quiet, after = asyncio.run(go())
    assert 3 <= quiet["ticks"] <= 12  # one series, about every 5 ms (a crowded machine runs fewer)
    d = lag_delta(quiet, after)
    assert after["lag_ms_max"] >= 50 and d["p99_bucket_ms"] >= 100  # the 60 ms tick sits in the 100 ms bucket
    assert d["late_10ms_share"] > 0 and sum(after["counts"]) == after["ticks"]


def test_lag_is_bucketed_and_diffed_per_window():
    lag = LoopLag()
    for ms in (0.5, 0.5, 3, 15):
        lag.record(ms / 1e3)
    a = lag.snapshot()
    assert a["counts"][:5] == [2, 0, 1, 0, 1] and a["lag_ms_max"] == pytest.approx(15)
    for _ in range(98):
        lag.record(0.0002)
    lag.record(2.0)  # past the last bound: the open bucket
    b = lag.snapshot()
    assert b["counts"][len(BOUNDS_MS)] == 1
    d = lag_delta(a, b)
    # 98 of 99 in the first bucket is short of 99%: the p99 is the slow tick's, past the last bound
    assert d["ticks"] == 99 and d["p99_bucket_ms"] == float("inf") and d["late_10ms_share"] == pytest.approx(1 / 99)
    assert d["mean_ms"] == pytest.approx((98 * 0.2 + 2000) / 99)
    lag.record(0.0002)
    assert lag_delta(a, lag.snapshot())["p99_bucket_ms"] == 1  # 99 of 100 within the first bucket
    assert lag_delta(b, b) is None


def test_the_window_reports_the_worst_replica():
    def load(*snaps):
        return {"replicas": [{"replica": f"r{i}", "loop_lag": s} for i, s in enumerate(snaps)]}

    x, y = LoopLag(), LoopLag()
    x0, y0 = x.snapshot(), y.snapshot()
    for _ in range(10):
        x.record(0.001)
        y.record(0.030)
    got = loop_lag_delta(load(x0, y0), load(x.snapshot(), y.snapshot()))
    assert set(got["replicas"]) == {"r0", "r1"}
    assert (got["p99_bucket_ms_max"], got["late_10ms_share_max"]) == (50, 1.0)
    assert got["mean_ms_max"] == pytest.approx(30)
    assert loop_lag_delta(load(x0), {"replicas": [{"replica": "r0"}]}) is None
    cell = gc_cell({"server": {"gc": {"full_collections": 1, "full_pause_ms": 7.0}, "loop_lag": got}})
    assert cell == "1, 7; lag 30.0 / 50 / 100%"
