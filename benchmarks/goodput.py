"""Goodput: the highest offered rate of open-loop traffic that the server serves within its latency
bound, measured on one warm app, with warm-up, ramp and drain kept out of the figures (issue 45).

One invocation, one app (`--start`: Ray and the application started here, as benchmarks/serve.py
--start does; or `--url` of a running server):
1. `--closed-loop C N` (optional): serve.py's closed loop at concurrency C for N requests, per workload:
   the saturation throughput S.
2. Per workload (`--workload image image@1024 video mix`; `mix` is benchmarks/workloads.py's realistic
   mix): a declared warm-up (`--warmup-s` at `--warmup-rate`, default the first rate of the search;
   reported under "warmup", never in the results), then the goodput search. Each point sends an
   open-loop schedule (`--arrival poisson`, or `gamma --cv 2` for bursts; seeded by `--seed` and the
   point's index) lasting `--ramp-s` + `--window-s`. Only the steady window [ramp, ramp + window) counts:
   - offered req/s = arrivals scheduled in the window / window; served req/s = completions (any
     request's) inside the window / window. The 98% rule reads served over the arrivals of the window
     moved back by the median E2E (at most the ramp), so that the requests in flight at the window's
     edges do not count as noise (`analyse`);
   - TTFT p50/p99, time per output token (TPOT = (e2e - TTFT) / (tokens - 1)) p50/p99 and E2E over
     the requests that arrived in the window; errors by status (HTTP code, stream error, client
     exception, `unfinished` for those still running `--drain-s` after the last arrival) over all of
     the point's requests;
   - server side over the window: encoder counters' change (/v1/encoder/stats), the LLM queue
     sampled each second (/v1/llm/load), GPU time per request: the change over the window of the
     engines' and the towers' cumulative device time (`engine_gpu_ms_total` in /v1/llm/load,
     `encoder_gpu_ms_total` in /v1/encoder/stats, summed over replicas: CUDA events around every engine
     step and tower batch, app/gpu/timing.py) over the window's completions, `engine_gpu_ms_per_request`
     and `encoder_gpu_ms_per_request` (NVML's "busy" is reported too, but it says a kernel ran, not how
     much work was done), and benchmarks/monitor.py's GPU utilisation and CPU per process.
   Between points the server settles (the LLM's running and waiting at 0). A point passes when
   served >= `--min-served` (0.98) x offered, TTFT p99 <= the workload's bound and nothing failed.
   The search: the coarse rates (`--rates`, or `--fractions` of S), in order, until one fails (all
   passing: x1.25 until one fails), then bisection between the last pass and the first fail until the
   bracket is under `--resolution` of the rate, at most `--max-points` points in all. Goodput is the
   last passing rate (0 if none passed), with the failing rate above it.
   TTFT p99 bounds: `--ttft-p99-ms` (images, 200), `--ttft-p99-ms-video` (500), `--ttft-p99-ms-mix`
   (1000): a 32-frame video or three 1,600 px images with a 512-word prompt is several thousand
   prompt tokens, so the bounds for video and the mix are stated separately.
3. `--cold-start 0.5 0.9`: per fraction f, the app is deleted and deployed again (Ray stays up), the
   bodies and load processes having been made ready before; /health and /v1/models are polled every
   0.1 s and the first moment both answer 200 starts the clock of a `--cold-s`-second schedule at
   f x the first workload's goodput (or `--cold-rate`). Per second of arrival: requests, errors, TTFT
   p50/p99, completions. Then, on the now warm app, the same rate as a normal point: warm TTFT p99, and
   each second's ratio to it. (Replicas warm themselves before they report ready when the cluster has
   GPUs: app/serving/warmup.py, config `warmup`.) `--cold-first R` makes the first deploy itself a cold start at
   R req/s (Ray started just before it): one deploy less.
4. `--scale-up 0.5`: the app deployed again with `--scale-up-from` LLM replicas and room for one more,
   a low `target_ongoing_requests`, and load at 0.5 x goodput for `--scale-up-s` from ready: the
   autoscaler adds a replica under load. The LLM replicas are watched each 0.5 s (when the new one was
   ready and took its first request); per second TTFT p99 over the warm app's at the same rate, and the
   host beside it (benchmarks/monitor.py's HostTimeline: cores by process group, new processes, host and
   GPU busy), read out at the worst second. `--scale-up-baseline` then runs the same deploy and load with
   no room for a replica: a second slow there too is the starting replicas' own tail, not the new start
   (`--scale-up-baseline-first`: the baseline before the scale-up, so that an order effect shows).
5. `--crosscheck guidellm|aiperf`: our point and GuideLLM's or AIPerf's Poisson run at the goodput (or
   `--crosscheck-rate`), same request shape, the tool's per-request timings read through `analyse`.
Everything goes to `--out-dir`: goodput.json (rewritten after every point: a run cut short keeps what it
measured), goodput.md (the table), goodput.png (served rate and TTFT p99 against offered rate, per
workload), cold_start.png, scale_up.png. `--deadline-s` starts no point or cold start that would end after it.

    python benchmarks/goodput.py --start --serve-config configs/qwen3-vl-2b-gpu.yaml --num-gpus 1 \\
        --workload image mix --closed-loop 512 2048 --cold-start 0.5 0.9 --load-processes 2 \\
        --out-dir benchmarks/serve_results/goodput_1gpu
    python benchmarks/goodput.py --url http://127.0.0.1:8000 --workload image --rates 50 100 150 200
benchmarks/gpu_goodput.sh runs the whole set on a GPU host in one device call; docs/guides/goodput.md
tells how to read the output.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import multiprocessing
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.serving.autoscaling import AUTOSCALING_METRICS_INTERVAL_S  # noqa: E402
from app.serving.loop_lag import lag_delta  # noqa: E402
from benchmarks import pyspy_sampler, ttft_tail  # noqa: E402
from benchmarks.serve import (  # noqa: E402
    READY_TIMEOUT_S,
    Result,
    Workload,
    _from_each,
    build_bodies,
    config_file,
    deep_merge,
    encoder_delta,
    entry_points,
    init_ray,
    one_request,
    run_load,
    start_app,
    stop_app,
)
from benchmarks.serve_timeline import deploy_timeline  # noqa: E402
from benchmarks.stats import pct  # noqa: E402
from benchmarks.workloads import ARRIVALS, SAMPLINGS, MixWorkload, arrival_times, sampling_fields  # noqa: E402

TTFT_BOUNDS_MS = {"image": 200.0, "video": 500.0, "mix": 1000.0}


# ---------------------------------------------------------------------------- sending
@dataclass
class Sent:
    """One request of a schedule; times in seconds from the schedule's t0."""
    idx: int
    sched_s: float  # when it was due
    start_s: float  # when it was sent
    done_s: float  # when its response ended (inf: unfinished)
    ok: bool
    status: str  # "ok", "HTTP 503", "stream error", a client exception's name, "unfinished"
    ttft_s: float | None = None
    completion_tokens: int = 0
    error: str = ""  # what the server or the client said (a 5xx: its status and its body's first 200 bytes)
    router_ttft_ms: float | None = None  # the Router's own time to first token and its parts (benchmarks/ttft_tail.py)
    parts_ms: dict | None = None


def status_of(r: Result) -> str:
    if r.ok:
        return "ok"
    if r.error.startswith("HTTP "):
        return r.error.split(":")[0]
    head = r.error.split(":")[0]
    return head if head.isidentifier() and head[0].isupper() else "stream error"


def _session(url: str, timeout_s: float) -> aiohttp.ClientSession:
    """No connection limit: an open loop must never queue in the client (serve.py's rate mode caps
    connections at 64, which a few hundred req/s of streamed responses reach)."""
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
    return aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


async def send_schedule(client: aiohttp.ClientSession, items: list[tuple[int, float, bytes]], t0: float, tag: str,
                        drain_s: float) -> list[Sent]:
    """Send each (index, due time, body) at t0 + due time (at once when behind: the lag is recorded), then
    wait at most `drain_s` after the last send; requests still running then are cancelled (`unfinished`)."""
    started: dict[int, tuple[float, float]] = {}

    async def one(idx: int, at: float, body: bytes) -> Sent:
        start = time.perf_counter() - t0
        started[idx] = (at, start)
        r = await one_request(client, body, f"{tag}-{idx}", parts=True)
        return Sent(idx, at, start, start + r.e2e_s, r.ok, status_of(r), r.ttft_s if r.ok else None,
                    r.completion_tokens, "" if r.ok else r.error[:300], r.router_ttft_ms, r.parts_ms)

    tasks = []
    for idx, at, body in items:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(idx, at, body)))
    if tasks:
        await asyncio.wait(tasks, timeout=drain_s)
    out = []
    for (idx, at, _), task in zip(items, tasks):
        if task.done() and not task.cancelled() and task.exception() is None:
            out.append(task.result())
            continue
        task.cancel()
        at, start = started.get(idx, (at, math.inf))
        out.append(Sent(idx, at, start, math.inf, False, "unfinished"))
    await asyncio.gather(*tasks, return_exceptions=True)
    return out


def _worker(k: int, url: str, items: list, tag: str, timeout_s: float, drain_s: float, go, t0, out) -> None:
    """One spawned load process: its share of the schedule, sent from its own event loop."""
    async def load() -> list[Sent]:
        async with _session(url, timeout_s) as client:
            out.put((k, "ready", None))
            if not go.wait(4 * READY_TIMEOUT_S):  # the main process may deploy an app meanwhile
                raise TimeoutError("the main process never started the schedule")
            return await send_schedule(client, items, t0.value, tag, drain_s)

    try:
        out.put((k, "results", asyncio.run(load())))
    except BaseException as e:
        out.put((k, "error", f"{type(e).__name__}: {e}"))


async def send(url: str, items: list[tuple[int, float, bytes]], tag: str, processes: int = 1,
               timeout_s: float = 120.0, drain_s: float = 30.0, before_go=None, watch=None) -> tuple[list[Sent], dict]:
    """Send a schedule from this process or from `processes` spawned ones (items dealt round-robin: each
    process sends its share at the schedule's own times). `before_go`: awaited once everything is ready
    to send (the cold start deploys the app and waits for it here); it may return a dict, kept in the
    answer under "before_go". The clock t0 starts right after it. `watch(t0)`: a coroutine run beside
    the load (server stats over the window); its answer is kept under "watch"."""
    extra: dict = {}
    if processes <= 1:
        async with _session(url, timeout_s) as client:
            if before_go is not None:
                extra["before_go"] = await before_go()
            t0 = time.perf_counter() + 0.02
            watcher = asyncio.create_task(watch(t0)) if watch else None
            sent = await send_schedule(client, items, t0, tag, drain_s)
    else:
        ctx = multiprocessing.get_context("spawn")
        out, go, shared_t0 = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
        procs = [ctx.Process(target=_worker, args=(k, url, items[k::processes], tag, timeout_s, drain_s, go,
                                                   shared_t0, out), name=f"goodput-load-{k}", daemon=True)
                 for k in range(processes)]
        watcher = None
        try:
            for p in procs:
                p.start()
            await asyncio.to_thread(_from_each, out, procs, "ready", READY_TIMEOUT_S)
            if before_go is not None:
                extra["before_go"] = await before_go()
            t0 = time.perf_counter() + 0.1  # every process wakes, then sleeps until t0
            shared_t0.value = t0
            go.set()
            watcher = asyncio.create_task(watch(t0)) if watch else None
            got = await asyncio.to_thread(_from_each, out, procs, "results", None)
            for p in procs:
                p.join(timeout=10)
        finally:
            for p in procs:
                if p.pid is not None and p.is_alive():
                    p.terminate()
                    p.join()
        sent = sorted((s for rs in got.values() for s in rs), key=lambda s: s.idx)
    if watcher is not None:
        extra["watch"] = await watcher
    return sent, extra


# ---------------------------------------------------------------------------- arithmetic
RAMP_MARGIN = 1.25  # answers grow with the rate: a ramp from lower rates' E2E p99 gets this much more


def workload_ramp_s(ramp_s: float, seen: list[dict | None], max_ramp_s: float) -> float:
    """A point's ramp: `ramp_s`, or RAMP_MARGIN x the longest E2E p99 among the points already measured for
    its workload (the warm-up first), where that is longer; at most `max_ramp_s`. Completions in the
    window come from arrivals up to one E2E before it: with answers longer than the ramp (the mix's
    512-token tails, points' E2E p99 2.9-4.3 s against a 2 s ramp on one H200, 2026-12-01; its warm-up,
    at the lowest rate, 2.5 s) the first seconds of the window lack the completions of requests that were
    never sent, and served read 89-97% of offered at rates whose TTFT was well inside the bound."""
    p99s = [((p or {}).get("e2e_ms") or {}).get("p99") for p in seen]
    p99s = [x for x in p99s if x is not None and math.isfinite(x)]
    if not p99s:
        return ramp_s
    return max(ramp_s, min(max_ramp_s, RAMP_MARGIN * max(p99s) / 1e3))


def window_for(window_s: float, rate: float, min_arrivals: int, max_window_s: float) -> float:
    """A point's steady window: `window_s`, or longer (up to `max_window_s`) so that it holds `min_arrivals`
    arrivals."""
    return max(window_s, min(max_window_s, min_arrivals / rate)) if rate > 0 else window_s


