"""Python's garbage collector in a serving process: each collection's pause, counted per generation.

Why: a full (generation 2) collection walks every object the process tracks, with the GIL held: the
engine thread, the event loop and the tower's batches all stop for it. A replica that has imported torch,
transformers, Ray and FastAPI holds about 550,000 objects when it starts serving; a full collection of
that many took 220 ms on the CPU machine and up to 356 ms in an LLM replica starting on an H200 host.

Ray Serve 2.60 already takes them out of reach: at the end of a replica's constructor it collects and
freezes the heap (`gc.freeze`, `RAY_SERVE_FREEZE_GC_ON_STARTUP`, on by default), so later full
collections walk only what was made since. Measured under Poisson load on one H200 (2026-12-01,
benchmarks/results/2026-12-01-encode-parts-ready-h200.md): one or two full collections per LLM replica in
each 6 s window at 120-155 req/s, 6-8 ms each. Not the TTFT tail; these counters are how to see that it
stays so (`replica_load()["gc"]`, which benchmarks/goodput.py diffs over each window). A copy of our own
freeze was measured and dropped, as it repeated Ray's.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field


@dataclass
class GcPauses:
    """Per generation (0, 1, 2): collections seen, their summed and longest pause in seconds."""

    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    total_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    max_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _started: float | None = None

    def callback(self, phase: str, info: dict) -> None:
        """gc.callbacks' signature; collections do not nest, so one start time serves."""
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed during a collection
            return
        pause, self._started = time.perf_counter() - self._started, None
        g = min(int(info.get("generation", 2)), 2)
        self.collections[g] += 1
        self.total_s[g] += pause
        self.max_s[g] = max(self.max_s[g], pause)

    def snapshot(self) -> dict:
        """Counters for stats answers: cumulative, in ms, with the objects frozen out of reach."""
        return {"collections": list(self.collections), "pause_ms_total": [round(1e3 * s, 3) for s in self.total_s],
                "pause_ms_max": [round(1e3 * s, 3) for s in self.max_s], "frozen_objects": gc.get_freeze_count()}


_PAUSES: GcPauses | None = None


def watch() -> GcPauses:
    """This process's pause counters, installed on the first call (later calls return the same ones)."""
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = GcPauses()
        gc.callbacks.append(_PAUSES.callback)
    return _PAUSES
