"""Pixel rows to the GPU through pinned host buffers and a copy stream of their own
(`encoder.pinned_pixel_copy`).

The rows arrive as pageable memory (numpy views of Ray's object store), and CUDA synchronises the
stream before a copy from pageable memory. Under the `fused` placement the tower shares the stream
with the LLM engine, so every batch's copy first waits for the engine's queued step, and the tower's
kernels then start on an empty GPU queue (what a 1024^2 image's copy costs:
benchmarks/results/2026-11-23-one-h200-gpu-ceiling-host-path.md). Staged in pinned memory, the copy
is queued and the host goes on; on a stream of its own it does not wait for the engine's step either.
"""

from __future__ import annotations

import torch


def copy_rows(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """The rows of `parts`, one after the other, into `out`, each copied from where it is (the path
    without staging)."""
    off = 0
    for p in parts:
        out[off:off + p.shape[0]].copy_(p, non_blocking=True)
        off += p.shape[0]


class PinnedStaging:
    """Two buffers (by default) used in turn, and a copy stream.

    The copy waits only for the last reader of its destination (`ready`, an event the caller recorded
    after the graph replay that read the static pixel buffer), and the compute stream waits for the
    copy. Destinations made here (`to_device`) are allocated on the copy stream and marked as used by
    the compute stream. An event recorded after each copy says when its buffer may be written again:
    normally long before, since the batch after next needs it. A batch larger than a buffer or smaller
    than `min_rows`, or rows already on the device, are copied as before. Small batches stay direct
    because a single small image staged lost time to first token at low load (cause not found),
    while under load staging served more requests per second
    (benchmarks/results/2026-11-23-1024-one-h200-gpu-time-pinned-copies.md)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device, buffers: int = 2,
                 pin: bool = True, min_rows: int = 0):
        """`rows` x `cols` per buffer (the largest batch that goes this way); batches under `min_rows` go
        directly; `pin=False` stages in ordinary memory (the CPU's tests of the logic; no gain)."""
        self.device = device
        self._bufs = [torch.empty(rows, cols, dtype=dtype, pin_memory=pin) for _ in range(buffers)]
        self._events: list[torch.cuda.Event | None] = [None] * buffers
        self._next = 0
        self.min_rows = min_rows
        self._stream = torch.cuda.Stream(device) if pin and device.type == "cuda" else None
        self.staged = 0  # batches that went through a buffer
        self.direct = 0  # batches too large for one (or already on the device), copied from where they were

    def copy(self, parts: list[torch.Tensor], out: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        """The rows of `parts`, one after the other, into `out` (on the device; as many rows as the parts
        together, same width and dtype). The current stream waits for the copy; the copy waits for
        `ready` (when given: the last reader of `out`) and nothing else."""
        n = sum(p.shape[0] for p in parts)
        i = self._next
        buf = self._bufs[i]
        if not self.min_rows <= n <= buf.shape[0] or any(p.device != buf.device for p in parts):
            self.direct += 1
            copy_rows(parts, out)
            return
        self._next = (i + 1) % len(self._bufs)
        if self._events[i] is not None:
            self._events[i].synchronize()  # the copy that last read this buffer has finished
        host = buf[:n]
        torch.cat(parts, out=host)
        if self._stream is None:
            out.copy_(host)
        else:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                out.copy_(host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            compute.wait_event(ev)
            self._events[i] = ev
        self.staged += 1

    def to_device(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The rows of `parts`, concatenated, as a new tensor on the device, usable on the current stream."""
        first = parts[0]
        shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
        if self._stream is None:
            out = torch.empty(shape, dtype=first.dtype, device=self.device)
        else:
            with torch.cuda.stream(self._stream):  # the allocator then hands out no block the compute
                out = torch.empty(shape, dtype=first.dtype, device=self.device)  # stream may still use
            out.record_stream(torch.cuda.current_stream(self.device))
        self.copy(parts, out)
        return out