def _ms(xs: list[float]) -> dict:
    ms = [1e3 * x for x in xs]
    return {"p50": pct(ms, 0.5), "p99": pct(ms, 0.99), "mean": sum(ms) / len(ms) if ms else float("nan"), "n": len(ms)}


def tpot_s(s: Sent) -> float | None:
    """Time per output token after the first."""
    if not s.ok or s.ttft_s is None or s.completion_tokens < 2:
        return None
    return (s.done_s - s.start_s - s.ttft_s) / (s.completion_tokens - 1)


def analyse(sent: list[Sent], lo: float, hi: float) -> dict:
    """The steady window [lo, hi) of a schedule's outcome (module doc): offered and served req/s, their
    ratio, latencies of the requests that arrived in the window, errors of all of them.

    The ratio compares the completions in the window with the arrivals of the window moved back by the
    median E2E (at most `lo`): the requests a server that keeps up completes in the window. Against the
    window's own arrivals it would carry the difference between the requests in flight at its two
    edges, about sqrt(2 x rate x E2E) requests: 2% of a 12 s window at 50 req/s with 2 s answers."""
    window = hi - lo
    arrived = [s for s in sent if lo <= s.sched_s < hi]
    completed = [s for s in sent if s.ok and lo <= s.done_s < hi]
    ok = [s for s in arrived if s.ok]
    shift = min(lo, pct([s.done_s - s.sched_s for s in arrived if s.ok], 0.5)) if ok else 0.0
    expected = sum(1 for s in sent if lo - shift <= s.sched_s < hi - shift)
    offered, served = len(arrived) / window, len(completed) / window
    finished = [s.done_s for s in sent if math.isfinite(s.done_s)]
    last_due = max((s.sched_s for s in sent), default=0.0)
    lag = [s.start_s - s.sched_s for s in sent if math.isfinite(s.start_s)]
    return {
        "window_s": window, "requests": len(sent), "window_arrivals": len(arrived), "window_completions": len(completed),
        "offered_rps": offered, "served_rps": served, "ratio_shift_s": shift,
        "served_ratio": len(completed) / expected if expected else float("nan"),
        "ttft_ms": _ms([s.ttft_s for s in ok if s.ttft_s is not None]),
        "ttft_missing": sum(1 for s in ok if s.ttft_s is None),
        "tpot_ms": _ms([t for t in map(tpot_s, ok) if t is not None]),
        "e2e_ms": _ms([s.done_s - s.start_s for s in ok]),
        "errors": dict(Counter(s.status for s in sent if not s.ok)),
        "errors_in_window": dict(Counter(s.status for s in arrived if not s.ok)),
        "error_examples": error_examples(sent),
        "drain_s": max(finished) - last_due if finished else float("nan"),
        "send_lag_ms": {"p50": 1e3 * pct(lag, 0.5), "p99": 1e3 * pct(lag, 0.99), "max": 1e3 * max(lag, default=0.0)},
    }


def error_examples(sent: list[Sent]) -> dict[str, str]:
    """The first error of each kind, as said (a count alone, 'HTTP 500 x1', cannot be diagnosed)."""
    out: dict[str, str] = {}
    for s in sent:
        if not s.ok and s.status not in out:
            out[s.status] = s.error
    return out


def verdict(point: dict, ttft_p99_ms: float, min_served: float = 0.98) -> tuple[bool, list[str]]:
    """Whether a point is within goodput, and why not."""
    why = []
    if not point["served_ratio"] >= min_served:
        why.append(f"served {point['served_rps']:.2f} of {point['offered_rps']:.2f} req/s offered "
                   f"({100 * point['served_ratio']:.1f}% < {100 * min_served:.0f}%)")
    if not point["ttft_ms"]["p99"] <= ttft_p99_ms:
        why.append(f"TTFT p99 {point['ttft_ms']['p99']:.0f} ms > {ttft_p99_ms:.0f} ms")
    if point["errors"]:
        why.append("errors " + ", ".join(f"{k} x{v}" for k, v in sorted(point["errors"].items())))
    if why and point["window_arrivals"] < 250 and not point["served_ratio"] >= min_served:
        why.append(f"(only {point['window_arrivals']} arrivals in the window: one request is "
                   f"{100 / max(1, point['window_arrivals']):.1f}%; lengthen --window-s)")
    return not why, why


def search_goodput(measure: Callable[[float], dict | None], ok: Callable[[dict], bool], coarse: list[float],
                   max_points: int = 8, resolution: float = 0.05, grow: float = 1.25) -> dict:
    """Goodput over rates: the coarse rates in order until one fails (all passing: x`grow` until one
    fails), then bisection between the last passing and the first failing rate until their gap is
    under `resolution` of the failing rate; at most `max_points` measurements. `measure(rate)` returns
    the point (None: stop, e.g. out of time). Returns {"goodput", "fails_at", "points", "complete"}."""
    points: list[dict] = []
    last_pass, first_fail = 0.0, None

    def step(rate: float) -> bool | None:
        point = measure(rate)
        if point is None:
            return None
        point["passes"] = ok(point)
        points.append(point)
        return point["passes"]

    stopped = False
    for rate in sorted(coarse):
        if len(points) >= max_points:
            break
        good = step(rate)
        if good is None:
            stopped = True
            break
        if good:
            last_pass = rate
        else:
            first_fail = rate
            break
    rate = max(coarse)
    while not stopped and first_fail is None and len(points) < max_points:
        rate = round(rate * grow, 2)
        good = step(rate)
        if good is None:
            stopped = True
        elif good:
            last_pass = rate
        else:
            first_fail = rate
    while (not stopped and first_fail is not None and len(points) < max_points
           and first_fail - last_pass > resolution * first_fail):
        mid = round((last_pass + first_fail) / 2, 2)
        good = step(mid)
        if good is None:
            stopped = True
        elif good:
            last_pass = mid
        else:
            first_fail = mid
    complete = not stopped and first_fail is not None and first_fail - last_pass <= resolution * first_fail
    return {"goodput": last_pass, "fails_at": first_fail, "points": points, "complete": complete}


# ---------------------------------------------------------------------------- server side
async def _get_json(client: aiohttp.ClientSession, path: str) -> dict | None:
    try:
        async with client.get(path) as resp:
            return await resp.json() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def _get_text(client: aiohttp.ClientSession, path: str) -> str | None:
    try:
        async with client.get(path) as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


# the server's time-to-first-token histograms (app/serving/prometheus.py), as /metrics renders them
TTFT_PART_METRICS = {"ttft": "vllm:time_to_first_token_seconds", "encode": "vlm:request_encode_time_seconds",
                     "queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                     # the encode time's parts (fused): the tower's queue, its batch, the event loop's lag after
                     "encode_wait": "vlm:request_encode_wait_time_seconds",
                     "encode_run": "vlm:request_encode_run_time_seconds",
                     "encode_wake": "vlm:request_encode_wake_time_seconds"}


def histograms_of(text: str) -> dict[str, dict]:
    """Prometheus text -> {family: {"buckets": {le: count}, "sum", "count"}} for TTFT_PART_METRICS'
    families, each summed over its label sets (prometheus_client's parser, as the server's renderer)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = set(TTFT_PART_METRICS.values())
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name not in wanted:
            continue
        h = out.setdefault(fam.name, {"buckets": {}, "sum": 0.0, "count": 0.0})
        for smp in fam.samples:
            if smp.name.endswith("_bucket"):
                le = float(smp.labels["le"])  # "+Inf" parses as inf
                h["buckets"][le] = h["buckets"].get(le, 0.0) + smp.value
            elif smp.name.endswith(("_sum", "_count")):
                h[smp.name.rsplit("_", 1)[1]] += smp.value
    return out


def ttft_parts(start: dict, end: dict) -> dict:
    """Per part of the time to first token (the LLM replica's TTFT, and its encode, queue and prefill
    shares), over the requests whose first token came between two scrapes: how many, the mean and the
    p99's bucket (the smallest bound holding 99% of them: an upper bound, as coarse as the buckets), in ms."""
    out = {}
    for part, family in TTFT_PART_METRICS.items():
        a, b = start.get(family), end.get(family)
        if a is None or b is None:
            continue
        n = b["count"] - a["count"]
        if n <= 0:
            out[part] = {"n": 0}
            continue
        cum = sorted((le, b["buckets"][le] - a["buckets"].get(le, 0.0)) for le in b["buckets"])
        p99 = next((le for le, c in cum if c >= 0.99 * n), math.inf)
        out[part] = {"n": int(n), "mean_ms": 1e3 * (b["sum"] - a["sum"]) / n, "p99_bucket_ms": 1e3 * p99}
    return out


GPU_TIME_NOTE = ("the server reports no GPU time (no '*gpu_ms_total' counter in /v1/encoder/stats or /v1/llm/load); "
                 "NVML utilisation only says a kernel ran")
# what app/gpu/timing.py reports, per kind: (prefix, unit of its brackets, one of them)
GPU_KINDS = (("engine", "steps", "step"), ("encoder", "batches", "batch"))


def gpu_totals(stats: dict | None) -> dict:
    """The GPU-time counters of a stats answer (/v1/llm/load or /v1/encoder/stats), summed over its
    replicas: `<kind>_gpu_ms_total`, `<kind>_timed_<unit>`, `<kind>_gpu_interleaved`, `<kind>_gpu_dropped`,
    and `<kind>_gpu_clock` (the replicas' sources, joined). Only the counters some replica reports."""
    if not stats:
        return {}
    sources = stats.get("replicas") or [stats]
    out: dict = {}
    for kind, unit, _ in GPU_KINDS:
        for key in (f"{kind}_gpu_ms_total", f"{kind}_timed_{unit}", f"{kind}_gpu_interleaved", f"{kind}_gpu_dropped"):
            values = [r[key] for r in sources if isinstance(r.get(key), (int, float))]
            if values:
                out[key] = sum(values)
        clocks = sorted({str(r[f"{kind}_gpu_clock"]) for r in sources if r.get(f"{kind}_gpu_clock")})
        if clocks:
            out[f"{kind}_gpu_clock"] = ",".join(clocks)
    return out


def gpu_per_request(start: dict, end: dict, completions: int) -> dict:
    """Per kind (engine, encoder) measured at both ends of the window (`gpu_totals` at its start and
    end): the device ms spent in the window, the steps or batches timed, ms per served request (the
    window's completions: in a steady state the work done in the window is what its completions cost),
    ms per step or batch, steps or batches per request, and those that overlapped another bracket on
    the same stream (`interleaved`: each may hold some of the other's work) or were not timed."""
    out: dict = {}
    for kind, unit, one in GPU_KINDS:
        ms_key, n_key = f"{kind}_gpu_ms_total", f"{kind}_timed_{unit}"
        if ms_key not in start or ms_key not in end:
            continue
        ms = end[ms_key] - start[ms_key]
        n = end.get(n_key, 0) - start.get(n_key, 0)
        out[kind] = {"gpu_ms": ms, unit: n,
                     "ms_per_request": ms / completions if completions else None,
                     f"ms_per_{one}": ms / n if n else None,
                     f"{unit}_per_request": n / completions if completions else None,
                     "interleaved": end.get(f"{kind}_gpu_interleaved", 0) - start.get(f"{kind}_gpu_interleaved", 0),
                     "dropped": end.get(f"{kind}_gpu_dropped", 0) - start.get(f"{kind}_gpu_dropped", 0),
                     "clock": end.get(f"{kind}_gpu_clock")}
    return out


def per_replica(load: dict | None, key: str) -> dict:
    """Replica id -> its `key` entry (a dict) in a /v1/llm/load answer, for the replicas that report one."""
    return {r.get("replica"): r[key] for r in (load or {}).get("replicas", []) if isinstance(r.get(key), dict)}


def gc_delta(start: dict | None, end: dict | None) -> dict | None:
    """The LLM replicas' full (generation 2) garbage collections inside the window, from the `gc` counters
    of /v1/llm/load at its two edges (app/serving/gc_pauses.py), over the replicas reported at both:
    how many, their summed pause, and the longest pause any replica has had so far (not only in the
    window: the counter is a running maximum). None when neither edge reports them."""
    a, b = per_replica(start, "gc"), per_replica(end, "gc")
    both = [k for k in b if k in a]
    if not both:
        return None
    return {"full_collections": sum(b[k]["collections"][2] - a[k]["collections"][2] for k in both),
            "full_pause_ms": sum(b[k]["pause_ms_total"][2] - a[k]["pause_ms_total"][2] for k in both),
            "longest_full_pause_ms_so_far": max(b[k]["pause_ms_max"][2] for k in both),
            "frozen_objects": min(b[k]["frozen_objects"] for k in both), "replicas": len(both)}


def loop_lag_delta(start: dict | None, end: dict | None) -> dict | None:
    """The LLM replicas' event-loop lag inside the window (`loop_lag` of /v1/llm/load at its two edges,
    app/serving/loop_lag.py), per replica reported at both, and the worst of them: the highest mean, p99
    bucket and share of ticks later than 10 ms. None when no replica reports it at both edges."""
    a, b = per_replica(start, "loop_lag"), per_replica(end, "loop_lag")
    per = {k: d for k in b if k in a and (d := lag_delta(a[k], b[k])) is not None}
    if not per:
        return None
    return {"replicas": per, "mean_ms_max": max(d["mean_ms"] for d in per.values()),
            "p99_bucket_ms_max": max(d["p99_bucket_ms"] for d in per.values()),
            "late_10ms_share_max": max(d["late_10ms_share"] for d in per.values())}


