"""The progress line (rows done, rows/s, tokens/s, ETA) and the end report.

Rates count this run's rows only: rows skipped because an earlier run wrote them are neither
throughput nor remaining work. Rows left without a final answer (a server error, or not started after a
pool gave up) are counted apart: they are what a rerun of the job answers.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass
class Progress:
    total: int  # input rows, including those skipped
    skipped: int = 0
    done: int = 0  # answered with a completion
    failed: int = 0  # answered with an error object: the row's own (a client error, or its own 500)
    left: int = 0  # not answered: the server could not (503, not written) or not started; a rerun answers them
    left_error: str | None = None  # the last of their server errors, for the end message
    completion_tokens: int = 0
    prompt_tokens: int = 0
    media_items: int = 0
    start: float = field(default_factory=time.perf_counter)
    stream: object = None  # None: sys.stderr as it is when a line is printed (not when this was imported)

    @property
    def finished(self) -> int:
        return self.done + self.failed

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    def record(self, row: dict, items: int = 0, final: bool = True) -> None:
        """One row's record; `items` are its images and videos; `final`: written (else left for a rerun)."""
        if not final:
            self.left += 1
            self.left_error = row["error"]["message"]
            return
        if "error" in row:
            self.failed += 1
            return
        self.done += 1
        u = row["usage"]
        self.completion_tokens += u["completion_tokens"]
        self.prompt_tokens += u["prompt_tokens"]
        self.media_items += items

    def line(self) -> str:
        t = self.elapsed()
        todo = self.total - self.skipped
        rate = self.finished / t
        eta = (todo - self.finished) / rate if rate > 0 else float("inf")
        pct = 100.0 * self.finished / todo if todo else 100.0
        return (f"[batch] {self.finished}/{todo} rows ({pct:.0f}%), {self.failed} failed, {self.left} to retry, "
                f"{self.skipped} skipped | "
                f"{rate:.2f} rows/s, {self.completion_tokens / t:.1f} tok/s | elapsed {_duration(t)} "
                f"ETA {'?' if eta == float('inf') else _duration(eta)}")

    def show(self) -> None:
        print(self.line(), file=self.stream or sys.stderr, flush=True)

    def report(self, encoder_stats: dict | None, pools: dict) -> dict:
        t = self.elapsed()
        enc = encoder_stats or {}
        hits, eager = enc.get("graph_hits", 0), enc.get("eager_batches", 0)
        return {
            "rows": self.total, "done": self.done, "failed": self.failed, "skipped": self.skipped,
            "left": self.left, "left_error": self.left_error,
            "elapsed_s": round(t, 3),
            "rows_per_s": self.finished / t, "completion_tokens_per_s": self.completion_tokens / t,
            "prompt_tokens_per_s": self.prompt_tokens / t, "media_items_per_s": self.media_items / t,
            "completion_tokens": self.completion_tokens, "media_items": self.media_items,
            "encoder": {"graph_hit_rate": hits / (hits + eager) if hits + eager else 0.0, "graph_hits": hits,
                        "eager_batches": eager, "eager_reasons": enc.get("eager_reasons", {}),
                        "batches": enc.get("batches", 0), "items_per_batch": enc.get("items_per_batch", 0.0),
                        "batch_fill": enc.get("batch_fill", 0.0), "padding_ratio": enc.get("padding_ratio", 0.0),
                        "cache_hits": enc.get("cache_hits", 0)},
            "pools": pools,
        }
