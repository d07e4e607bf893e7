"""What a replica did while it started, and when (wall clock).

A replica added under load starts beside replicas that serve, often on the same GPU: its weights, graph
captures, auto-tune runs and warm-up requests take GPU time from theirs. On one H200 the TTFT of the
serving replica rose to 2.4x warm during the 15 s before the new one joined
(benchmarks/results/2026-11-27-goodput-one-and-four-gpus.md). The phases say which part of the start it
was: the LLM replica reports them in `/v1/llm/load` ("startup"), and benchmarks/goodput.py lays each
second's TTFT over them.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

# When this process first imported the serving code: for a replica, when its worker began loading the
# deployment (a pooled Ray worker may have been started long before it was given the replica, so the
# process's own start time would say nothing about the deploy)
IMPORTED_AT = time.time()


@dataclass
class StartupTimeline:
    """Named phases, each a start and an end in seconds since the epoch, in the order they ended."""

    started_at: float = field(default_factory=time.time)
    phases: list[dict] = field(default_factory=list)
    code_loaded_at: float = IMPORTED_AT

    @contextmanager
    def phase(self, name: str):
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start, time.time())

    def add(self, name: str, start: float, end: float) -> None:
        self.phases.append({"name": name, "start": start, "end": end})

    def extend(self, prefix: str, phases: list[tuple[str, float, float]]) -> None:
        """Phases another part recorded itself (the engine's), under `prefix`."""
        for name, start, end in phases:
            self.add(f"{prefix}: {name}", start, end)

    def as_dict(self) -> dict:
        return {"started_at": self.started_at, "code_loaded_at": self.code_loaded_at, "phases": list(self.phases)}