async def watch_window(url: str, t0: float, lo: float, hi: float, monitor: bool) -> dict:
    """Server stats at the window's edges and the LLM queue each second inside it; the monitor
    (benchmarks/monitor.py) over the window."""
    async def until(t: float) -> None:
        await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(base_url=url, timeout=timeout) as client:
        await until(lo)
        enc0, llm0 = await _get_json(client, "/v1/encoder/stats"), await _get_json(client, "/v1/llm/load")
        prom0 = await _get_text(client, "/metrics")
        mon = None
        if monitor:
            from benchmarks.monitor import Monitor

            mon = await asyncio.to_thread(Monitor().__enter__)
        loads = []
        while time.perf_counter() < t0 + hi - 0.5:
            load = await _get_json(client, "/v1/llm/load")
            if load is not None:
                loads.append(load)
            await asyncio.sleep(min(1.0, max(0.0, t0 + hi - time.perf_counter())))
        await until(hi)
        # the window's end snapshots first: the monitor's last tick (NVML, psutil) would stretch the GPU
        # time they measure past the window whose completions it is divided by
        enc1, llm1 = await _get_json(client, "/v1/encoder/stats"), await _get_json(client, "/v1/llm/load")
        if mon is not None:
            await asyncio.to_thread(mon.__exit__, None, None, None)
        prom1 = await _get_text(client, "/metrics")
    out: dict = {}
    if prom0 is not None and prom1 is not None:
        out["ttft_parts"] = ttft_parts(histograms_of(prom0), histograms_of(prom1))
    if enc0 is not None and enc1 is not None:
        out["encoder"] = encoder_delta(enc0, enc1)
    if loads:
        out["llm_load"] = {
            "samples": len(loads), "replicas": loads[-1].get("num_replicas"),
            "running_mean": sum(x.get("running", 0) for x in loads) / len(loads),
            "waiting_mean": sum(x.get("waiting", 0) for x in loads) / len(loads),
            "waiting_max": max(x.get("waiting", 0) for x in loads),
            "kv_usage_max": max(float(x.get("kv_usage_max", x.get("kv_usage", 0.0))) for x in loads)}
    # the GPU-time counters at the window's two edges (a side that did not answer at both is left out)
    g0 = {**gpu_totals(enc0 if enc1 is not None else None), **gpu_totals(llm0 if llm1 is not None else None)}
    g1 = {**gpu_totals(enc1 if enc0 is not None else None), **gpu_totals(llm1 if llm0 is not None else None)}
    out["gpu_totals"] = {"start": g0, "end": g1}
    out["gpu_ms"] = {k: g1[k] - g0[k] for k in g1 if k.endswith("gpu_ms_total") and k in g0}
    gc_window = gc_delta(llm0, llm1)
    if gc_window is not None:
        out["gc"] = gc_window
    lag = loop_lag_delta(llm0, llm1)
    if lag is not None:
        out["loop_lag"] = lag
    if mon is not None:
        s = asdict(mon.summary())
        out["resources"] = {k: s[k] for k in ("duration_s", "gpu_source", "gpu_indices", "gpu_mean", "host_cores",
                                              "host_busy", "groups", "processes", "verdict")}
    return out


def tail_of(sent: list[Sent], lo: float, hi: float, share: float = 0.01) -> dict:
    """The window's arrivals' times to first token split into their parts, all against the slowest 1%
    (benchmarks/ttft_tail.py), from the parts each answer opened with; `{"requests": 0}` from a server
    that sends none."""
    return ttft_tail.attribution([(1e3 * s.ttft_s, s.router_ttft_ms, s.parts_ms) for s in sent
                                  if lo <= s.sched_s < hi and s.ok and s.ttft_s is not None and s.parts_ms], share)


def serve_log_dir() -> Path:
    """This Ray session's Serve logs (the driver's session; the newest session's when Ray is not up here)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None) if ray.is_initialized() else None
    session = Path(node.get_session_dir_path()) if node is not None else Path("/tmp/ray/session_latest")
    return session / "logs" / "serve"


async def settle(url: str, timeout_s: float = 30.0) -> float:
    """Wait until the LLM replicas run and queue nothing (twice in a row); seconds waited. A server
    without /v1/llm/load is taken as settled."""
    t = time.perf_counter()
    calm = 0
    async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=10)) as client:
        while time.perf_counter() - t < timeout_s:
            load = await _get_json(client, "/v1/llm/load")
            if load is None:
                break
            calm = calm + 1 if load.get("running", 0) == 0 and load.get("waiting", 0) == 0 else 0
            if calm >= 2:
                break
            await asyncio.sleep(0.25)
    return time.perf_counter() - t


async def poll_ready(url: str, timeout_s: float, interval_s: float = 0.1) -> float:
    """Seconds until /health and /v1/models both answer 200."""
    t = time.perf_counter()
    async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=5)) as client:
        while time.perf_counter() - t < timeout_s:
            try:
                async with client.get("/health") as a, client.get("/v1/models") as b:
                    if a.status == 200 and b.status == 200:
                        return time.perf_counter() - t
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(interval_s)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


# ---------------------------------------------------------------------------- cold start
def per_second(sent: list[Sent], seconds: int) -> list[dict]:
    """Per second of arrival: requests, errors, TTFT p50/p99 of those that succeeded, completions."""
    rows = []
    for k in range(seconds):
        arrived = [s for s in sent if k <= s.sched_s < k + 1]
        ttft = [1e3 * s.ttft_s for s in arrived if s.ok and s.ttft_s is not None]
        rows.append({"second": k, "requests": len(arrived), "errors": dict(Counter(s.status for s in arrived if not s.ok)),
                     "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
                     "completions": sum(1 for s in sent if s.ok and k <= s.done_s < k + 1)})
    return rows


def fixed_rates_result(points: list[dict], asked: int) -> dict:
    """`--no-search`: goodput is the highest passing rate below the lowest failing one (a pass above a
    fail is noise, listed in `passes_above_fail`, not goodput)."""
    passed = sorted(p["rate"] for p in points if p["passes"])
    fails_at = min((p["rate"] for p in points if not p["passes"]), default=None)
    below = [r for r in passed if fails_at is None or r < fails_at]
    return {"goodput": max(below, default=0.0), "fails_at": fails_at, "points": points,
            "complete": len(points) == asked,
            "passes_above_fail": [r for r in passed if fails_at is not None and r > fails_at]}


def cold_summary(rows: list[dict], warm_p99_ms: float) -> dict:
    """Each second's TTFT p99 over the warm app's at the same rate, and the issue's two tests: within
    1.5x from the first second, and within 2x after 10 s (both with no errors)."""
    for r in rows:
        r["p99_ratio"] = r["ttft_p99_ms"] / warm_p99_ms if warm_p99_ms > 0 else float("nan")

    def worst(rs: list[dict]) -> float:
        vals = [r["p99_ratio"] for r in rs if not math.isnan(r["p99_ratio"])]
        return max(vals, default=float("nan"))

    def errors(rs: list[dict]) -> int:
        return sum(sum(r["errors"].values()) for r in rs)

    def within(r: dict, bound: float) -> bool:  # a second without a request passes; one without a ratio not
        return not r["errors"] and (r["p99_ratio"] <= bound if not math.isnan(r["p99_ratio"]) else not r["requests"])

    within_from = None  # the first second from which every second is within 1.5x with no errors
    if math.isfinite(warm_p99_ms) and warm_p99_ms > 0:  # without a warm reference nothing is within anything
        for k in range(len(rows)):
            if all(within(r, 1.5) for r in rows[k:]):
                within_from = k
                break
    return {"warm_ttft_p99_ms": warm_p99_ms, "errors": errors(rows), "p99_ratio_max": worst(rows),
            "p99_ratio_max_after_10s": worst(rows[10:]), "errors_after_10s": errors(rows[10:]),
            "within_1_5x_from_first_second": errors(rows) == 0 and worst(rows) <= 1.5,
            "within_2x_after_10s": errors(rows[10:]) == 0 and worst(rows[10:]) <= 2.0,
            "within_1_5x_from_second": within_from}


# ---------------------------------------------------------------------------- cross-check
GUIDELLM_EXTRAS = {"body": {"stream_options": {"continuous_usage_stats": False}}}  # the server refuses True


def guidellm_sent(report: dict) -> tuple[list[Sent], dict]:
    """GuideLLM's JSON report (`--output kind=json`) as this module's per-request records, times from its
    benchmark's start (due = its scheduler's targeted start), and its own summary figures."""
    b = report["benchmarks"][0]
    t0 = b["start_time"]
    sent = []
    for status, records in b["requests"].items():
        if status == "total":
            continue
        for r in records or []:
            timings = r["info"]["timings"]
            due = timings.get("targeted_start") or r.get("request_start_time") or t0
            start = r.get("request_start_time") or due
            end = r.get("request_end_time")
            ok = status == "successful"
            ttft = r.get("time_to_first_token_ms")  # None where no chunk carried text: `ttft_missing`
            sent.append(Sent(len(sent), due - t0, start - t0, end - t0 if ok and end else math.inf, ok,
                             "ok" if ok else status if status != "errored" else
                             (r["info"].get("error") or "errored").split("(")[0],
                             ttft / 1e3 if ok and ttft is not None else None, int(r.get("output_tokens") or 0)))
    m = b["metrics"]
    own = {"duration_s": b["duration"], "successful": len(b["requests"].get("successful") or []),
           "requests_per_second_mean": m["requests_per_second"]["successful"]["mean"],
           "ttft_ms_p50": m["time_to_first_token_ms"]["successful"]["percentiles"]["p50"],
           "ttft_ms_p99": m["time_to_first_token_ms"]["successful"]["percentiles"]["p99"]}
    return sent, own


def crosscheck_guidellm(url: str, rate: float, ramp_s: float, window_s: float, image_size: int, output_tokens: int,
                        out_dir: Path, exe: list[str], sampling: str = "greedy") -> dict:
    """GuideLLM's Poisson profile at `rate` for ramp + window seconds, 448-style noise JPEGs with no text and
    `output_tokens` (ignore_eos): its per-request timings through `analyse`, and its own summary."""
    import subprocess

    path = out_dir / "guidellm.json"
    extras = {"body": {**GUIDELLM_EXTRAS["body"], **sampling_fields(sampling)}}
    backend = {"kind": "openai_http", "target": url, "model": "bench", "extras": extras}
    cmd = [*exe, "run", "--backend", json.dumps(backend), "--profile", f"kind=poisson,rate={rate}",
           "--constraint", f"kind=max_duration,seconds={ramp_s + window_s:g}",
           "--data", f"kind=synthetic_image,width={image_size},height={image_size},content=noise,"
           f"output_tokens={output_tokens}", "--output", f"kind=json,path={path}", "--disable-console-interactive"]
    t = time.perf_counter()
    try:
        proc, cpu = run_tool(cmd, ramp_s + window_s + 300)
    except subprocess.TimeoutExpired as e:
        return {"tool": "guidellm", "command": cmd, "error": f"did not finish in {e.timeout:g} s"}
    (out_dir / "guidellm.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not path.exists():
        return {"tool": "guidellm", "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-500:]}"}
    report = json.loads(path.read_text())
    _compress(path)  # tens of MB of JSON: the device returns files of at most 16 MiB
    sent, own = guidellm_sent(report)
    return tool_result("guidellm", cmd, t, own, sent, ramp_s, window_s, cpu)


def _host_cpu_jiffies() -> tuple[int, int] | None:
    """(busy, all) clock ticks of the host's CPUs so far (/proc/stat's first line), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return sum(ticks[:8]) - idle, sum(ticks[:8])


