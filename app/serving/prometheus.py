"""Prometheus text for `GET /metrics` on the serving port, in vLLM's metric names where the meaning is
the same, so tools and dashboards built for vLLM (AIPerf's server metrics, `vllm:*` Grafana boards) work.

Each LLM replica keeps `RequestMetrics` (counters and fixed-bucket histograms of its requests,
updated per streamed chunk, never per token). A scrape reaches one Router, which asks every LLM
replica (and every VisionEncoder replica) for its snapshot within a short timeout and sums them, so
the answer does not depend on the Router; a replica that did not answer is left out and counted
(`vlm:metrics_replicas_unanswered`). Only `model_name` (and `finished_reason`, `reason`,
`deployment`) labels the series: nothing per replica. Ray's own export (deployments/metrics.py,
`ray_vlm_*` on Ray's metrics port) is separate and unchanged.
"""

from __future__ import annotations

import asyncio
import threading
import time
from bisect import bisect_left
from collections.abc import AsyncIterator

from ..errors import ClientError
from ..llm.stream import Cancelled
from .replica_stats import merge_encoder_stats

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py); inter-token latency gains three below 10 ms, where a
# decode step on a current GPU lands (histogram_quantile works with any bounds)
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BOUNDS = (0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
              7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
              960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's `finished_reason` values
# Chunk.timing's keys -> (histogram, metric, help): vLLM's queue and prefill times, and our tower's share
TTFT_PARTS = {
    "queue_s": ("queue", "vllm:request_queue_time_seconds",
                "Time in the LLM engine's queue before a request's first step, in seconds."),
    "prefill_s": ("prefill", "vllm:request_prefill_time_seconds",
                  "Time from a request's first engine step to its first token (its prompt's prefill), in seconds."),
    "encode_s": ("encode", "vlm:request_encode_time_seconds",
                 "Time encoding a request's media in the LLM replica (fused placement: the tower's queue and "
                 "batch), in seconds."),
    # the encode time's three parts (app/vision/batcher.py, EncodeBatcher.submit), for requests that ran a batch
    "encode_wait_s": ("encode_wait", "vlm:request_encode_wait_time_seconds",
                      "Fused placement: time a request's media waited for the tower batch that ran its last "
                      "piece to begin, in seconds."),
    "encode_run_s": ("encode_run", "vlm:request_encode_run_time_seconds",
                     "Fused placement: time of the tower batch that ran a request's last piece (its thread hop, "
                     "host work and launches), in seconds."),
    "encode_wake_s": ("encode_wake", "vlm:request_encode_wake_time_seconds",
                      "Fused placement: time from a request's embeddings being ready to its coroutine running "
                      "again (the replica's event loop lag), in seconds."),
}


def one_two_five(top: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `top` (vLLM's token-count buckets up to max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram:
    """Fixed bounds; `counts[i]` observations in (bounds[i-1], bounds[i]], the last one above every bound.
    Not locked itself: RequestMetrics holds the lock."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.total += value * times

    def snapshot(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}


class RequestMetrics:
    """One LLM replica's request counters and histograms, cumulative since the replica started.

    `observe(chunks, prompt_tokens, choices)` wraps a request's chunk stream (app.llm.stream.Chunk, any
    object with `index`, `token_ids`, `finish_reason` and `completion_tokens`) and yields it unchanged.
    Each of a request's `n` choices counts as one request, as vLLM counts its parallel samples; the
    prompt counts once per request (as the response's `usage` does), when its first token arrives.
    """

    def __init__(self, max_model_len: int = 8192):
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        tokens = one_two_five(max_model_len)
        self.ttft, self.e2e = Histogram(TTFT_BOUNDS), Histogram(E2E_BOUNDS)
        # the time to first token's parts, from each choice's first chunk (Chunk.timing): where it goes
        self.parts = {part: Histogram(TTFT_BOUNDS) for part in TTFT_PARTS}
        self.itl, self.tpot = Histogram(ITL_BOUNDS), Histogram(ITL_BOUNDS)
        self.prompt_hist, self.generation_hist = Histogram(tokens), Histogram(tokens)

    async def observe(self, chunks: AsyncIterator, prompt_tokens: int, choices: int = 1,
                      t0: float | None = None) -> AsyncIterator:
        """Yield `chunks`, counting them; times from `t0` (a `time.perf_counter()`; default: the first
        read). The request ends as its chunks say (`stop`, `length`), as `abort` when it is closed or
        cancelled first, as `error` when its stream fails; refused before its first token (a
        ClientError: full queue, prompt too long) it counts nowhere."""
        req = _Request(self, prompt_tokens, choices, t0)
        outcome = "abort"
        try:
            async for chunk in chunks:
                req.chunk(chunk)
                yield chunk
        except ClientError:
            outcome = "error" if req.started else None
            raise
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "abort"
            raise
        except Cancelled:  # cancelled in the engine before it finished
            outcome = "abort"
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            req.close(outcome)

    def snapshot(self) -> dict:
        with self._lock:
            return {"prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                    "finished": dict(self.finished),
                    "histograms": {"ttft": self.ttft.snapshot(), "e2e": self.e2e.snapshot(),
                                   "itl": self.itl.snapshot(), "tpot": self.tpot.snapshot(),
                                   "prompt_tokens": self.prompt_hist.snapshot(),
                                   "generation_tokens": self.generation_hist.snapshot(),
                                   **{TTFT_PARTS[k][0]: h.snapshot() for k, h in self.parts.items()}}}


class _Request:
    """One request's choices while they stream: when each began and last advanced, its tokens."""

    __slots__ = ("m", "t0", "prompt", "started", "first", "last", "tokens", "done")

    def __init__(self, metrics: RequestMetrics, prompt_tokens: int, choices: int, t0: float | None = None):
        self.m, self.prompt, self.started = metrics, prompt_tokens, False
        self.t0 = time.perf_counter() if t0 is None else t0
        self.first: list[float | None] = [None] * choices
        self.last = [0.0] * choices
        self.tokens = [0] * choices
        self.done = [False] * choices

    def chunk(self, c) -> None:
        now, i, k = time.perf_counter(), c.index, len(c.token_ids)
        m = self.m
        with m._lock:
            if self.first[i] is None:
                self.first[i] = now
                m.ttft.observe(now - self.t0)
                for key, value in (getattr(c, "timing", None) or {}).items():
                    if key in m.parts:
                        m.parts[key].observe(value)
                if not self.started:  # the prompt is prefilled once, whatever the choices
                    self.started = True
                    m.prompt_tokens += self.prompt
                    m.prompt_hist.observe(self.prompt)
            elif k:  # a chunk's tokens share the time since the last one
                m.itl.observe((now - self.last[i]) / k, k)
            if k:
                self.last[i] = now
            self.tokens[i] += k
            m.generation_tokens += k
            if c.finish_reason:
                extra = c.completion_tokens - self.tokens[i]  # the count the response's usage reports
                if extra > 0:
                    self.tokens[i] += extra
                    m.generation_tokens += extra
                self._finish(i, c.finish_reason if c.finish_reason in ("stop", "length") else "abort", now)

    def close(self, outcome: str | None) -> None:
        """The stream ended: choices that did not finish end with `outcome` (None: not counted)."""
        if outcome is None or all(self.done):
            return
        now = time.perf_counter()
        with self.m._lock:
            for i, done in enumerate(self.done):
                if not done:
                    self._finish(i, outcome, now)

    def _finish(self, i: int, reason: str, now: float) -> None:
        m, n = self.m, self.tokens[i]
        self.done[i] = True
        m.finished[reason] = m.finished.get(reason, 0) + 1
        m.e2e.observe(now - self.t0)
        m.generation_hist.observe(n)
        if n > 1 and self.first[i] is not None:
            m.tpot.observe((self.last[i] - self.first[i]) / (n - 1))


# ---------------------------------------------------------------------------------------------- merge
LOAD_COUNTS = ("running", "waiting", "kv_blocks", "kv_blocks_free", "prefix_cache_queried_tokens",
               "prefix_cache_hit_tokens", "preemptions")


def _add_histogram(into: dict | None, h: dict) -> dict:
    """Bucket-wise sum. Bounds that differ (replicas of another max_model_len during a redeploy): each
    bucket of `h` goes to the first bound of `into` at or above its own upper bound, so no count lands
    below a value it may hold."""
    if into is None:
        return {"bounds": list(h["bounds"]), "counts": list(h["counts"]), "sum": float(h["sum"])}
    bounds, counts = into["bounds"], into["counts"]
    if list(h["bounds"]) == bounds:
        for j, c in enumerate(h["counts"]):
            counts[j] += c
    else:
        uppers = list(h["bounds"]) + [float("inf")]
        for upper, c in zip(uppers, h["counts"]):
            counts[bisect_left(bounds, upper)] += c
    into["sum"] += float(h["sum"])
    return into


def merge_snapshots(reports: list[dict]) -> dict:
    """LLM replicas' `metrics_snapshot()`s summed: counters and histogram buckets add up; `load` holds
    the engines' summed queue, KV blocks and prefix-cache counts; `engine_gpu_ms_total` their steps'
    device time; `encoders` their towers' stats (the `fused` placement)."""
    out = {"prompt_tokens": 0, "generation_tokens": 0, "finished": dict.fromkeys(FINISH_REASONS, 0),
           "histograms": {}, "load": dict.fromkeys(LOAD_COUNTS, 0), "encoders": [], "engine_gpu_ms_total": 0.0}
    for r in reports:
        out["prompt_tokens"] += r.get("prompt_tokens", 0)
        out["generation_tokens"] += r.get("generation_tokens", 0)
        for reason, n in r.get("finished", {}).items():
            out["finished"][reason] = out["finished"].get(reason, 0) + n
        for name, h in r.get("histograms", {}).items():
            out["histograms"][name] = _add_histogram(out["histograms"].get(name), h)
        for key in LOAD_COUNTS:
            out["load"][key] += r.get("load", {}).get(key, 0)
        out["engine_gpu_ms_total"] += r.get("load", {}).get("engine_gpu_ms_total", 0.0)  # app/gpu/timing.py
        if r.get("encoder"):
            out["encoders"].append(r["encoder"])
    return out


# --------------------------------------------------------------------------------------------- render
def _families(llm: dict, encoder: dict | None, model: str, replicas: dict[str, tuple[int, int]]):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    def gauge(name, doc, value):
        f = GaugeMetricFamily(name, doc, labels=["model_name"])
        f.add_metric([model], value)
        return f

    def counter(name, doc, value):  # the `_total` suffix is added to the sample
        f = CounterMetricFamily(name, doc, labels=["model_name"])
        f.add_metric([model], value)
        return f

    def histogram(name, doc, key, bounds):
        h = llm["histograms"].get(key) or {"bounds": list(bounds), "counts": [0] * (len(bounds) + 1), "sum": 0.0}
        f = HistogramMetricFamily(name, doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, c in zip(list(h["bounds"]) + [float("inf")], h["counts"]):
            cumulative += c
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        f.add_metric([model], buckets, h["sum"])
        return f

    load = llm["load"]
    yield gauge("vllm:num_requests_running", "Requests being prefilled or decoded, summed over LLM replicas.",
                load["running"])
    yield gauge("vllm:num_requests_waiting", "Requests waiting for a sequence slot or KV blocks, summed over "
                "LLM replicas.", load["waiting"])
    blocks = load["kv_blocks"]
    yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent: used blocks over all LLM "
                "replicas' blocks.", 1.0 - load["kv_blocks_free"] / blocks if blocks else 0.0)
    yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.",
                  load["prefix_cache_queried_tokens"])
    yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens whose KV came from the cache.",
                  load["prefix_cache_hit_tokens"])
    yield counter("vllm:num_preemptions", "Requests preempted for KV blocks (recomputed later).",
                  load["preemptions"])
    yield counter("vlm:engine_gpu_seconds", "Device time of the LLM engines' steps in seconds, from CUDA events "
                  "around each step (the host clock without CUDA), summed over LLM replicas.",
                  llm.get("engine_gpu_ms_total", 0.0) / 1e3)
    yield counter("vllm:prompt_tokens", "Prompt tokens of requests that produced a first token.",
                  llm["prompt_tokens"])
    yield counter("vllm:generation_tokens", "Generated tokens (as the responses' usage counts them).",
                  llm["generation_tokens"])
    success = CounterMetricFamily("vllm:request_success", "Finished requests (each of n choices counts) by "
                                  "finished_reason.", labels=["model_name", "finished_reason"])
    for reason in sorted(llm["finished"], key=lambda r: (r not in FINISH_REASONS, r)):
        success.add_metric([model, reason], llm["finished"][reason])
    yield success
    yield histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds, from the LLM "
                    "replica's call (under fused, before the media is encoded).", "ttft", TTFT_BOUNDS)
    yield histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds, in the LLM "
                    "replica.", "e2e", E2E_BOUNDS)
    yield histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds (a chunk's tokens share "
                    "the time since the previous chunk).", "itl", ITL_BOUNDS)
    yield histogram("vllm:request_time_per_output_token_seconds", "Time per output token of each request after "
                    "its first, in seconds.", "tpot", ITL_BOUNDS)
    for hist, name, doc in TTFT_PARTS.values():
        yield histogram(name, doc, hist, TTFT_BOUNDS)
    yield histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", "prompt_tokens", (1,))
    yield histogram("vllm:request_generation_tokens", "Generated tokens per request.", "generation_tokens", (1,))

    if encoder is not None:  # this server's vision tower, summed over the replicas that run it
        for key, name, doc in (
                ("batches", "encoder_batches", "Vision encoder batches."),
                ("pieces", "encoder_items", "Media items (or pieces of long videos) encoded in batches."),
                ("graph_hits", "encoder_graph_hits", "Batches replayed from a CUDA graph (or the static-shape "
                 "path without CUDA)."),
                ("uniform_hits", "encoder_uniform_graph_hits", "Graph hits that replayed an exact-shape graph."),
                ("eager_batches", "encoder_eager_batches", "Batches run eagerly (reasons in "
                 "vlm:encoder_eager_fallbacks)."),
                ("real_tokens", "encoder_real_tokens", "Vision tokens encoded."),
                ("padded_tokens", "encoder_padded_tokens", "Padding tokens run to fill a graph's budget."),
                ("cache_hits", "encoder_cache_hits", "Items served from the embedding cache."),
                ("cache_misses", "encoder_cache_misses", "Items that had to be encoded.")):
            yield counter(f"vlm:{name}", doc, encoder.get(key, 0))
        yield counter("vlm:encoder_gpu_seconds", "Device time of the vision encoder's batches in seconds, from CUDA "
                      "events around each batch (the host clock without CUDA).",
                      encoder.get("encoder_gpu_ms_total", 0) / 1e3)
        fallbacks = CounterMetricFamily("vlm:encoder_eager_fallbacks", "Eager batches by reason.",
                                        labels=["model_name", "reason"])
        for reason, n in sorted(encoder.get("eager_reasons", {}).items()):
            fallbacks.add_metric([model, str(reason)], n)
        yield fallbacks
        yield gauge("vlm:encoder_padding_ratio", "Padded tokens over all tokens the tower ran.",
                    encoder.get("padding_ratio", 0.0))
        yield gauge("vlm:encoder_batch_fill", "Batch tokens over the chosen budgets' tokens.",
                    encoder.get("batch_fill", 0.0))
    answered = GaugeMetricFamily("vlm:metrics_replicas", "Replicas whose numbers this scrape summed.",
                                 labels=["model_name", "deployment"])
    missing = GaugeMetricFamily("vlm:metrics_replicas_unanswered", "Replicas that failed or did not answer "
                                "within the scrape's timeout (left out of the sums).",
                                labels=["model_name", "deployment"])
    for deployment, (ok, lost) in sorted(replicas.items()):
        answered.add_metric([model, deployment], ok)
        missing.add_metric([model, deployment], lost)
    yield answered
    yield missing


