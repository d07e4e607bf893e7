"""Pixel rows to the GPU through pinned host buffers (`encoder.pinned_pixel_copy`, off by default).

The rows arrive as pageable memory (numpy views of Ray's object store). CUDA synchronises the stream
before a copy from pageable memory. Under the `fused` placement the tower shares the stream with the
LLM engine, so every batch's copy first waits for the engine's queued step, and the tower's kernels
then start on an empty GPU queue. A 1024^2 image's rows took 0.57 ms of copy on an H200, from pageable
memory (benchmarks/RESULTS.md, "One H200 again"). Staged in pinned memory, the copy is queued like a
kernel and the host goes on.

Two buffers are used in turn. An event recorded after each copy says when its buffer may be written
again: normally long before, since the batch after next needs it. A batch larger than a buffer, or
rows already on the device, are copied as before.
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
    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device, buffers: int = 2,
                 pin: bool = True):
        """`rows` x `cols` per buffer (the largest batch that goes this way); `pin=False` stages in
        ordinary memory (the CPU's tests of the logic; no gain)."""
        self.device = device
        self._bufs = [torch.empty(rows, cols, dtype=dtype, pin_memory=pin) for _ in range(buffers)]
        self._events: list[torch.cuda.Event | None] = [None] * buffers
        self._next = 0
        self.staged = 0  # batches that went through a buffer
        self.direct = 0  # batches too large for one (or already on the device), copied from where they were

    def copy(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        """The rows of `parts`, one after the other, into `out` (on the device; as many rows as the parts
        together, same width and dtype). Queued on the current stream."""
        n = sum(p.shape[0] for p in parts)
        i = self._next
        buf = self._bufs[i]
        if n > buf.shape[0] or any(p.device != buf.device for p in parts):
            self.direct += 1
            copy_rows(parts, out)
            return
        self._next = (i + 1) % len(self._bufs)
        if self._events[i] is not None:
            self._events[i].synchronize()  # the copy that last read this buffer has finished
        host = buf[:n]
        torch.cat(parts, out=host)
        out.copy_(host, non_blocking=True)
        if out.is_cuda:
            ev = torch.cuda.Event()
            ev.record()
            self._events[i] = ev
        self.staged += 1

    def to_device(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The rows of `parts`, concatenated, as a new tensor on the device."""
        first = parts[0]
        out = torch.empty(sum(p.shape[0] for p in parts), *first.shape[1:], dtype=first.dtype, device=self.device)
        self.copy(parts, out)
        return out