def run_tool(cmd: list[str], timeout: float, env: dict | None = None):
    """Run a cross-check tool to its end: (CompletedProcess, cpu), where cpu says what the tool and the host
    used meanwhile: `tool_cores`, the CPU time of the tool and of every process it waited for, over the wall
    time (getrusage of this process's children), and `host_busy_cores` of `host_cores`. A tool whose
    clients share the host's cores with the server can time its own queue, not the server's
    (RESULTS.md: GuideLLM's one process at 140 req/s); these say whether that happened."""
    import resource
    import subprocess

    before, host0, t = resource.getrusage(resource.RUSAGE_CHILDREN), _host_cpu_jiffies(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    after, host1, wall = resource.getrusage(resource.RUSAGE_CHILDREN), _host_cpu_jiffies(), time.perf_counter() - t
    used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    cpu = {"wall_s": wall, "tool_cpu_s": used, "tool_cores": used / wall if wall > 0 else float("nan"),
           "host_cores": os.cpu_count()}
    if host0 and host1 and wall > 0:
        busy, total = host1[0] - host0[0], host1[1] - host0[1]
        cpu["host_busy_cores"] = busy / total * os.cpu_count() if total else float("nan")
    return proc, cpu


def tool_result(tool: str, cmd: list[str], started: float, own: dict, sent: list[Sent], ramp_s: float,
                window_s: float, cpu: dict | None = None) -> dict:
    """A cross-check tool's run: its requests through `analyse` over our window, its own summary, the CPU it
    and the host used (`run_tool`), and its arrival gaps' coefficient of variation (Poisson: 1), which says
    whether it offered what it was asked."""
    gaps = sorted(s.sched_s for s in sent)
    gaps = [b - a for a, b in zip(gaps, gaps[1:])]
    mean = sum(gaps) / len(gaps) if gaps else float("nan")
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean if gaps and mean > 0 else float("nan")
    return {"tool": tool, "seconds": time.perf_counter() - started, "command": cmd, "own_summary": own,
            "cpu": cpu or {}, "arrival_gap_cv": cv, "point": analyse(sent, ramp_s, ramp_s + window_s)}


def aiperf_sent(lines: list[str]) -> list[Sent]:
    """AIPerf's per-request records (`profile_export.jsonl`, one JSON object a line) of its profiling
    phase as this module's records, times from the first one's issue: due = when its timing manager
    issued the request's credit (the Poisson schedule's time), sent = when its worker began sending."""
    records = []
    for line in filter(str.strip, lines):
        try:
            r = json.loads(line)
            md = r["metadata"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short (the tool stopped mid-write): not a request
        if md.get("benchmark_phase", "profiling") == "profiling" and md.get("credit_issued_ns") is not None:
            records.append(r)
    if not records:
        return []
    t0 = min(r["metadata"]["credit_issued_ns"] for r in records)
    sent = []
    for r in sorted(records, key=lambda r: r["metadata"]["credit_issued_ns"]):
        md, m, err = r["metadata"], r.get("metrics") or {}, r.get("error")
        due = (md["credit_issued_ns"] - t0) / 1e9
        start = (md["request_start_ns"] - t0) / 1e9 if md.get("request_start_ns") is not None else due
        end = md.get("request_end_ns")
        ttft = _aiperf_seconds(m.get("time_to_first_token"))
        if err or md.get("was_cancelled"):
            status = "cancelled" if md.get("was_cancelled") else \
                f"HTTP {err['code']}" if isinstance(err, dict) and err.get("code") else \
                (err.get("type") if isinstance(err, dict) else None) or "error"
            message = str(err.get("message") if isinstance(err, dict) else err or "")[:200]
            sent.append(Sent(len(sent), due, start, math.inf, False, status, error=message))
        elif end is None:  # no error and no end: never finished inside the tool's grace period
            sent.append(Sent(len(sent), due, start, math.inf, False, "unfinished"))
        else:
            tokens = (m.get("output_sequence_length") or {}).get("value") or 0
            sent.append(Sent(len(sent), due, start, (end - t0) / 1e9, True, "ok", ttft, int(tokens)))
    return sent


def _aiperf_seconds(metric: dict | None) -> float | None:
    """An AIPerf metric ({"value", "unit"}) of time, in seconds."""
    if not metric or metric.get("value") is None:
        return None
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}.get(metric.get("unit", "ms"))
    if scale is None:
        raise ValueError(f"AIPerf metric unit {metric.get('unit')!r}")
    return metric["value"] * scale


def aiperf_command(exe: list[str], url: str, model: str, tokenizer: str, rate: float, seconds: float,
                   image_size: int, output_tokens: int, artifacts: Path, workers: int | None = None,
                   sampling: str = "greedy") -> list[str]:
    """`aiperf profile`: Poisson arrivals at `rate` for `seconds`, one streamed chat request each with one
    noise JPEG of `image_size`^2, a one-token text prompt (AIPerf's synthetic prompts need at least one)
    and exactly `output_tokens` answer tokens, counted by the server; no warm-up of its own (ours ran).
    `workers`: its worker processes (`--workers-max`); None: its default, (cores x 0.75) - 1 up to 32."""
    return [*exe, "profile", *(["--workers-max", str(workers)] if workers else []),
            "-m", model, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", tokenizer, "--request-rate", f"{rate:g}", "--arrival-pattern", "poisson",
            "--benchmark-duration", f"{seconds:g}", "--benchmark-grace-period", "60", "--random-seed", "0",
            "--prompt-input-tokens-mean", "1", "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(output_tokens), "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", f"min_tokens:{output_tokens}", "--extra-inputs", "ignore_eos:true",
            *[x for k, v in sampling_fields(sampling).items() for x in ("--extra-inputs", f"{k}:{v}")],
            "--image-width-mean", str(image_size), "--image-height-mean", str(image_size), "--image-format", "jpeg",
            "--use-server-token-count", "--ui", "none", "--artifact-dir", str(artifacts)]


def crosscheck_aiperf(url: str, rate: float, ramp_s: float, window_s: float, image_size: int, output_tokens: int,
                      out_dir: Path, exe: list[str], tokenizer: str, workers: int | None = None,
                      sampling: str = "greedy") -> dict:
    """NVIDIA AIPerf's Poisson run at `rate` for ramp + window seconds (`aiperf_command`): its per-request
    records through `analyse`, and its own summary. AIPerf sends from several worker processes, where
    GuideLLM's one process saturated at 140 req/s (2026-12-02); `workers` sets how many."""
    import subprocess
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    artifacts = out_dir / (f"aiperf_w{workers}" if workers else "aiperf")
    cmd = aiperf_command(exe, url, model, tokenizer, rate, ramp_s + window_s, image_size, output_tokens, artifacts,
                         workers, sampling)
    # AIPerf 0.13 fails to load a local tokenizer folder under HF_HUB_OFFLINE=1 (HFValidationError)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    t = time.perf_counter()
    try:
        proc, cpu = run_tool(cmd, ramp_s + window_s + 300, env)
    except subprocess.TimeoutExpired as e:
        return {"tool": "aiperf", "command": cmd, "error": f"did not finish in {e.timeout:g} s"}
    (out_dir / f"{artifacts.name}.log").write_text(proc.stdout[-200_000:] + proc.stderr[-200_000:])
    records = artifacts / "profile_export.jsonl"
    if proc.returncode != 0 or not records.exists():
        return {"tool": "aiperf", "command": cmd, "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-500:]}"}
    sent = aiperf_sent(records.read_text().splitlines())
    own = {}
    summary = artifacts / "profile_export_aiperf.json"
    if summary.exists():
        p = json.loads(summary.read_text())
        own = {k: p.get(k) for k in ("request_throughput", "time_to_first_token", "request_count", "error_request_count")}
    pack_folder(artifacts, skip={"inputs.json"})  # its requests' payloads: tens of MB of base64 JPEGs
    return {**tool_result("aiperf", cmd, t, own, sent, ramp_s, window_s, cpu), "workers": workers}


def _compress(path: Path) -> None:
    """Replace a large report by its xz copy (`path.xz`)."""
    import lzma

    with open(path, "rb") as src, lzma.open(str(path) + ".xz", "wb", preset=6) as dst:
        dst.write(src.read())
    path.unlink()


def pack_folder(folder: Path, skip: Collection[str] = ()) -> Path:
    """Replace `folder` by one `folder.tar.xz` of its files but `skip` (names): the device returns only
    a few files a call (AIPerf writes a dozen, in sub-folders), so its records come back whole."""
    import shutil
    import tarfile

    packed = folder.with_name(folder.name + ".tar.xz")
    with tarfile.open(packed, "w:xz") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.name not in skip:
                tar.add(path, arcname=str(path.relative_to(folder.parent)))
    shutil.rmtree(folder)
    return packed


def agreement(ours: dict, theirs: dict) -> dict:
    """Relative differences (theirs / ours - 1) of the figures both measured."""
    def rel(a: float, b: float) -> float:
        return b / a - 1 if a else float("nan")
    return {"offered_rps": rel(ours["offered_rps"], theirs["offered_rps"]),
            "served_rps": rel(ours["served_rps"], theirs["served_rps"]),
            "ttft_p50": rel(ours["ttft_ms"]["p50"], theirs["ttft_ms"]["p50"]),
            "ttft_p99": rel(ours["ttft_ms"]["p99"], theirs["ttft_ms"]["p99"])}


# ---------------------------------------------------------------------------- the benchmark
def workload_of(spec: str, a) -> Workload | MixWorkload:
    """`image`, `image@<size>`, `video` (serve.py's fixed workloads, noise media) or `mix`."""
    if spec == "mix" or spec.startswith("mix@"):
        return MixWorkload(int(spec.partition("@")[2] or 0), sampling=a.sampling)
    kind, _, size = spec.partition("@")
    if kind not in ("image", "video"):
        raise SystemExit(f"unknown workload {spec!r}: image, image@<size>, video, mix, mix@<seed>")
    return Workload(kind, int(size) if size and kind == "image" else a.image_size, a.video_size, a.video_frames,
                    2, a.prompt_words, a.output_tokens, a.sampling)


def bound_of(wl, a) -> float:
    return {"image": a.ttft_p99_ms, "video": a.ttft_p99_ms_video, "mix": a.ttft_p99_ms_mix}[wl.kind]


class Bench:
    """The points of one invocation against one URL: seeds and media ranges never repeat."""

    def __init__(self, url: str, a, deadline: float | None):
        self.url, self.a, self.deadline = url, a, deadline
        self.n = 0  # schedules sent so far: each gets its own seed and media range

    def point_cost_s(self, rate: float, seconds: float) -> float:
        return seconds + 5.0 + rate * seconds * 0.002  # + settling and the bodies' build, roughly

    def time_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.perf_counter()

    def _schedule(self, wl, rate: float, seconds: float) -> tuple[list[tuple[int, float, bytes]], str, float]:
        a = self.a
        self.n += 1
        due = arrival_times(rate, seconds, a.arrival, a.cv, seed=a.seed * 1000 + self.n)
        t = time.perf_counter()
        bodies = build_bodies(wl, 10_000_000 * self.n + 1_000_000 * a.seed, len(due))
        tag = f"goodput-{self.n}-{rate:g}"
        return list(zip(range(len(due)), due.tolist(), bodies)), tag, time.perf_counter() - t

    def point(self, wl, rate: float, ramp_s: float, window_s: float, monitor: bool | None = None) -> dict | None:
        """One open-loop point (None when the deadline leaves no room for it)."""
        a = self.a
        if self.point_cost_s(rate, ramp_s + window_s + a.drain_guess_s) > self.time_left():
            return None
        items, tag, build_s = self._schedule(wl, rate, ramp_s + window_s)
        settled = asyncio.run(settle(self.url))
        mon = not a.no_monitor if monitor is None else monitor
        sent, extra = asyncio.run(send(self.url, items, tag, a.load_processes, a.timeout_s, a.drain_s,
                                       watch=lambda t0: watch_window(self.url, t0, ramp_s, ramp_s + window_s, mon)))
        out = {"rate": rate, "arrival": a.arrival, "cv": a.cv if a.arrival == "gamma" else 1.0, "ramp_s": ramp_s,
               **analyse(sent, ramp_s, ramp_s + window_s), "server": extra.get("watch", {}),
               "build_s": build_s, "settle_s": settled, "schedule": self.n,
               "ttft_tail": tail_of(sent, ramp_s, ramp_s + window_s)}
        totals = out["server"].get("gpu_totals") or {}
        gpu = gpu_per_request(totals.get("start", {}), totals.get("end", {}), out["window_completions"])
        out["gpu_time"] = gpu
        for kind, _, _ in GPU_KINDS:
            out[f"{kind}_gpu_ms_per_request"] = gpu.get(kind, {}).get("ms_per_request")
        per_request = {k: g["ms_per_request"] for k, g in gpu.items() if g["ms_per_request"] is not None}
        out["gpu_ms_per_request"] = per_request or None
        if not gpu:
            out["gpu_time_note"] = GPU_TIME_NOTE
        return out

    def cold(self, wl, rate: float, deploy: Callable[[], None], seconds: int, ready_timeout_s: float,
             watch=None) -> dict:
        """The cold start: bodies and load processes ready, then deploy, poll, and send from ready
        (`watch(t0)`: a coroutine beside the load, as `send` takes it)."""
        items, tag, build_s = self._schedule(wl, rate, seconds)

        async def go() -> dict:
            t, wall = time.perf_counter(), time.time()
            await asyncio.to_thread(deploy)
            submitted = time.perf_counter() - t
            await poll_ready(self.url, ready_timeout_s)
            return {"deploy_call_s": submitted, "ready_s": time.perf_counter() - t, "deploy_wall_at": wall,
                    "ready_wall_at": time.time(), "app_status_at_ready": await asyncio.to_thread(app_status)}

        sent, extra = asyncio.run(send(self.url, items, tag, self.a.load_processes, self.a.timeout_s, self.a.drain_s,
                                       before_go=go, watch=watch))
        return {"rate": rate, "seconds": seconds, "build_s": build_s, **extra.get("before_go", {}),
                "whole": analyse(sent, 0.0, float(seconds)), "per_second": per_second(sent, seconds)}


def cold_run(bench: Bench, a, wl, rate: float, deploy: Callable[[], None]) -> dict:
    """A cold start at `rate` (`Bench.cold`), then the same rate on the now warm app for the ratio."""
    c = bench.cold(wl, rate, deploy, a.cold_s, a.ready_timeout_s)
    c["fraction"] = None  # of goodput: set by the caller once known
    warm = bench.point(wl, rate, a.ramp_s, a.cold_warm_window_s)
    c["warm"] = warm
    c["summary"] = cold_summary(c["per_second"], warm["ttft_ms"]["p99"] if warm else float("nan"))
    s = c["summary"]
    print(f"cold start at {rate:g} req/s: ready in {c['ready_s']:.1f} s ({c['app_status_at_ready']} then); errors "
          f"{s['errors']}; TTFT p99 max {s['p99_ratio_max']:.2f}x warm ({s['warm_ttft_p99_ms']:.0f} ms), after 10 s "
          f"{s['p99_ratio_max_after_10s']:.2f}x", flush=True)
    return c


def app_status(name: str = "vlm") -> str:
    """Ray Serve's status of the application, when this process started Ray (`--start`)."""
    try:
        import ray
        from ray import serve

        if not ray.is_initialized():  # serve.status() would start a Ray instance of its own
            return "unknown (not our Ray)"
        app = serve.status().applications.get(name)
        return str(app.status) if app else "NOT_STARTED"
    except Exception as e:  # not our Ray (--url), or no Serve
        return f"unknown ({type(e).__name__})"


# ---------------------------------------------------------------------------- scale-up under load
def scale_up_options(start: int, target_requests: float, upscale_delay_s: float, room: int = 1) -> dict[str, dict]:
    """The LLM deployment's autoscaling for the scale-up run (deep-merged into the config file's `LLM`
    entry): `start` replicas and room for `room` more, the project's policy at `target_requests` in
    flight per replica, so that the load asks for the extra replica by itself (`room=0`: the baseline,
    the same app and load with nothing to add); load pushed to the autoscaler every second, as the
    builder's own autoscalers do (the runs before 2026-12-02 pushed every 10 s, Ray's default: the
    decision came about 12 s into the load)."""
    return {"LLM": {"autoscaling_config": {
        "min_replicas": start, "initial_replicas": start, "max_replicas": start + room,
        "target_ongoing_requests": target_requests, "upscale_delay_s": upscale_delay_s, "downscale_delay_s": 600,
        "metrics_interval_s": AUTOSCALING_METRICS_INTERVAL_S,  # the builder's for its own autoscalers
        "policy": {"policy_function": "app.serving.autoscaling:LLMAutoscalingPolicy"}}}}


def startup_durations(load: dict) -> dict[str, dict]:
    """Per LLM replica of a `/v1/llm/load` answer: the seconds from its constructor's start (its startup
    timeline, app/serving/startup.py) to ready, and each phase in seconds, to say where a slow start went;
    and how it shares its GPU (app/gpu/sharing.py: MPS or time slices)."""
    out = {}
    for r in load.get("replicas", []):
        st = r.get("startup") or {}
        t0 = st.get("started_at")
        ready = r.get("ready_at")
        loaded = st.get("code_loaded_at")
        out[str(r.get("replica"))] = {
            "to_ready_s": None if t0 is None or ready is None else round(ready - t0, 2),
            "code_to_constructor_s": None if loaded is None or t0 is None else round(t0 - loaded, 2),
            "code_loaded_at": loaded, "ready_at": ready, "gpu_sharing": r.get("gpu_sharing"),
            "phases_s": {p["name"]: round(p["end"] - p["start"], 2) for p in st.get("phases", [])}}
    return out


async def fetch_startups(url: str) -> dict[str, dict]:
    async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=10)) as client:
        load = await _get_json(client, "/v1/llm/load")
    return startup_durations(load or {})


