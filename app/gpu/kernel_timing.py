"""CUDA-event timing of kernels, shared by the start-up tuning (the tower's auto-tune and GEMM choice, the
engine's matrix-vector choice) and the benchmarks."""

from __future__ import annotations

import statistics

import torch

from .capture import collection_paused


def cuda_times_ms(fn, runs: int, warmup: int = 3) -> list[float]:
    """Milliseconds of `fn()` per run, each bracketed by CUDA events, after `warmup` untimed runs. Waits
    on the current stream only: the tuning runs in serving processes whose other threads keep working."""
    for _ in range(warmup):
        fn()
    torch.cuda.current_stream().synchronize()
    out = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def graph_us(fn, inner: int = 1, runs: int = 30, warmup: int = 3, stream: torch.cuda.Stream | None = None) -> float:
    """Median µs of one `fn()` call replayed from a CUDA graph of `inner` calls, so that launch gaps
    weigh as they do inside the tower's graphs (the kernel benchmarks' timer). `fn` is run `warmup`
    times on a side stream first: capture needs its lazy initialisation (cuBLAS handles, workspaces,
    Triton compiles) done.

    The down projection's tuning (down_projection.py) calls this at run time too, for each new
    uniform shape, while other threads of the process may keep using the GPU. So the capture is
    thread-local, as the graph manager's (a global one forbids other threads' allocations and
    synchronisations), and it is begun on the side stream directly rather than through
    `torch.cuda.graph`, whose entry synchronises the whole device and empties the allocator's caches;
    every wait here is on the streams used."""
    side = stream or torch.cuda.Stream()  # a caller timing many things passes one (each keeps a cuBLAS workspace)
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
        side.synchronize()  # the warm-up has finished before capture begins (torch.cuda.graph syncs the device)
        with collection_paused():
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for _ in range(inner):
                    fn()
            finally:
                graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    times = cuda_times_ms(graph.replay, runs, warmup)
    return statistics.median(times) * 1000 / inner
