"""How late a serving process's event loop runs what is due: the lag every request's callbacks wait.

Why: in an LLM replica the event loop takes the Router's calls, hands the tower's batches to a thread,
and streams every request's chunks back through Ray, beside the engine's thread and under one GIL. A
request's first chunk waits for that loop twice: when its call arrives and when its chunk goes out. The
time to first token's parts (benchmarks/ttft_tail.py) showed those hops, between the Router and the
replica, growing with the rate (6-17 ms mean at 180 req/s on one H200). This says how much of that is the
replica's own loop: a callback is scheduled every `interval_s`, and how late it runs is counted in
buckets. `replica_load()["loop_lag"]` reports it; benchmarks/goodput.py diffs it over each window.
"""

from __future__ import annotations

import asyncio
import time
from itertools import accumulate

from .prometheus import Histogram

BOUNDS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)  # the last bucket holds everything later


class LoopLag:
    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.lags_ms = Histogram(BOUNDS_MS)
        self.max_ms = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0

    def ensure_started(self) -> None:
        """Starts ticking on the running event loop, once (call it from a coroutine on the loop to watch)."""
        if self._loop is not None:
            return
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (a sync method Serve ran in a thread): the next caller starts it
            return
        self._due = time.monotonic() + self.interval_s
        self._loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        self.record(max(0.0, now - self._due))
        self._due = now + self.interval_s
        self._loop.call_later(self.interval_s, self._tick)

    def record(self, lag_s: float) -> None:
        self.lags_ms.observe(1e3 * lag_s)
        self.max_ms = max(self.max_ms, 1e3 * lag_s)

    def snapshot(self) -> dict:
        """Cumulative: ticks, their summed and longest lag in ms, and the count per bucket (`bounds_ms`:
        each bucket's upper bound, the last one unbounded)."""
        h = self.lags_ms.snapshot()
        return {"ticks": sum(h["counts"]), "lag_ms_total": h["sum"], "lag_ms_max": self.max_ms,
                "bounds_ms": list(BOUNDS_MS), "counts": h["counts"]}


def lag_delta(start: dict, end: dict) -> dict | None:
    """Between two snapshots: ticks, the mean lag, the p99's bucket (its upper bound in ms; inf past the
    last), and the share of ticks later than 10 ms. None without ticks in between."""
    ticks = end["ticks"] - start["ticks"]
    if ticks <= 0:
        return None
    counts = [b - a for a, b in zip(start["counts"], end["counts"])]
    bounds = [*end["bounds_ms"], float("inf")]
    p99 = next(bound for bound, seen in zip(bounds, accumulate(counts)) if seen >= 0.99 * ticks)
    late = sum(n for bound, n in zip(bounds, counts) if bound > 10)
    return {"ticks": ticks, "mean_ms": (end["lag_ms_total"] - start["lag_ms_total"]) / ticks,
            "p99_bucket_ms": p99, "late_10ms_share": late / ticks}