async def watch_replicas(url: str, t0: float, until_s: float, every_s: float = 0.5) -> list[dict]:
    """The LLM replicas that answer /v1/llm/load (Ray Serve routes only to running ones) every `every_s`:
    seconds from t0, and per replica when it became ready and took its first request, and the phases of
    its start (app/serving/startup.py), from t0."""
    wall0 = time.time() - (time.perf_counter() - t0)

    def rel(wall: float | None) -> float | None:
        return None if wall is None else wall - wall0

    def phases(r: dict) -> list[dict]:
        return [{"name": p["name"], "start_s": rel(p["start"]), "end_s": rel(p["end"])}
                for p in (r.get("startup") or {}).get("phases", [])]

    samples = []
    async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=5)) as client:
        while time.perf_counter() < t0 + until_s:
            load = await _get_json(client, "/v1/llm/load")
            if load is not None:
                samples.append({"t": time.perf_counter() - t0, "replicas": {
                    str(r.get("replica")): {"ready_s": rel(r.get("ready_at")),
                                            "first_request_s": rel(r.get("first_request_at")),
                                            "startup": phases(r)}
                    for r in load.get("replicas", [])}})
            await asyncio.sleep(every_s)
    return samples


def host_during(host: list[dict], second: int, top: int = 3) -> dict | None:
    """The host timeline's view of one second of the load (`HostTimeline` rows, their `t` on the load's
    clock): the row whose interval ends first after the second's middle: host busy, GPU busy, the
    `top` groups by cores, and the processes that appeared."""
    after = [r for r in host if r["t"] >= second + 0.5]
    if not after:
        return None
    r = after[0]
    return {"t": round(r["t"], 2), "host_busy": round(r["host_busy"], 3), "gpu_busy": r["gpu_busy"],
            "cores": {g: round(c, 2) for g, c in list(r["cores"].items())[:top]}, "new": r["new"]}


def scale_up_summary(rows: list[dict], samples: list[dict], warm_p99_ms: float, around_s: float = 10.0,
                     host: list[dict] | None = None) -> dict:
    """When the added replica appeared, became ready and took its first request (seconds from the load's
    start); each second's TTFT p99 over the warm app's at the same rate (`cold_summary`'s ratios), the
    worst of them from `around_s` before the new replica was ready to `around_s` after, and the issue's
    test: no errors and no second above 2x warm. `p99_ratio_max_settled` is the worst of the seconds from
    `around_s` after the new replica's first request on, when nothing starts any more: the noise of the
    measure itself, as a second's p99 over about rate requests is near its slowest one, while the warm
    reference is a window's p99 (2026-12-02 at 90 req/s: up to 1.69x in the settled seconds)."""
    first = set(samples[0]["replicas"]) if samples else set()
    added, latest = None, {}  # the added replica, and its report in the last sample that has it
    for smp in samples:
        new = [(rid, r) for rid, r in smp["replicas"].items() if rid not in first]
        if new:
            rid, r = new[0]
            latest = next(x["replicas"][rid] for x in samples[::-1] if rid in x["replicas"])
            added = {"replica": rid, "seen_s": smp["t"], "ready_s": r["ready_s"],
                     "first_request_s": latest["first_request_s"]}
            break
    base = cold_summary(rows, warm_p99_ms)
    out = {"replicas_at_start": len(first), "added": added, "warm_ttft_p99_ms": warm_p99_ms,
           "errors": base["errors"], "p99_ratio_max": base["p99_ratio_max"]}
    if added is not None and added["ready_s"] is not None:
        lo, hi = added["ready_s"] - around_s, added["ready_s"] + around_s
        near = [r["p99_ratio"] for r in rows if lo <= r["second"] < hi and not math.isnan(r["p99_ratio"])]
        out["p99_ratio_max_around_join"] = max(near, default=float("nan"))
        out["startup_phases"] = [{**p, "p99_ratio_max": _worst_during(rows, p["start_s"], p["end_s"])}
                                 for p in latest.get("startup") or []]
        if added["first_request_s"] is not None:
            settled = [r["p99_ratio"] for r in rows
                       if r["second"] >= added["first_request_s"] + around_s and not math.isnan(r["p99_ratio"])]
            out["p99_ratio_max_settled"] = max(settled, default=float("nan"))
    out["within_2x_no_errors"] = base["errors"] == 0 and base["p99_ratio_max"] <= 2.0
    worst = _worst(rows)
    if worst is not None:
        out["worst_second"] = worst["second"]
        if host:
            out["host_at_worst"] = host_during(host, worst["second"])
    return out


def host_text(h: dict | None) -> str:
    if not h:
        return "no host sample"
    gpu = f", GPU {'/'.join(f'{u:.0f}' for u in h['gpu_busy'])}% busy" if h["gpu_busy"] else ""
    cores = ", ".join(f"{g} {c:.2f}" for g, c in h["cores"].items())
    new = f"; new processes: {', '.join(f'{n} {g}' for g, n in h['new'].items())}" if h["new"] else ""
    return f"host {100 * h['host_busy']:.0f}% busy{gpu}; cores: {cores}{new}"


def _worst_during(rows: list[dict], start_s: float | None, end_s: float | None) -> float:
    """The highest per-second TTFT p99 ratio among the seconds [k, k + 1) that overlap [start_s, end_s]."""
    if start_s is None or end_s is None:
        return float("nan")
    seen = [r["p99_ratio"] for r in rows
            if r["second"] < end_s and r["second"] + 1 > start_s and not math.isnan(r["p99_ratio"])]
    return max(seen, default=float("nan"))


def scale_up_run(bench: Bench, a, wl, rate: float, deploy: Callable[[], None]) -> dict:
    """The app deployed again with `scale_up_options`, load at `rate` for `--scale-up-s` from the moment it
    is ready, the LLM replicas watched throughout; then the same rate on the scaled app for the warm
    reference. The load is a cold start's (`Bench.cold`) with the replicas watched beside it."""
    samples: list[dict] = []
    out = _watched_load(bench, a, wl, rate, deploy, samples)
    out["llm_status_at_end"] = deployment_status("LLM")  # why no replica was added, if none was
    warm = bench.point(wl, rate, a.ramp_s, a.cold_warm_window_s)
    out.update(replica_samples=samples, warm=warm)
    warm_p99 = warm["ttft_ms"]["p99"] if warm else float("nan")
    out["summary"] = scale_up_summary(out["per_second"], samples, warm_p99, host=out["host_timeline"])
    s = out["summary"]
    print(f"scale-up at {rate:g} req/s from {s['replicas_at_start']} LLM replica(s): {joined_text(s['added'])}; "
          f"errors {s['errors']}; TTFT p99 max {s['p99_ratio_max']:.2f}x warm ({s['warm_ttft_p99_ms']:.0f} ms) at "
          f"second {s.get('worst_second')}: {host_text(s.get('host_at_worst'))}", flush=True)
    return out


def _watched_load(bench: Bench, a, wl, rate: float, deploy: Callable[[], None], samples: list[dict]) -> dict:
    """`Bench.cold` for `--scale-up-s` with the LLM replicas (into `samples`) and the host (the result's
    `host_timeline`: benchmarks/monitor.py's HostTimeline, one row a second) watched beside the load."""
    from benchmarks.monitor import HostTimeline

    host: list[dict] = []

    async def watch(t0: float) -> dict:
        tl = HostTimeline(t0=t0, gpus=not a.no_monitor)
        await asyncio.to_thread(tl.__enter__)  # its first scan of the host's processes, off the load's loop
        try:
            samples.extend(await watch_replicas(bench.url, t0, a.scale_up_s + 5))
        finally:
            await asyncio.to_thread(tl.__exit__, None, None, None)
        host.extend(tl.rows)
        return {}

    out = bench.cold(wl, rate, deploy, a.scale_up_s, a.ready_timeout_s, watch=watch)
    out["host_timeline"] = host
    return out


def before_start_s(summary: dict) -> float | None:
    """When the scale-up's added replica began its start on the load's clock (its first phase), else when
    it was ready; None when none was added."""
    phases = summary.get("startup_phases") or []
    starts = [p["start_s"] for p in phases if p.get("start_s") is not None]
    if starts:
        return min(starts)
    return (summary.get("added") or {}).get("ready_s")


def _worst(rows: list[dict], until_s: float | None = None) -> dict | None:
    kept = [r for r in rows if not math.isnan(r["p99_ratio"]) and (until_s is None or r["second"] + 1 <= until_s)]
    return max(kept, key=lambda r: r["p99_ratio"], default=None)


def scale_up_baseline(bench: Bench, a, wl, rate: float, deploy: Callable[[], None], scale_up: dict) -> dict:
    """The scale-up's control: the same app, start and load with no room for another replica, each
    second against the scale-up's warm reference. Compared over the seconds before the scale-up's added
    replica began its start (`before_start_s`), the two runs are alike but for the autoscaler's request and
    the new replica's worker: a second slow in both is the starting replicas' own tail at this rate."""
    out = baseline_load(bench, a, wl, rate, deploy)
    out["summary"] = baseline_summary(out, scale_up)
    print(baseline_text(out["summary"], rate), flush=True)
    return out


def baseline_load(bench: Bench, a, wl, rate: float, deploy: Callable[[], None]) -> dict:
    """The baseline's deploy and load alone (`_watched_load`), for `baseline_summary` once the scale-up
    has run: `--scale-up-baseline-first` runs it before the scale-up, so that an order effect shows."""
    samples: list[dict] = []
    out = _watched_load(bench, a, wl, rate, deploy, samples)
    out["replicas_seen"] = len(samples[-1]["replicas"]) if samples else None
    return out


def baseline_summary(out: dict, scale_up: dict) -> dict:
    """The baseline's seconds against the scale-up's warm reference, up to when its added replica began."""
    warm_p99_ms = scale_up["summary"]["warm_ttft_p99_ms"]
    base = cold_summary(out["per_second"], warm_p99_ms)
    until = before_start_s(scale_up["summary"])
    worst, worst_before = _worst(out["per_second"]), _worst(out["per_second"], until)
    theirs = _worst(scale_up["per_second"], until)
    return {
        "errors": base["errors"], "p99_ratio_max": base["p99_ratio_max"], "warm_ttft_p99_ms": warm_p99_ms,
        "worst_second": worst["second"] if worst else None,
        "host_at_worst": host_during(out["host_timeline"], worst["second"]) if worst else None,
        "replicas": out.get("replicas_seen"), "compared_until_s": until,
        "p99_ratio_max_before": worst_before["p99_ratio"] if worst_before else None,
        "scale_up_p99_ratio_max_before": theirs["p99_ratio"] if theirs else None,
        "side_by_side": [{"second": r["second"], "scale_up": r["p99_ratio"], "baseline": b["p99_ratio"]}
                         for r, b in zip(scale_up["per_second"], out["per_second"], strict=False)]}


