"""Host-side timing and percentiles for the benchmark reports (percentiles: nearest rank on the
sorted samples, no interpolation). GPU work is timed with app.vision.timing.cuda_times_ms."""

from __future__ import annotations

import time


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of `xs`; NaN for no samples."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


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
