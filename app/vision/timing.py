"""CUDA-event timing shared by the auto-tune and the benchmarks."""

from __future__ import annotations

import torch


def cuda_times_ms(fn, runs: int, warmup: int = 3) -> list[float]:
    """Milliseconds of `fn()` per run, each bracketed by CUDA events, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out