def scale_up_stage(bench: Bench, a, wl, rate: float, deploy_with_room: Callable[[int], Callable[[], None]],
                   stop: Callable[[], None], deadline: float | None, needed_s: float) -> dict:
    """The scale-up (`scale_up_run`) and, with `--scale-up-baseline`, its baseline after it, or before it
    with `--scale-up-baseline-first`; `deploy_with_room(n)` deploys the app with room for n more LLM
    replicas, `stop()` deletes it. A baseline that would end after `deadline` is skipped."""
    def left() -> float:
        return math.inf if deadline is None else deadline - time.perf_counter()

    baseline_s = a.scale_up_s + a.drain_s + 90  # a redeploy, the load, its drain
    wanted = a.scale_up_baseline or a.scale_up_baseline_first
    first = None
    if a.scale_up_baseline_first and left() >= needed_s + baseline_s:
        stop()
        first = baseline_load(bench, a, wl, rate, deploy_with_room(0))
    stop()
    out = scale_up_run(bench, a, wl, rate, deploy_with_room(1))
    if first is not None:
        first["summary"], first["ran"] = baseline_summary(first, out), "first"
        out["baseline"] = first
        print(baseline_text(first["summary"], rate) + " (run first)", flush=True)
    elif wanted and left() < baseline_s:
        print("scale-up baseline: no time left", flush=True)
        out["baseline"] = {"rate": rate, "skipped": "deadline"}
    elif wanted:
        stop()
        out["baseline"] = scale_up_baseline(bench, a, wl, rate, deploy_with_room(0), out)
    return out


def baseline_text(b: dict, rate: float | None = None) -> str:
    at = f" at {rate:g} req/s" if rate is not None else ""
    before = ""
    if b.get("compared_until_s") is not None and b.get("p99_ratio_max_before") is not None:
        before = (f"; before the added replica's start ({b['compared_until_s']:.1f} s) {b['p99_ratio_max_before']:.2f}x "
                  f"against the scale-up's {b['scale_up_p99_ratio_max_before']:.2f}x")
    return (f"scale-up baseline{at} (the same app and load, no replica to add): errors {b['errors']}, TTFT p99 max "
            f"{b['p99_ratio_max']:.2f}x the same warm reference at second {b['worst_second']}{before}: "
            f"{host_text(b.get('host_at_worst'))}")


def joined_text(added: dict | None) -> str:
    """When the added replica was ready and took its first request, in words (seconds from the load's start)."""
    if added and added["ready_s"] is not None and added["first_request_s"] is not None:
        return (f"the added replica ready at {added['ready_s']:.1f} s, first request at "
                f"{added['first_request_s']:.1f} s after the load began")
    return "no replica was added"


def deployment_status(deployment: str, name: str = "vlm") -> dict:
    """Ray Serve's view of one deployment (status, message, replicas by state, the autoscaler's
    target), when this process started Ray; else why not."""
    try:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return {"unknown": "not our Ray"}
        d = serve.status().applications[name].deployments[deployment]
        out = {"status": str(d.status), "message": d.message,
               "replica_states": {str(getattr(k, "value", k)): v for k, v in d.replica_states.items()}}
        auto = getattr(d, "autoscaling_status", None) or getattr(d, "autoscaling_info", None)
        if auto is not None:
            out["autoscaling"] = str(auto)
        return out
    except Exception as e:
        return {"unknown": f"{type(e).__name__}: {e}"}


def replica_balance(samples: list[dict]) -> list[dict]:
    """Per LLM replica over /v1/llm/load samples (each replica's report: its GPU, running, waiting and
    cumulative `engine_gpu_ms_total`): samples seen, mean running and waiting, and its share of the
    engines' GPU time between the first and the last sample. Uneven shares at saturation are routing's."""
    seen: dict[str, list[dict]] = {}
    for smp in samples:
        for r in smp.get("replicas", []):
            seen.setdefault(str(r.get("replica")), []).append(r)
    gpu_ms = {rid: rs[-1].get("engine_gpu_ms_total", 0.0) - rs[0].get("engine_gpu_ms_total", 0.0)
              for rid, rs in seen.items()}
    total = sum(gpu_ms.values())
    return [{"replica": rid, "gpu": rs[-1].get("cuda_visible_devices"), "samples": len(rs),
             "running_mean": sum(r.get("running", 0) for r in rs) / len(rs),
             "waiting_mean": sum(r.get("waiting", 0) for r in rs) / len(rs),
             "engine_gpu_ms": gpu_ms[rid], "gpu_time_share": gpu_ms[rid] / total if total else None}
            for rid, rs in sorted(seen.items(), key=lambda kv: str(kv[1][-1].get("cuda_visible_devices")))]


def closed_loop(url: str, wl, a, concurrency: int, n: int, offset: int) -> dict:
    """serve.py's closed loop, with the LLM replicas' load read each second beside it (`replica_balance`)."""
    import threading

    import httpx

    samples: list[dict] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=5) as client:
            while not stop.wait(1.0):
                try:
                    samples.append(client.get("/v1/llm/load").json())
                except (httpx.HTTPError, ValueError):
                    pass

    poller = threading.Thread(target=poll, daemon=True, name="llm-load")
    poller.start()
    try:
        r = asyncio.run(run_load(url, wl, n, concurrency, None, warmup=min(32, concurrency), progress=False,
                                 seed_offset=offset, monitor=not a.no_monitor,
                                 processes=min(a.load_processes, concurrency)))
    finally:
        stop.set()
        poller.join(timeout=10)
    res = r.resources or {}
    return {"concurrency": concurrency, "requests": n, "request_throughput": r.request_throughput,
            "steady_request_throughput": r.steady_request_throughput, "failed": r.failed, "ttft_ms": r.ttft_ms,
            "e2e_ms": r.e2e_ms, "errors": r.errors, "replica_balance": replica_balance(samples),
            "resources": {k: res.get(k) for k in ("gpu_mean", "host_busy", "groups", "verdict")} if res else {}}


def served_checkpoint(a, app_args: dict) -> str:
    """The served checkpoint's folder (built first where it is an embedded preset): the config file's args
    deep-merged with `main`'s `app_args` (--app-args, --model), as `main` deploys them."""
    from app.checkpoints.model_builder import resolve_model

    args = deep_merge(config_file(a)[1], app_args)
    return str(resolve_model(args.get("model") or "embedded:tiny", args.get("cache_dir")))


def run_crosscheck(bench: Bench, a, first: dict, out_dir: Path, app_args: dict) -> dict:
    """Our point and the tool's (GuideLLM's or AIPerf's) at the same rate and request shape, one after the
    other on the warm app."""
    import importlib.util
    import shlex

    rate = a.crosscheck_rate or first["search"]["goodput"]
    if not rate:
        return {"tool": a.crosscheck, "skipped": "no goodput to check"}
    tool = a.crosscheck
    if tool == "aiperf" and not (a.crosscheck_tokenizer or a.start or a.model):
        return {"tool": tool, "skipped": "a server this run did not start: name its tokenizer with "
                "--crosscheck-tokenizer (or its model with --model)"}
    exe = shlex.split(a.crosscheck_exe) if a.crosscheck_exe else \
        [sys.executable, "-m", tool] if importlib.util.find_spec(tool) else [tool]
    text = "no text" if tool == "guidellm" else "a one-token text prompt"
    # the tool's request shape: its text, and for AIPerf its JPEG encoding (quality 85, no chroma subsampling:
    # 1.8x the bytes of ours, 1.7x the decode on the CPU machine); the same sampling both ways (`--sampling`)
    shape = Workload("image", a.image_size, prompt_words=0 if tool == "guidellm" else 1, output_tokens=a.output_tokens,
                     sampling=a.sampling, jpeg=(85, 0) if tool == "aiperf" else (90, None))
    ours = bench.point(shape, rate, a.ramp_s, a.window_s, monitor=False)
    runs = []
    for workers in (a.crosscheck_workers or [0]) if tool == "aiperf" else [0]:
        asyncio.run(settle(bench.url))
        if tool == "guidellm":
            theirs = crosscheck_guidellm(bench.url, rate, a.ramp_s, a.window_s, a.image_size, a.output_tokens,
                                         out_dir, exe, a.sampling)
        else:
            theirs = crosscheck_aiperf(bench.url, rate, a.ramp_s, a.window_s, a.image_size, a.output_tokens, out_dir,
                                       exe, a.crosscheck_tokenizer or served_checkpoint(a, app_args), workers or None,
                                       a.sampling)
        if ours and "point" in theirs:
            theirs["difference"] = d = agreement(ours, theirs["point"])
            who = f"{tool} ({workers} workers)" if workers else tool
            print(f"cross-check at {rate:g} req/s: {who} / ours - 1: offered {100 * d['offered_rps']:+.1f}%, served "
                  f"{100 * d['served_rps']:+.1f}%, TTFT p50 {100 * d['ttft_p50']:+.1f}%, p99 "
                  f"{100 * d['ttft_p99']:+.1f}% (its arrival gaps' CV {theirs['arrival_gap_cv']:.2f}; Poisson: 1)"
                  f"{cpu_text(theirs.get('cpu'))}", flush=True)
        else:
            print(f"cross-check at {rate:g} req/s failed: {theirs.get('error')}", flush=True)
        runs.append(theirs)
    # the first run's fields at the top, as before; every run (one per --crosscheck-workers) in `runs`
    out = {"rate": rate, "shape": f"{a.image_size}^2 noise JPEG, {text}, {a.output_tokens} tokens", "ours": ours,
           **runs[0]}
    if len(runs) > 1:
        out["runs"] = runs
    return out


def cpu_text(cpu: dict | None) -> str:
    """`; its processes 4.1 cores, the host 13.2 of 16 busy` (run_tool's figures), or ''."""
    if not cpu or "tool_cores" not in cpu:
        return ""
    host = f", the host {cpu['host_busy_cores']:.1f} of {cpu['host_cores']} busy" if "host_busy_cores" in cpu else ""
    return f"; its processes {cpu['tool_cores']:.1f} cores{host}"


def coarse_rates(a, saturation: float | None) -> list[float]:
    if a.rates:
        return sorted(a.rates)
    if not saturation:
        raise SystemExit("give --rates, or --closed-loop so the search can start from the saturation throughput")
    return [round(f * saturation, 2) for f in sorted(a.fractions)]


def gpu_cell(point: dict) -> str:
    """`engine, tower` GPU ms per served request ("-" where unmeasured); "(host clock)" when the
    server timed without CUDA events, "*" when some brackets overlapped on a shared stream."""
    gpu = point.get("gpu_time") or {}
    cells = []
    for kind, _, _ in GPU_KINDS:
        g = gpu.get(kind) or {}
        v = g.get("ms_per_request")
        cells.append("-" if v is None else f"{v:.2f}{'*' if g.get('interleaved') else ''}")
    clocks = {g.get("clock") for g in gpu.values()} - {None}
    host = " (host clock)" if any("host_clock" in c for c in clocks) else ""
    return ", ".join(cells) + host


def cpu_cell(groups: dict | None, top: int = 4) -> str:
    """The monitor's CPU cores per process group (deployment), busiest first: `LLM 1.05 (1), Router 0.40 (2)`
    with the processes in each group."""
    if not groups:
        return "-"
    ranked = sorted(groups.items(), key=lambda kv: -kv[1]["cores"])[:top]
    return ", ".join(f"{name} {g['cores']:.2f} ({g['processes']})" for name, g in ranked)


def parts_cell(point: dict) -> str:
    """The server's TTFT parts over the window, mean ms (p99's bucket): encode, queue, prefill."""
    parts = point.get("server", {}).get("ttft_parts") or {}
    cells = [f"{parts[k]['mean_ms']:.0f} ({parts[k]['p99_bucket_ms']:g})" for k in ("encode", "queue", "prefill")
             if parts.get(k, {}).get("n")]
    return ", ".join(cells) or "-"


def encode_parts_cell(point: dict) -> str:
    """The encode time's parts over the window, p99 bucket ms: wait, run, wake (`-` without them)."""
    parts = point.get("server", {}).get("ttft_parts") or {}
    cells = [f"{parts[k]['p99_bucket_ms']:g}" for k in ("encode_wait", "encode_run", "encode_wake")
             if parts.get(k, {}).get("n")]
    return ", ".join(cells) if len(cells) == 3 else "-"


def gc_cell(point: dict) -> str:
    """The LLM replicas' full garbage collections in the window: `count, summed pause ms`; then, where the
    replicas report it, their event loops' lag, the worst replica's: `mean ms / p99 bucket ms / % > 10 ms`."""
    server = point.get("server", {})
    g, lag = server.get("gc"), server.get("loop_lag")
    cell = "-" if not g else f"{g['full_collections']}, {g['full_pause_ms']:.0f}"
    if lag:
        cell += (f"; lag {lag['mean_ms_max']:.1f} / {lag['p99_bucket_ms_max']:g} / "
                 f"{100 * lag['late_10ms_share_max']:.0f}%")
    return cell


