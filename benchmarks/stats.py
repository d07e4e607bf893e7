"""Host-side timing and percentiles for the benchmark reports (percentiles: nearest rank on the
sorted samples, no interpolation). GPU work is timed with app.gpu.kernel_timing.cuda_times_ms."""

from __future__ import annotations

import math
import time


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of `xs` by nearest rank: the smallest sample with at least a share q
    of the samples at or below it (rank ceil(q * n)); NaN for no samples. (Until 2026-11-28 it took rank
    round(q * (n - 1)) + 1, one rank too low for many n: with 60 samples, p99 was the second largest, so
    one slow request in 60 never showed.)"""
    xs = sorted(xs)
    return xs[min(len(xs), max(1, math.ceil(q * len(xs) - 1e-9))) - 1] if xs else float("nan")


def p99(xs: list[float]) -> float:
    return pct(xs, 0.99)


def wall_times_ms(fn, runs: int) -> list[float]:
    """Wall-clock ms of `runs` calls of `fn`, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times
