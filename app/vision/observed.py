"""Batch times seen while serving, correcting the auto-tune's estimates that dispatch compares.

The auto-tune (graphs.py) times one synthetic batch per budget on an idle GPU, and dispatch compares
the eager time estimated at a batch's real size with its budget graph's. Real batches can differ in
ways that decide the choice: cuBLASLt picks its GEMM kernels by row count and a tuning batch fills
its budget exactly, so for MiniCPM-V's sliced images the estimate overstated eager and a graph slower
than eager was kept; a loaded host stretches eager's launch-bound time and its tail, which an idle
run cannot see and the fixed `eager_margin` only guesses at. So every batch that had the choice is
timed, and dispatch corrects each path's prediction by what it observed (`ObservedTimes`; numbers:
benchmarks/results/2026-11-25-observed-dispatch.md).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch

EAGER, GRAPH = "eager", "graph"


@dataclass(frozen=True)
class ObservedSettings:
    window: int = 32  # ratios kept per (bucket, path): recent batches, so a change of load shows soon
    min_samples: int = 4  # before this many, the tuned estimate stands
    quantile: float = 0.5  # of the ratios: the median (ObservedTimes says why)
    explore_band: float = 0.2  # estimates this close (relative) make the other path worth timing now and then
    explore_every: int = 16  # one batch in this many near a tie takes the other path
    explore_every_unknown: int = 4  # ... while that path has fewer than min_samples observations there
    max_pending: int = 256  # timed batches whose events have not passed yet (oldest dropped beyond)


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile of a non-empty list."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class ObservedTimes:
    """Per (bucket, path): the last `window` ratios of a batch's observed time to its prediction. A
    bucket is what dispatch tells apart: a budget, equal-length batches on their own (graphs.py).

    CUDA events bracket each batch on its stream and are read on a later batch, once they have passed,
    so nothing waits. Dispatch multiplies a path's prediction by the median of its ratios: the path
    with the lower median time under the host's real load wins. (A higher quantile, to weigh tails,
    kept MiniCPM-V's slower graph for sliced images: eager's times there spread wider, so its 75th
    percentile hid a lower median.) Equal-length batches and the others are kept apart within a
    budget: their estimates come from different tuned columns, and dense attention makes their costs
    differ. Until a path has `min_samples` observations in a bucket its tuned time stands (eager's
    raised by the margin).

    A path that dispatch stopped choosing would never be timed again. So while the two estimates for
    a bucket are within `explore_band` of each other, every `explore_every`-th batch there takes the
    other path (every `explore_every_unknown`-th while that path has too few observations to count):
    at most the band's cost on one batch in that many."""

    def __init__(self, settings: ObservedSettings | None = None, cuda: bool = True):
        self.settings = settings or ObservedSettings()
        self.cuda = cuda
        self._ratios: dict[tuple[Hashable, str], deque[float]] = {}
        self._pending: deque = deque()  # (start event, end event, bucket, path, predicted ms), oldest first
        self._near_ties: Counter = Counter()
        self.explored = 0  # batches sent down the other path
        self._lock = threading.Lock()  # the stats endpoint reads while the encoding thread adds

    def factor(self, bucket: Hashable, path: str) -> float | None:
        """The correction for `path`'s predictions in `bucket` (from the batches polled so far), or None
        while too few were seen."""
        with self._lock:
            return self._correction(self._ratios.get((bucket, path), ()))

    def _correction(self, ratios) -> float | None:
        if len(ratios) < self.settings.min_samples:
            return None
        return quantile(list(ratios), self.settings.quantile)

    def explore(self, bucket: Hashable, eager_ms: float, graph_ms: float) -> bool:
        """Whether this batch of `bucket` should take the path the estimates did not pick."""
        lo, hi = sorted((eager_ms, graph_ms))
        if not lo > 0 or hi > lo * (1 + self.settings.explore_band):
            return False
        other = GRAPH if eager_ms < graph_ms else EAGER
        known = self.factor(bucket, other) is not None
        every = self.settings.explore_every if known else self.settings.explore_every_unknown
        self._near_ties[bucket] += 1
        if self._near_ties[bucket] % every:
            return False
        self.explored += 1
        return True

    def start(self):
        """A mark before a batch runs: a CUDA event recorded on the current stream (or a clock reading)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def finish(self, mark, bucket: Hashable, path: str, predicted_ms: float) -> None:
        """The batch begun at `mark` has been issued: its time joins (bucket, path) once it has run."""
        if not predicted_ms > 0:
            return
        if not self.cuda:  # the CPU ran it synchronously
            self.add(bucket, path, 1e3 * (time.perf_counter() - mark) / predicted_ms)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((mark, end, bucket, path, predicted_ms))
        if len(self._pending) > self.settings.max_pending:
            self._pending.popleft()

    def poll(self) -> None:
        """Read the batches whose end events have passed (in order; never waits). Called by the encoding
        thread only, once per batch before dispatch (under the graph manager's lock)."""
        while self._pending and self._pending[0][1].query():
            start, end, bucket, path, predicted = self._pending.popleft()
            self.add(bucket, path, start.elapsed_time(end) / predicted)

    def add(self, bucket: Hashable, path: str, ratio: float) -> None:
        with self._lock:
            self._ratios.setdefault((bucket, path), deque(maxlen=self.settings.window)).append(ratio)

    def summary(self) -> dict:
        """{bucket: {path: [correction or None, batches seen]}}: what dispatch has learned (stats; any
        thread: it reads what has been polled, and polls nothing itself)."""
        with self._lock:
            seen = {k: (self._correction(r), len(r)) for k, r in self._ratios.items()}
        out: dict = {}
        for (bucket, path), (f, n) in sorted(seen.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            out.setdefault(str(bucket), {})[path] = [None if f is None else round(f, 3), n]
        return out