def summary_lines(results: dict) -> list[str]:
    lines = ["| workload | offered req/s | served req/s | served % | TTFT p50 / p99 ms | TPOT p50 / p99 ms | errors "
             "| GPU ms / request: engine, tower | TTFT parts, mean (p99 bucket) ms: encode, queue, prefill "
             "| encode's parts, p99 bucket ms: wait, run, wake "
             "| GPU busy % | CPU cores by process | LLM full GCs: count, ms; event-loop lag: mean, p99 bucket ms, "
             "share > 10 ms | pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, w in results.get("workloads", {}).items():
        for p in w.get("search", {}).get("points", []):
            res = p["server"].get("resources", {})
            busy = "/".join(f"{u:.0f}" for u in res.get("gpu_mean", [])) or "-"
            errs = ", ".join(f"{k} x{v}" for k, v in p["errors"].items()) or "0"
            lines.append(f"| {label} | {p['rate']:g} ({p['offered_rps']:.1f}) | {p['served_rps']:.1f} | "
                         f"{100 * p['served_ratio']:.1f} | {p['ttft_ms']['p50']:.0f} / {p['ttft_ms']['p99']:.0f} | "
                         f"{p['tpot_ms']['p50']:.1f} / {p['tpot_ms']['p99']:.1f} | {errs} | {gpu_cell(p)} | "
                         f"{parts_cell(p)} | {encode_parts_cell(p)} | {busy} | "
                         f"{cpu_cell(res.get('groups'))} | {gc_cell(p)} | {'yes' if p['passes'] else 'no'} |")
        s = w.get("search", {})
        sat = w.get("closed_loop", {}).get("steady_request_throughput")
        ratio = f", {s.get('goodput', 0) / sat:.2f} of closed-loop saturation {sat:.1f}" if sat else ""
        lines.append(f"| **{label} goodput** | **{s.get('goodput', 0):g} req/s** (fails at {s.get('fails_at')}; "
                     f"TTFT p99 bound {w.get('ttft_p99_bound_ms'):.0f} ms{ratio}) | | | | | | | | | | | | |")
    if any(p.get("gpu_time") for w in results.get("workloads", {}).values()
           for p in w.get("search", {}).get("points", [])):
        lines += ["", "GPU ms / request: the device time of the engines' steps and of the towers' batches (CUDA "
                  "events around each, app/gpu/timing.py) in the window, over the window's completions; `*`: some "
                  "of them overlapped another on the same stream (the `fused` tower on the engine's stream), so "
                  "each may include part of the other's work.", ""]
    for label, w in results.get("workloads", {}).items():
        tails = ttft_tail.tables_by_rate([(f"{p['rate']:g} req/s", p.get("ttft_tail") or {})
                                          for p in w.get("search", {}).get("points", [])])
        if tails:
            lines += [f"{label}: where the time to first token went, mean ms over the window's requests / over "
                      "the slowest 1% by the client's TTFT (each request's own parts, which its answer opened with: "
                      "benchmarks/ttft_tail.py)", "", *tails, ""]
    for label, w in results.get("workloads", {}).items():
        bal = w.get("closed_loop", {}).get("replica_balance") or []
        if bal:
            lines.append(f"{label}, closed loop, LLM replicas (GPU/replica: share of engine GPU time, mean running "
                         "/ waiting): " + "; ".join(
                             f"{b['gpu']}/{str(b['replica'])[:8]}: {100 * (b['gpu_time_share'] or 0):.0f}%, "
                             f"{b['running_mean']:.1f} / {b['waiting_mean']:.1f}" for b in bal))
    for c in results.get("cold_start", []):
        s = c.get("summary", {})
        if "per_second" not in c:
            lines.append(f"cold start at {c['rate']:g} req/s: skipped ({c.get('skipped')})")
            continue
        lines.append(f"cold start at {c['fraction'] or float('nan'):.2f} x goodput ({c['rate']:g} req/s): ready in "
                     f"{c['ready_s']:.1f} s, "
                     f"errors {s.get('errors')}, TTFT p99 max {s.get('p99_ratio_max', float('nan')):.2f}x warm "
                     f"({s.get('warm_ttft_p99_ms', float('nan')):.0f} ms), after 10 s "
                     f"{s.get('p99_ratio_max_after_10s', float('nan')):.2f}x")
    up = results.get("scale_up")
    if up and "per_second" not in up:
        lines.append(f"scale-up at {up['rate']:g} req/s: skipped ({up.get('skipped')})")
    elif up:
        s = up["summary"]
        lines.append(f"scale-up at {up['rate']:g} req/s from {s['replicas_at_start']} LLM replica(s): "
                     f"{joined_text(s['added'])}; "
                     f"errors {s['errors']}, TTFT p99 max {s['p99_ratio_max']:.2f}x warm "
                     f"({s['warm_ttft_p99_ms']:.0f} ms), around the join "
                     f"{s.get('p99_ratio_max_around_join', float('nan')):.2f}x, settled (from 10 s after its first "
                     f"request) {s.get('p99_ratio_max_settled', float('nan')):.2f}x; the worst second "
                     f"({s.get('worst_second')}): {host_text(s.get('host_at_worst'))}")
        if s.get("startup_phases"):
            lines.append("the added replica's start, per phase: seconds from the load's start, and the worst "
                         "second's TTFT p99 / warm meanwhile: " + "; ".join(
                             f"{p['name']} {p['start_s']:.1f}-{p['end_s']:.1f} s, {p['p99_ratio_max']:.2f}x"
                             for p in s["startup_phases"]))
        base = up.get("baseline") or {}
        if base.get("summary"):
            lines.append(baseline_text(base["summary"], base.get("rate")))
        elif base.get("skipped"):
            lines.append(f"scale-up baseline: skipped ({base['skipped']})")
    return lines


def plot_goodput(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    top = 1.0
    for label, w in results.get("workloads", {}).items():
        pts = sorted(w.get("search", {}).get("points", []), key=lambda p: p["rate"])
        if not pts:
            continue
        x = [p["rate"] for p in pts]
        top = max(top, *x, *(p["offered_rps"] for p in pts))
        line, = ax1.plot(x, [p["served_rps"] for p in pts], "o-", label=f"{label} served")
        ax1.plot(x, [p["offered_rps"] for p in pts], ".", color=line.get_color(), alpha=0.5,
                 label=f"{label} offered in the window")
        ax2.plot(x, [p["ttft_ms"]["p99"] for p in pts], "o-", color=line.get_color(), label=f"{label} TTFT p99")
        for p in pts:
            if not p["passes"]:
                ax1.plot(p["rate"], p["served_rps"], "x", color="red", ms=9)
        ax2.axhline(w["ttft_p99_bound_ms"], color=line.get_color(), ls=":", lw=1)
        g = w["search"].get("goodput")
        if g:
            for ax in (ax1, ax2):
                ax.axvline(g, color=line.get_color(), ls="--", lw=1)
            ax1.text(g, 0.02 * top, f" goodput {g:g}", color=line.get_color(), fontsize=8, rotation=90, va="bottom")
    ax1.plot([0, top], [0, top], color="0.6", lw=0.8, label="served = offered")
    ax1.plot([0, top], [0, 0.98 * top], color="0.8", lw=0.8, ls="--", label="98%")
    ax1.set(xlabel="offered rate, req/s (the schedule's)", ylabel="req/s in the steady window",
            title="served against offered (red x: fails)")
    ax2.set(xlabel="offered rate, req/s (the schedule's)", ylabel="ms", yscale="log",
            title="TTFT p99 (dotted: bound; dashed: goodput)")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cold(cold: list[dict], path: Path, title: str = "cold start: per-second TTFT p99 (dotted: the warm app at "
              "the same rate; x: errors)") -> None:
    """Per-second TTFT p99 of cold starts, or of a scale-up (dashed: when the added replica was ready)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for c in cold:
        rows = c["per_second"]
        label = c.get("label") or f"{c['fraction'] or float('nan'):.2f} x goodput ({c['rate']:g} req/s)"
        line, = ax.plot([r["second"] for r in rows], [r["ttft_p99_ms"] for r in rows], "o-", ms=3, label=label)
        added = c.get("summary", {}).get("added") or {}
        if added.get("ready_s") is not None:
            ax.axvline(added["ready_s"], color=line.get_color(), ls="--", lw=1)
        for i, p in enumerate(c.get("summary", {}).get("startup_phases") or []):  # the added replica's start
            if p["start_s"] is not None and p["end_s"] is not None:
                ax.axvspan(p["start_s"], p["end_s"], color=f"C{(i % 8) + 2}", alpha=0.15, lw=0, label=p["name"])
        warm = c.get("summary", {}).get("warm_ttft_p99_ms")
        if warm:
            ax.axhline(warm, color=line.get_color(), ls=":", lw=1)
        for r in rows:
            if r["errors"]:
                ax.plot(r["second"], r["ttft_p99_ms"] if not math.isnan(r["ttft_p99_ms"]) else warm or 1, "x",
                        color="red", ms=8)
    ax.set(xlabel="seconds after ready (by arrival)", ylabel="TTFT p99 ms", yscale="log", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--workload", nargs="+", default=["image"], help="image, image@<size>, video, mix, mix@<seed>")
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--video-size", type=int, default=224)
    p.add_argument("--video-frames", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--sampling", choices=SAMPLINGS, default="greedy",
                   help="greedy: every request (ours and the cross-check tool's) sends temperature 0; defaults: none "
                        "does, so the checkpoint's generation_config applies (Qwen3-VL: temperature 0.7, top_k 20, "
                        "top_p 0.8), as for clients that leave it out; the workloads' labels say so")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    p.add_argument("--cv", type=float, default=2.0, help="--arrival gamma: coefficient of variation of the gaps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", type=float, nargs="*", default=None, help="coarse rates (req/s) of the search")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.7, 0.85, 1.0],
                   help="without --rates: coarse rates as fractions of the closed-loop saturation")
    p.add_argument("--max-points", type=int, default=7)
    p.add_argument("--resolution", type=float, default=0.05, help="bisect until the bracket is this share of the rate")
    p.add_argument("--no-search", action="store_true", help="measure the --rates only, no bisection or growth")
    p.add_argument("--min-served", type=float, default=0.98)
    p.add_argument("--ttft-p99-ms", type=float, default=TTFT_BOUNDS_MS["image"], help="bound for image workloads")
    p.add_argument("--ttft-p99-ms-video", type=float, default=TTFT_BOUNDS_MS["video"])
    p.add_argument("--ttft-p99-ms-mix", type=float, default=TTFT_BOUNDS_MS["mix"])
    p.add_argument("--warmup-s", type=float, default=10.0, help="declared warm-up per workload (not in the results)")
    p.add_argument("--warmup-rate", type=float, default=None, help="default: the search's first rate")
    p.add_argument("--ramp-s", type=float, default=3.0, help="each point's first seconds, out of its window")
    p.add_argument("--window-s", type=float, default=12.0, help="each point's steady window")
    p.add_argument("--min-window-arrivals", type=int, default=400,
                   help="a point's window is at least this many arrivals long (N / rate seconds, at most "
                        "--max-window-s): fewer make the 98%% rule read noise (one request of 150 is 0.7%%)")
    p.add_argument("--max-window-s", type=float, default=30.0, help="the longest window --min-window-arrivals makes")
    p.add_argument("--max-ramp-s", type=float, default=12.0,
                   help="a point's ramp is at least 1.25 x the longest E2E p99 of its workload's warm-up and earlier "
                        "points (requests that take longer than the ramp would start the window short of "
                        "completions), up to this")
    p.add_argument("--drain-s", type=float, default=30.0, help="wait at most this long after the last arrival")
    p.add_argument("--drain-guess-s", type=float, default=2.0, help="drain time assumed by the deadline check")
    p.add_argument("--timeout-s", type=float, default=120.0, help="client connect / read timeout per request")
    p.add_argument("--closed-loop", type=int, nargs=2, metavar=("CONCURRENCY", "REQUESTS"), default=None)
    p.add_argument("--cold-start", type=float, nargs="*", default=[], metavar="FRACTION",
                   help="with --start: redeploy and load at these fractions of the first workload's goodput")
    p.add_argument("--cold-rate", type=float, nargs="*", default=None, help="absolute cold-start rates instead")
    p.add_argument("--cold-first", type=float, default=None, metavar="RATE",
                   help="with --start: the first deploy (Ray started with it) is a cold start at this rate, e.g. half "
                        "the expected goodput (its fraction of the measured goodput is reported): one deploy less")
    p.add_argument("--cold-s", type=int, default=25)
    p.add_argument("--cold-warm-window-s", type=float, default=10.0, help="the warm reference point's window")
    p.add_argument("--scale-up", type=float, default=None, metavar="FRACTION",
                   help="then an LLM replica added by autoscaling under load: the app deployed again with "
                        "--scale-up-from LLM replicas and room for one more, load at FRACTION x goodput")
    p.add_argument("--scale-up-rate", type=float, default=None, help="the scale-up's rate in req/s instead")
    p.add_argument("--scale-up-s", type=int, default=60, help="seconds of load from ready")
    p.add_argument("--scale-up-from", type=int, default=1, help="LLM replicas before the step")
    p.add_argument("--scale-up-target", type=float, default=2.0,
                   help="the LLM's target_ongoing_requests during the scale-up (low: the load asks for a replica)")
    p.add_argument("--scale-up-delay-s", type=float, default=2.0, help="the LLM's upscale_delay_s then")
    p.add_argument("--scale-up-baseline", action="store_true",
                   help="then the same deploy and load with no room for another replica (`scale_up.baseline`): "
                        "which slow seconds are the starting replicas' own")
    p.add_argument("--scale-up-baseline-first", action="store_true",
                   help="the baseline's load before the scale-up's instead of after it (an order effect shows)")
    p.add_argument("--ready-timeout-s", type=float, default=480.0)
    p.add_argument("--load-processes", type=int, default=1)
    p.add_argument("--no-monitor", action="store_true")
    p.add_argument("--deadline-s", type=float, default=None, help="start no point that would end after this")
    p.add_argument("--crosscheck", choices=("guidellm", "aiperf"), default=None,
                   help="after the first workload: GuideLLM's or AIPerf's Poisson at its goodput (or "
                        "--crosscheck-rate) beside our own point of the same shape (image, --output-tokens)")
    p.add_argument("--crosscheck-rate", type=float, default=None)
    p.add_argument("--crosscheck-exe", default=None,
                   help="the tool's command (default: `python -m TOOL` when importable, else `TOOL`)")
    p.add_argument("--crosscheck-workers", type=int, nargs="+", default=None, metavar="N",
                   help="aiperf: one run per value against the same app, with N worker processes (0: its default, "
                        "(cores x 0.75) - 1): whether its TTFT is the server's or its workers' own")
    p.add_argument("--crosscheck-tokenizer", default=None,
                   help="aiperf: the tokenizer folder for its synthetic prompts (default: the served checkpoint's, "
                        "from --model, --app-args and --serve-config)")
    p.add_argument("--pyspy", default=None, metavar="EXE", help="py-spy's path: sample every serving process "
                   "(all threads, and the GIL holder) inside the window of each --pyspy-rate point")
    p.add_argument("--pyspy-rate", type=float, nargs="*", default=[])
    p.add_argument("--pyspy-s", type=float, default=8.0)
    p.add_argument("--start", action="store_true", help="start Ray and the application here")
    p.add_argument("--serve-config", default=None)
    p.add_argument("--num-gpus", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--app-args", default="{}")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--router-port", type=int, default=None)
    p.add_argument("--via", choices=("auto", "proxy", "port"), default="auto")
    p.add_argument("--out-dir", default="benchmarks/serve_results/goodput")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    t_begin = time.perf_counter()
    deadline = None if a.deadline_s is None else t_begin + a.deadline_s
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workloads = [workload_of(w, a) for w in a.workload]
    app_args = json.loads(a.app_args)
    if a.model or not a.serve_config:
        app_args["model"] = a.model or "embedded:tiny"
    if a.router_port:
        app_args = deep_merge(app_args, {"router_http_port": a.router_port, "router_http_host": "127.0.0.1"})
    url = a.url
    results: dict = {"meta": {"argv": sys.argv[1:] if argv is None else argv, "arrival": a.arrival,
                              "cv": a.cv if a.arrival == "gamma" else 1.0, "seed": a.seed, "ramp_s": a.ramp_s,
                              "window_s": a.window_s, "min_served": a.min_served, "load_processes": a.load_processes,
                              "cpu_count": os.cpu_count()},
                     "workloads": {}, "cold_start": []}

    def save() -> None:
        (out_dir / "goodput.json").write_text(json.dumps(results, indent=1, default=str))

    started = False
    try:
        deploy = None
        if a.start:
            proxy_port, url = entry_points(a, app_args)
            deploy = functools.partial(start_app, app_args, proxy_port, a.serve_config, a.num_gpus, wait=False)
        results["meta"]["url"] = url
        bench = Bench(url, a, deadline)
        if a.start and a.cold_first:  # the first deploy is a cold start (Ray started before it)
            init_ray(a.num_gpus)
            started = True
            c = cold_run(bench, a, workloads[0], a.cold_first, deploy)
            results["cold_start"].append(c)
            results["meta"]["ready_s"] = c["ready_s"]
            save()
        elif a.start:
            t = time.perf_counter()
            start_app(app_args, proxy_port, a.serve_config, a.num_gpus)
            started = True
            results["meta"]["ready_s"] = time.perf_counter() - t
            print(f"application ready in {results['meta']['ready_s']:.1f} s; load to {url}", flush=True)
        if a.start:  # where the LLM replicas' starts went (issue 45's ready in <= 60 s)
            results["meta"]["llm_startup"] = asyncio.run(fetch_startups(url))
            first = results["cold_start"][0] if a.cold_first and results["cold_start"] else {}
            for rid, st in results["meta"]["llm_startup"].items():
                top = sorted(st["phases_s"].items(), key=lambda kv: -kv[1])[:8]
                around = ""
                if first.get("deploy_wall_at") and st.get("code_loaded_at") and st.get("ready_at"):
                    # the rest of a first deploy's ready time: before the replica's constructor, after it
                    st["deploy_to_code_s"] = round(st["code_loaded_at"] - first["deploy_wall_at"], 2)
                    st["replica_ready_to_app_ready_s"] = round(first["ready_wall_at"] - st["ready_at"], 2)
                    around = (f" (deploy to its worker loading the code {st['deploy_to_code_s']} s, the imports "
                              f"{st['code_to_constructor_s']} s, its ready to the app's "
                              f"{st['replica_ready_to_app_ready_s']} s)")
                shared = f", its GPU shared by {st['gpu_sharing']['mode']}" if st.get("gpu_sharing") else ""
                print(f"LLM replica {rid}: ready {st['to_ready_s']} s after its start{around}{shared}; longest phases: "
                      + ", ".join(f"{k} {v:.1f} s" for k, v in top), flush=True)
            if first.get("deploy_wall_at"):  # the part before the replicas' code: Ray Serve's own steps
                results["meta"]["deploy_timeline"] = deploy_timeline(serve_log_dir(), first["deploy_wall_at"])
                for step in results["meta"]["deploy_timeline"]:
                    print(f"deploy + {step['at_s']:6.2f} s: {step['event']}", flush=True)
        for k, wl in enumerate(workloads):
            entry: dict = {"ttft_p99_bound_ms": bound_of(wl, a)}
            results["workloads"][wl.label] = entry
            saturation = None
            if a.closed_loop and a.closed_loop[0] > 0:
                c, n = a.closed_loop
                entry["closed_loop"] = closed_loop(url, wl, a, c, n, 900_000_000 + 10_000_000 * k)
                saturation = entry["closed_loop"]["steady_request_throughput"] or entry["closed_loop"]["request_throughput"]
                print(f"{wl.label}: closed loop c={c}: {saturation:.2f} req/s steady", flush=True)
                save()
            coarse = coarse_rates(a, saturation)
            warm_rate = a.warmup_rate or coarse[0]
            if a.warmup_s > 0:
                entry["warmup"] = bench.point(wl, warm_rate, 0.0, a.warmup_s, monitor=False)
                w = entry["warmup"]
                if w:
                    print(f"{wl.label}: warm-up {a.warmup_s:g} s at {warm_rate:g} req/s: TTFT p99 "
                          f"{w['ttft_ms']['p99']:.0f} ms, errors {w['errors'] or 0}", flush=True)
            bound = entry["ttft_p99_bound_ms"]

            def measure(rate: float, wl=wl, entry=entry, bound=bound) -> dict | None:
                # the answers seen so far (warm-up, earlier points) set this point's ramp
                seen = [entry.get("warmup"), *entry.get("search", {}).get("points", [])]
                ramp = workload_ramp_s(a.ramp_s, seen, a.max_ramp_s)
                window = window_for(a.window_s, rate, a.min_window_arrivals, a.max_window_s)
                samplers = []
                if a.pyspy and rate in a.pyspy_rate:  # stacks of every serving process inside the window
                    d = out_dir / "pyspy" / re.sub(r"[^A-Za-z0-9_.@-]+", "_", f"{wl.label}_{rate:g}")
                    length = min(a.pyspy_s, max(1.0, window - 1.0))
                    samplers = pyspy_sampler.start_all(a.pyspy, d, ramp + 1.0, length)
                p = bench.point(wl, rate, ramp, window)
                if samplers:
                    print(f"{wl.label}: py-spy at {rate:g} req/s: {pyspy_sampler.wait(samplers)} of "
                          f"{len(samplers)} samplers wrote stacks", flush=True)
                if p is None:
                    print(f"{wl.label}: no time left for {rate:g} req/s", flush=True)
                    return None
                p["passes"], p["why_not"] = verdict(p, bound, a.min_served)
                print(f"{wl.label}: {rate:g} req/s offered {p['offered_rps']:.2f} served {p['served_rps']:.2f}, TTFT "
                      f"p50/p99 {p['ttft_ms']['p50']:.0f}/{p['ttft_ms']['p99']:.0f} ms, TPOT p99 "
                      f"{p['tpot_ms']['p99']:.1f} ms, errors {p['errors'] or 0}, GPU ms/request (engine, tower) "
                      f"{gpu_cell(p)}, TTFT parts ms (encode, queue, prefill) {parts_cell(p)}, encode's p99 "
                      f"buckets (wait, run, wake) {encode_parts_cell(p)}: "
                      f"{'pass' if p['passes'] else 'fail: ' + '; '.join(p['why_not'])}", flush=True)
                for kind, said in p["error_examples"].items():
                    print(f"  {kind}, the first: {said}", flush=True)
                entry.setdefault("search", {"points": []})["points"].append(p)
                save()
                return p

            if a.no_search:
                pts = [p for p in map(measure, coarse) if p is not None]
                entry["search"] = fixed_rates_result(pts, len(coarse))
            else:
                entry["search"] = search_goodput(measure, lambda p: p["passes"], coarse, a.max_points, a.resolution)
            s = entry["search"]
            print(f"{wl.label}: goodput {s['goodput']:g} req/s (fails at {s['fails_at']}), "
                  f"{'complete' if s['complete'] else 'INCOMPLETE'}", flush=True)
            save()
        if a.crosscheck:
            results["crosscheck"] = run_crosscheck(bench, a, results["workloads"][workloads[0].label], out_dir,
                                                   app_args)
            save()
        cold_rates = [(None, r) for r in a.cold_rate] if a.cold_rate else []
        goodput = results["workloads"][workloads[0].label]["search"]["goodput"]
        if a.cold_start and not cold_rates:
            cold_rates = [(f, round(f * goodput, 2)) for f in a.cold_start if goodput > 0]
        if (cold_rates or a.cold_first) and not a.start:
            raise SystemExit("--cold-start and --cold-first need --start (the app is deployed again)")
        for c in results["cold_start"]:  # --cold-first's fraction, now that goodput is known
            c["fraction"] = c["rate"] / goodput if goodput else float("nan")
        for fraction, rate in cold_rates:
            if deadline is not None and deadline - time.perf_counter() < a.cold_s + a.cold_warm_window_s + 70.0:
                print(f"cold start at {rate:g} req/s: no time left", flush=True)
                results["cold_start"].append({"fraction": fraction, "rate": rate, "skipped": "deadline"})
                continue
            stop_app()
            c = cold_run(bench, a, workloads[0], rate, deploy)
            c["fraction"] = fraction if fraction is not None else rate / goodput if goodput else float("nan")
            results["cold_start"].append(c)
            save()
        scale_rate = a.scale_up_rate or (round(a.scale_up * goodput, 2) if a.scale_up and goodput > 0 else None)
        if scale_rate and not (a.start and a.serve_config):
            raise SystemExit("--scale-up needs --start and --serve-config (the app is deployed again)")
        needed_s = a.scale_up_s + a.cold_warm_window_s + 90  # the load, the warm reference, a redeploy
        if scale_rate and deadline is not None and deadline - time.perf_counter() < needed_s:
            print(f"scale-up at {scale_rate:g} req/s: no time left", flush=True)
            results["scale_up"] = {"rate": scale_rate, "skipped": "deadline"}
        elif scale_rate:
            def deploy_with_room(room: int) -> Callable[[], None]:  # the scale-up's app, `room` replicas to add
                return functools.partial(start_app, app_args, proxy_port, a.serve_config, a.num_gpus, wait=False,
                                         deployments=scale_up_options(a.scale_up_from, a.scale_up_target,
                                                                      a.scale_up_delay_s, room=room))

            results["scale_up"] = scale_up_stage(bench, a, workloads[0], scale_rate, deploy_with_room, stop_app,
                                                 deadline, needed_s)
            save()
    finally:
        results["meta"]["seconds"] = time.perf_counter() - t_begin
        save()
        if started:
            from ray import serve

            serve.shutdown()
            import ray

            ray.shutdown()
    lines = summary_lines(results)
    (out_dir / "goodput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_goodput(results, out_dir / "goodput.png")
    if results["cold_start"] and any("per_second" in c for c in results["cold_start"]):
        plot_cold([c for c in results["cold_start"] if "per_second" in c], out_dir / "cold_start.png")
    if "per_second" in results.get("scale_up", {}):
        up = results["scale_up"]
        plot_cold([{**up, "label": f"{up['rate']:g} req/s from {up['summary']['replicas_at_start']} LLM replica(s)"}],
                  out_dir / "scale_up.png", "an LLM replica added by autoscaling under load: per-second TTFT p99 "
                  "(dotted: warm; dashed: the new replica ready; shaded: the phases of its start)")
    print(f"wrote {out_dir / 'goodput.json'}", flush=True)
    return results


if __name__ == "__main__":
    main()
