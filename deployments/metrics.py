"""Prometheus metrics through Ray Serve's metrics API (exported by Ray's metrics agent).

Histograms are observed per event through hooks in app/ (chat requests, encoder batches); counters
and gauges are synced once a second from the stats app/ already keeps. Names are listed in the
README; Ray prefixes them with `ray_` in the Prometheus output.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from ray.serve.metrics import Counter, Gauge, Histogram

from app.api.chat import WARM_UP
from app.serving.prometheus import gather_within

MS_BOUNDS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000]
MAX_UNKNOWN_NAMES = 64  # distinct unknown parameter names a Router counts by name
FRACTION_BOUNDS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]


def _histogram(name: str, desc: str, bounds: list[float], tags: tuple[str, ...] = ()) -> Histogram:
    return Histogram(name, description=desc, boundaries=bounds, tag_keys=tags)


class RouterMetrics:
    def __init__(self):
        self.requests = Counter("vlm_requests_total", description="chat completion requests by HTTP status",
                                tag_keys=("status",))
        self.ttft = _histogram("vlm_ttft_ms", "time to first token (ms)", MS_BOUNDS)
        self.e2e = _histogram("vlm_e2e_latency_ms", "request end-to-end latency (ms)", MS_BOUNDS)
        self.retries = Counter("vlm_request_retries_total",
                               description="encoder + LLM calls sent again after a replica failed")
        self.media = Counter("vlm_media_requests_total", description="requests with media by where they were "
                             "prepared: local (the Router, at low load) or remote (MediaPreprocessor replicas)",
                             tag_keys=("where",))
        self.unknown = Counter("vlm_unknown_parameters_total", description="request parameters this server does "
                               "not know, ignored (reject_unknown_parameters makes them 400s), by name; names past "
                               f"the first {MAX_UNKNOWN_NAMES} a Router sees count as 'other'", tag_keys=("name",))
        self._unknown_names: set[str] = set()

    def media_where(self, where: str) -> None:
        if not WARM_UP.get():  # a Router's own warm-up requests are not traffic (app/api/chat.py)
            self.media.inc(tags={"where": where})

    def retried(self, n: int) -> None:
        if not WARM_UP.get():
            self.retries.inc(n)

    def unknown_parameter(self, name: str) -> None:
        """One unknown parameter name in a request; the names a tag takes are bounded (clients choose them)."""
        if name not in self._unknown_names and len(self._unknown_names) < MAX_UNKNOWN_NAMES:
            self._unknown_names.add(name)
        self.unknown.inc(tags={"name": name if name in self._unknown_names else "other"})

    def observe(self, record: dict) -> None:
        self.requests.inc(tags={"status": str(record["status"])})
        if record.get("retries"):
            self.retries.inc(record["retries"])
        if record.get("ttft_s") is not None:
            self.ttft.observe(1e3 * record["ttft_s"])
        self.e2e.observe(1e3 * record["e2e_s"])


def _add_delta(counter: Counter, now: dict, last: dict, key: str, tags: dict | None = None) -> None:
    """Increment `counter` by how much the cumulative stat `key` grew since the last sync."""
    delta = now.get(key, 0) - last.get(key, 0)
    if delta > 0:
        counter.inc(delta, tags=tags) if tags else counter.inc(delta)


class _Syncer:
    """Turns cumulative counters from a stats() dict into Counter increments, once a second."""

    def __init__(self, stats: Callable[[], dict], apply: Callable[[dict, dict], None], period_s: float = 1.0):
        self._stats, self._apply, self._period = stats, apply, period_s
        self._last: dict = {}
        threading.Thread(target=self._run, daemon=True, name="metrics-sync").start()

    def _run(self) -> None:
        while True:
            time.sleep(self._period)
            try:
                now = self._stats()
                self._apply(now, self._last)
                self._last = now
            except Exception:  # metrics must never take a replica down
                pass


class EncoderMetrics:
    def __init__(self, stats: Callable[[], dict]):
        self.batch_latency = _histogram("vlm_encoder_batch_latency_ms", "vision encoder batch latency (ms)", MS_BOUNDS)
        self.batch_fill = _histogram("vlm_encoder_batch_fill", "batch tokens / tokens of the chosen budget",
                                     FRACTION_BOUNDS)
        self.queue_wait = _histogram("vlm_encoder_queue_wait_ms", "time an item waits for its batch (ms)", MS_BOUNDS)
        self.graph_hits = Counter("vlm_encoder_graph_hits_total", description="batches replayed from a CUDA graph "
                                  "(or the static-shape path without CUDA)")
        self.uniform_hits = Counter("vlm_encoder_uniform_graph_hits_total",
                                    description="graph hits that replayed an exact-shape (equal-length) graph")
        self.idle_captures = Counter("vlm_encoder_idle_captures_total",
                                     description="exact-shape graphs captured while serving (each blocks the queue once)")
        self.idle_capture_ms = Counter("vlm_encoder_idle_capture_ms_total",
                                       description="time spent on those captures (ms)")
        self.fallbacks = Counter("vlm_encoder_eager_fallbacks_total", description="batches run eagerly, by reason",
                                 tag_keys=("reason",))
        self.padding = Gauge("vlm_encoder_padding_ratio", description="padded tokens / all tokens run, cumulative")
        self.cache_hits = Counter("vlm_encoder_cache_hits_total", description="items served from the embedding cache")
        self.cache_misses = Counter("vlm_encoder_cache_misses_total", description="items that had to be encoded")
        self._sync = _Syncer(stats, self._apply)

    def on_batch(self, latency_s: float, fill: float, waits_s: list[float]) -> None:
        self.batch_latency.observe(1e3 * latency_s)
        self.batch_fill.observe(fill)
        for w in waits_s:
            self.queue_wait.observe(1e3 * w)

    def _apply(self, now: dict, last: dict) -> None:
        for counter, key in ((self.graph_hits, "graph_hits"), (self.uniform_hits, "uniform_hits"),
                             (self.idle_captures, "idle_captures"), (self.idle_capture_ms, "idle_capture_ms"),
                             (self.cache_hits, "cache_hits"), (self.cache_misses, "cache_misses")):
            _add_delta(counter, now, last, key)
        reasons_now, reasons_last = now.get("eager_reasons", {}), last.get("eager_reasons", {})
        for reason in reasons_now:
            _add_delta(self.fallbacks, reasons_now, reasons_last, reason, {"reason": reason})
        self.padding.set(now.get("padding_ratio", 0.0))


class LLMMetrics:
    def __init__(self, load: Callable[[], dict]):
        self.running = Gauge("vlm_llm_running_requests", description="requests being decoded or prefilled")
        self.waiting = Gauge("vlm_llm_waiting_requests", description="requests waiting for KV blocks")
        self.kv_usage = Gauge("vlm_llm_kv_cache_usage", description="fraction of the KV cache in use")
        self.prefix_queried = Counter("vlm_llm_prefix_cache_queried_tokens_total",
                                      description="prompt tokens looked up in the prefix cache")
        self.prefix_hits = Counter("vlm_llm_prefix_cache_hit_tokens_total",
                                   description="prompt tokens whose KV came from the prefix cache")
        self.preemptions = Counter("vlm_llm_preemptions_total",
                                   description="requests preempted for KV blocks (recomputed later)")
        self._sync = _Syncer(load, self._apply)

    def _apply(self, now: dict, last: dict) -> None:
        self.running.set(now["running"])
        self.waiting.set(now["waiting"])
        self.kv_usage.set(now["kv_usage"])
        for counter, key in ((self.prefix_queried, "prefix_cache_queried_tokens"),
                             (self.prefix_hits, "prefix_cache_hit_tokens"), (self.preemptions, "preemptions")):
            _add_delta(counter, now, last, key)


async def broadcast_within(handle, method: str, timeout_s: float) -> tuple[list, int]:
    """Every replica's answer to `method` that comes within `timeout_s`, and how many replicas failed or
    did not answer in time (GET /metrics: a slow or broken replica never holds up a scrape). Waits on
    each replica's result apart where Ray Serve's broadcast response exposes them; else on the whole
    broadcast (all answers or none)."""
    start = time.monotonic()
    response = handle.broadcast(method)
    per_replica = getattr(response, "_fetch_replica_results_async", None)
    try:
        if per_replica is None:
            answers = await response.results_async(timeout_s=timeout_s, return_exceptions=True)
            ok = [a for a in answers if not isinstance(a, BaseException)]
            return ok, len(answers) - len(ok)
        calls = await asyncio.wait_for(per_replica(), timeout_s)
    except Exception:  # no replica could be asked in time: one unanswered, at least
        return [], 1
    remaining = max(0.05, timeout_s - (time.monotonic() - start))
    return await gather_within([call.get_async() for call in calls], remaining)
