"""Python's garbage collector in a serving process: each collection's pause, counted per generation.

Why: a full (generation 2) collection walks every object the process tracks with the GIL held, so the
engine thread, the event loop and the tower all stop for it. A serving replica holds about 550,000
objects; a full collection of that many took 220 ms on the CPU machine. Ray Serve 2.60 already freezes
a replica's heap when its constructor returns (`gc.freeze`, `RAY_SERVE_FREEZE_GC_ON_STARTUP`, on by
default), so later full collections walk only what was made since. Under Poisson load on one H200 the
LLM replicas then made 0-2 full collections per 6 s window, 6-8 ms each, with or without a freeze of our
own, which was measured and dropped (benchmarks/results/2026-12-01-encode-parts-ready-h200.md). These
counters show that it stays so: `replica_load()["gc"]`, diffed over each window by benchmarks/goodput.py.
The frozen objects are counted once: `gc.get_freeze_count()` walks them all with the GIL held (29-41 ms
for a replica's 307,000 on the CPU machine), and on each read it was 7-9% of an LLM replica's GIL samples.
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
    _frozen: int = 0

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
        """Counters for stats answers: cumulative, in ms, with the objects frozen out of reach. Those are
        counted until a count finds some (free while none are: the walk is over an empty list), then kept:
        Ray Serve freezes a replica's heap once, when its constructor returns."""
        if not self._frozen:
            self._frozen = gc.get_freeze_count()
        return {"collections": list(self.collections), "pause_ms_total": [round(1e3 * s, 3) for s in self.total_s],
                "pause_ms_max": [round(1e3 * s, 3) for s in self.max_s], "frozen_objects": self._frozen}


_PAUSES: GcPauses | None = None


def watch() -> GcPauses:
    """This process's pause counters, installed on the first call (later calls return the same ones)."""
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = GcPauses()
        gc.callbacks.append(_PAUSES.callback)
    return _PAUSES
