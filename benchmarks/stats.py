"""Percentiles for the benchmark reports: nearest rank on the sorted samples, no interpolation."""

from __future__ import annotations


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of `xs`; NaN for no samples."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def p99(xs: list[float]) -> float:
    return pct(xs, 0.99)