class _Families:
    def __init__(self, families):
        self.families = list(families)

    def collect(self):
        return iter(self.families)


def render(llm: dict, encoder: dict | None, model: str, replicas: dict[str, tuple[int, int]]) -> tuple[bytes, str]:
    """(body, content type) of the scrape: `llm` from merge_snapshots, `encoder` from
    merge_encoder_stats (None: no tower answered), `replicas` {deployment: (answered, unanswered)}.
    Always the classic text format (0.0.4), whatever the scraper's Accept header prefers: every
    Prometheus reads it, and prometheus_client's OpenMetrics output would rename the samples'
    `vllm:` colons to underscores, which dashboards built for vLLM do not query."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(_families(llm, encoder, model, replicas)))
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4


def scrape_text(llm: tuple[list[dict], int], towers: tuple[list[dict], int] | None, model: str
                ) -> tuple[bytes, str]:
    """GET /metrics from what the replicas answered: `llm` (the LLM replicas' `metrics_snapshot()`s,
    how many did not answer), `towers` the same for VisionEncoder replicas' `stats()` (None under
    `fused`, where the LLM snapshots hold their towers' stats)."""
    merged = merge_snapshots(llm[0])
    encoders = merged["encoders"] + (towers[0] if towers else [])
    replicas = {"LLM": (len(llm[0]), llm[1])}
    if towers is not None:
        replicas["VisionEncoder"] = (len(towers[0]), towers[1])
    return render(merged, merge_encoder_stats(encoders) if encoders else None, model, replicas)


async def gather_within(calls: list, timeout_s: float) -> tuple[list, int]:
    """Await `calls` (awaitables, one per replica) for at most `timeout_s` together: the results that
    came, and how many failed or did not come in time (those are cancelled)."""
    if not calls:
        return [], 0
    tasks = [asyncio.ensure_future(c) for c in calls]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    results = [t.result() for t in tasks if t in done and not t.cancelled() and t.exception() is None]
    return results, len(tasks) - len(results)
