"""Device time of bracketed work (the engine's steps, the tower's batches), summed without the host
ever waiting for the device. NVML's utilisation only says some kernel ran (96% busy at 100 req/s on
a GPU that sustains 240, issue 45); this is the time the stream spent on the work.

Each bracket is two CUDA events on the stream the work runs on (outside any graph replay); pairs wait
in a bounded deque and are read once their end event has passed, never before; events are pooled.
A bracket also counts device idle time inside it and work another thread queued on the same stream
meanwhile (`fused` with `encoder.stream: shared`): such overlaps are counted as `..._gpu_interleaved`
on both timers. Without CUDA the same interface reads `time.perf_counter()` (`..._gpu_clock` says
which: "cuda_events" or "host_clock"). Details: docs/guides/goodput.md, "GPU time per request".
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

CUDA_EVENTS, HOST_CLOCK = "cuda_events", "host_clock"
MAX_PENDING = 1024  # pairs waiting for the device before new ones are dropped

# brackets per stream, across every timer of the process: stream key -> [open now, opened so far]
_streams: dict[tuple, list[int]] = {}
_streams_lock = threading.Lock()


def _open(key: tuple) -> tuple[int, bool]:
    """A bracket opens on `key`: (its sequence number there, whether another one is open now)."""
    with _streams_lock:
        s = _streams.setdefault(key, [0, 0])
        busy = s[0] > 0
        s[0] += 1
        s[1] += 1
        return s[1], busy


def _close(key: tuple, opened: int) -> bool:
    """A bracket closes: whether another one opened on `key` since it did."""
    with _streams_lock:
        s = _streams[key]
        s[0] -= 1
        return s[1] != opened


def _stream_key(stream) -> tuple:
    return ("cuda", getattr(stream, "device_index", None), getattr(stream, "cuda_stream", id(stream)))


class Mark:
    """One open bracket: its start (an event, or a clock reading) and the stream it was recorded on."""

    __slots__ = ("start", "stream", "key", "opened", "shared")

    def __init__(self, start, stream, key: tuple, opened: int, shared: bool):
        self.start, self.stream, self.key, self.opened, self.shared = start, stream, key, opened, shared


class _Timed:
    """`with timer.timed():` — the block bracketed; not counted if it raises."""

    __slots__ = ("timer", "mark")

    def __init__(self, timer: GpuTimer):
        self.timer, self.mark = timer, None

    def __enter__(self) -> None:
        self.mark = self.timer.start()

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.timer.stop(self.mark)
        else:
            self.timer.cancel(self.mark)


class GpuTimer:
    """Cumulative device milliseconds of bracketed work and the number of brackets timed.

    `device`: where the work runs; CUDA events on a CUDA device, the host clock otherwise. `new_event`,
    `current_stream`, `capturing`: what stands for `torch.cuda.Event(enable_timing=True)`,
    `torch.cuda.current_stream()` and `torch.cuda.is_current_stream_capturing()` (tests pass fakes;
    giving `new_event` selects the event path whatever the device). `clock`: the host clock.

    One thread brackets (start, stop, cancel); any thread may call `poll` and `snapshot`."""

    def __init__(self, device: torch.device | str | None = None, *, max_pending: int = MAX_PENDING,
                 new_event: Callable[[], object] | None = None, current_stream: Callable[[], object] | None = None,
                 capturing: Callable[[], bool] | None = None, clock: Callable[[], float] = time.perf_counter):
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.events = new_event is not None or dev.type == "cuda"
        self.source = CUDA_EVENTS if self.events else HOST_CLOCK
        self.max_pending = max_pending
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._current_stream = current_stream or (lambda: torch.cuda.current_stream(dev))
        if capturing is None:
            capturing = torch.cuda.is_current_stream_capturing if new_event is None else (lambda: False)
        self._capturing = capturing
        self._clock = clock
        self._pool: list = []  # events read (or never ended), ready to be recorded again
        self._pool_max = 2 * max_pending + 8
        self._pending: deque = deque()  # (start event, end event, shared), oldest first
        self._lock = threading.Lock()
        self.ms_total = 0.0
        self.count = 0  # brackets whose time is in ms_total
        self.interleaved = 0  # of those, brackets that overlapped another one on the same stream
        self.dropped = 0  # brackets not timed: too many pending

    # ------------------------------------------------------------------ bracketing
    def start(self) -> Mark | None:
        """Open a bracket on the current stream (None: not timed, the stream is capturing a graph)."""
        if not self.events:
            opened, busy = _open((HOST_CLOCK,))
            return Mark(self._clock(), None, (HOST_CLOCK,), opened, busy)
        if self._capturing():
            return None
        stream = self._current_stream()
        ev = self._event()
        ev.record(stream)
        key = _stream_key(stream)
        opened, busy = _open(key)
        return Mark(ev, stream, key, opened, busy)

    def stop(self, mark: Mark | None) -> None:
        """Close the bracket: its end recorded on its start's stream; its time is added once the device
        has passed it (read by a later stop or snapshot)."""
        if mark is None:
            return
        shared = _close(mark.key, mark.opened) or mark.shared
        if not self.events:
            ms = 1e3 * (self._clock() - mark.start)
            with self._lock:
                self._add(ms, shared)
            return
        with self._lock:
            self._poll()
            if len(self._pending) >= self.max_pending:
                self.dropped += 1
                self._recycle(mark.start)
                return
        end = self._event()
        end.record(mark.stream)
        with self._lock:
            self._pending.append((mark.start, end, shared))

    def cancel(self, mark: Mark | None) -> None:
        """Close the bracket without counting it (the work failed)."""
        if mark is None:
            return
        _close(mark.key, mark.opened)
        if self.events:
            with self._lock:
                self._recycle(mark.start)

    def timed(self) -> _Timed:
        """A context manager bracketing its block (not counted when the block raises)."""
        return _Timed(self)

    # ------------------------------------------------------------------ reading
    def poll(self) -> None:
        """Add the pairs whose end event has passed; never waits."""
        if self.events:
            with self._lock:
                self._poll()

    def snapshot(self, prefix: str, unit: str = "steps") -> dict:
        """The cumulative counters under `prefix`: `{prefix}_gpu_ms_total`, `{prefix}_timed_{unit}`,
        `{prefix}_gpu_interleaved`, `{prefix}_gpu_dropped`, `{prefix}_gpu_pending`, `{prefix}_gpu_clock`."""
        with self._lock:
            if self.events:
                self._poll()
            return {f"{prefix}_gpu_ms_total": self.ms_total, f"{prefix}_timed_{unit}": self.count,
                    f"{prefix}_gpu_interleaved": self.interleaved, f"{prefix}_gpu_dropped": self.dropped,
                    f"{prefix}_gpu_pending": len(self._pending), f"{prefix}_gpu_clock": self.source}

    # ------------------------------------------------------------------ inside (lock held where noted)
    def _event(self):
        try:
            return self._pool.pop()  # (atomic: the reading thread may append meanwhile)
        except IndexError:
            return self._new_event()

    def _recycle(self, *events) -> None:
        if len(self._pool) < self._pool_max:
            self._pool.extend(events)

    def _add(self, ms: float, shared: bool) -> None:  # lock held
        self.ms_total += ms
        self.count += 1
        self.interleaved += shared

    def _poll(self) -> None:  # lock held
        pending = self._pending
        while pending and pending[0][1].query():
            start, end, shared = pending.popleft()
            self._add(start.elapsed_time(end), shared)
            self._recycle(start, end)
