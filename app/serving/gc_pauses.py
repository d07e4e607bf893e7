"""Python's garbage collector in a serving process: frozen once the process is warm, its pauses counted.

Why: a full (generation 2) collection walks every object the process holds, and a replica that has
imported torch, transformers, Ray and FastAPI holds about 440,000 of them before it serves anything.
One such collection took 220 ms on the CPU machine, with the GIL held: the engine thread, the event loop
and the tower's batches all stop for it, and every request in flight gets those milliseconds added to
its time to first token. CPython starts one whenever the objects that survived since the last grow past
a quarter of the long-lived ones, which under load is every few seconds, and the p99 of TTFT is where
such stops show.

What: `freeze_heap()`, called when start-up and warm-up are done, collects once and moves every object
still alive into the permanent generation (`gc.freeze`), which later collections skip: a full one then
walks only what was made since (2.3 ms instead of 220 on the CPU machine). vLLM freezes after its warm-up
as well, and SGLang offers it behind a flag. Objects made later (requests, their sequences) are still
collected as before. `watch()` installs `GcPauses`, which times every collection from `gc.callbacks`, so
that a replica's stats say whether long pauses remain (`replica_load()["gc"]`, per generation).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


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
        """Counters for stats answers: cumulative, in ms, with the objects `freeze_heap` set aside."""
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


def freeze_heap(what: str, enabled: bool = True) -> dict | None:
    """Collect once, then freeze every object that is left (see the module docstring); `what` names the
    process in the log. Returns what it did, or None when `enabled` is false (`gc_freeze: false`)."""
    if not enabled:
        return None
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    done = {"frozen_objects": gc.get_freeze_count(), "seconds": time.perf_counter() - t}
    log.info("%s: %d objects frozen out of the garbage collector's reach in %.2f s", what,
             done["frozen_objects"], done["seconds"])
    return done
