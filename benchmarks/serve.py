"""Load generator for the OpenAI endpoint: TTFT, latency, throughput and encoder behaviour.

Against a running server:
    python benchmarks/serve.py --url http://127.0.0.1:8000 --workload image --image-size 448 \
        --concurrency 8 --num-requests 64

Graphs on vs off, side by side (starts the application itself, twice):
    python benchmarks/serve.py --compare --model embedded:qwen3-vl-2b --workload image video \
        --concurrency 1 8 32 --num-requests 96 --out-dir benchmarks/serve_results

Find the bottleneck: raise concurrency 1, 2, 4, ... until throughput stops growing, sampling each
GPU's utilisation (NVML) and CPU per process (psutil, grouped by deployment) at every point, and
print which stage saturates (benchmarks/monitor.py). Starting the application itself:
    python benchmarks/serve.py --start --serve-config configs/qwen3-vl-2b-gpu.yaml --placement colocate \
        --sweep --workload image image@1024 video --out-dir benchmarks/serve_results/sweep_1gpu
or against a running server (`--url`; per-process CPU only when it runs on this host).

Workloads: `image` (--image-size, default 448), `image@1024` (an image of that size), `video`
(--video-size, --video-frames), `mixed`. Every request carries distinct random media (seeded by its
index), so the embedding cache does not flatter the numbers; the same seeds are used for both sides
of --compare. Requests stream, with `ignore_eos` so each generates exactly --output-tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import json
import multiprocessing
import os
import queue
import random
import re
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.media.synthetic import image_bytes, mp4_bytes  # noqa: E402
from benchmarks.stats import pct  # noqa: E402
from benchmarks.ttft_tail import parse_parts  # noqa: E402
from benchmarks.workloads import sampling_fields, sampling_suffix  # noqa: E402


@dataclass
class Workload:
    kind: str  # image | video | mixed (as a spec: image@<size> sets image_size)
    image_size: int = 448
    video_size: int = 224
    video_frames: int = 8
    video_fps: int = 2  # of the generated mp4; at the server's 2 fps sampling every frame is kept
    prompt_words: int = 32
    output_tokens: int = 16
    # "greedy": temperature 0; "defaults": no temperature sent, so the checkpoint's generation_config
    # applies (Qwen3-VL: temperature 0.7, top_k 20, top_p 0.8), as for clients that leave it out
    sampling: str = "greedy"
    jpeg: tuple[int, int | None] = (90, None)  # the images' JPEG quality and chroma subsampling (image_bytes)

    @property
    def label(self) -> str:
        name = {"image": f"image {self.image_size}^2",
                "video": f"video {self.video_size}^2 x{self.video_frames}f"}.get(self.kind, self.kind)
        return name + sampling_suffix(self.sampling)

    def body(self, i: int, image_url: str | None = None) -> dict:
        """Request i's body; `image_url` names an image instead of the data URL of image i's JPEG."""
        kind = self.kind if self.kind != "mixed" else ("image" if i % 2 == 0 else "video")
        if kind == "image":
            part = {"type": "image_url", "image_url": {
                "url": image_url or "data:image/jpeg;base64," + base64.b64encode(
                    image_bytes(self.image_size, self.image_size, i, "JPEG", *self.jpeg)).decode()}}
        else:
            part = {"type": "video_url", "video_url": {
                "url": "data:video/mp4;base64," + base64.b64encode(
                    mp4_bytes(self.video_frames, self.video_size, self.video_size, self.video_fps, i)).decode()}}
        text = " ".join(random.Random(i).choice(["describe", "the", "scene", "colors", "objects", "now"])
                        for _ in range(self.prompt_words))
        return {"model": "bench", "messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}],
                "max_tokens": self.output_tokens, **sampling_fields(self.sampling), "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}



# ---------------------------------------------------------------------------- client
@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    start_s: float = 0.0  # when it was sent, from the start of the run
    # asked for (`one_request(parts=True)`): the Router's time to first token and its parts, ms (benchmarks/ttft_tail.py)
    router_ttft_ms: float | None = None
    parts_ms: dict | None = None


async def one_request(client: aiohttp.ClientSession, body: bytes, request_id: str | None = None,
                      parts: bool = False) -> Result:
    """`body`: the request's JSON, serialised beforehand. `request_id` becomes Ray Serve's request id
    (x-request-id), so benchmarks/serve_trace.py can find this request's lines in every replica's log.
    `parts`: asks the Router for its time to first token's parts (`X-TTFT-Parts`), which a streamed
    answer opens with as an SSE comment.
    The client is aiohttp: httpx's pure-Python HTTP/1.1 took 0.7 of a core at 86 req/s of streamed
    responses and was about to become the load's limit."""
    t0 = time.perf_counter()
    ttft, usage, told = None, {}, None
    headers = {"content-type": "application/json"}
    if request_id:
        headers["x-request-id"] = request_id
    if parts:
        headers["x-ttft-parts"] = "1"
    try:
        async with client.post("/v1/chat/completions", data=body, headers=headers) as resp:
            if resp.status != 200:
                return Result(False, e2e_s=time.perf_counter() - t0,
                              error=f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            async for raw in resp.content:  # one server-sent-event line at a time
                if not raw.startswith(b"data: "):
                    if parts and raw.startswith(b": ttft_ms="):
                        told = parse_parts_comment(raw.decode(errors="replace"))
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    break
                if ttft is None:  # the server streams its first event once the first token exists
                    ttft = time.perf_counter() - t0
                if b'"error"' in data or b'"usage"' in data:
                    obj = json.loads(data)
                    if "error" in obj:
                        return Result(False, e2e_s=time.perf_counter() - t0, error=obj["error"]["message"])
                    usage = obj.get("usage") or usage
    except (TimeoutError, aiohttp.ClientError) as e:
        return Result(False, e2e_s=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - t0
    return Result(True, ttft if ttft is not None else e2e, e2e, usage.get("prompt_tokens", 0),
                  usage.get("completion_tokens", 0), router_ttft_ms=told[0] if told else None,
                  parts_ms=told[1] if told else None)


def parse_parts_comment(line: str) -> tuple[float, dict[str, float]] | None:
    """(the Router's TTFT ms, its parts ms) of the `: ttft_ms=... parts_ms=name:ms,...` comment
    (app/api/chat.py, `parts_comment_text`), or None."""
    head, _, rest = line.strip().partition(" parts_ms=")
    try:
        return float(head.removeprefix(": ttft_ms=")), parse_parts(rest)
    except ValueError:
        return None


@dataclass
class Report:
    workload: str
    concurrency: int | None
    request_rate: float | None
    successful: int
    failed: int
    duration_s: float
    request_throughput: float
    input_token_throughput: float
    output_token_throughput: float
    ttft_ms: dict
    e2e_ms: dict
    encoder: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    slowest: list[dict] = field(default_factory=list)  # the 8 longest TTFTs and when they were sent: a tail's when
    resources: dict = field(default_factory=dict)  # benchmarks/monitor.py's summary of the timed part
    # Completions per second between the 10th and the 90th percentile completion: the run without its
    # start (an idle server filling its pipeline: media, encoder, then the LLM) and its drain.
    steady_request_throughput: float = 0.0
    load_processes: int = 1  # processes that sent the timed requests (run_load's `processes`)


def steady_rate(done_s: list[float], lo: float = 0.1, hi: float = 0.9) -> float:
    """Completions per second between the `lo` and `hi` quantiles of the completion times."""
    if len(done_s) < 10:
        return 0.0
    t = sorted(done_s)
    a, b = round(lo * (len(t) - 1)), round(hi * (len(t) - 1))
    return (b - a) / (t[b] - t[a]) if t[b] > t[a] else 0.0


def summarize(xs: list[float]) -> dict:
    ms = [1e3 * x for x in xs]
    return {"mean": statistics.fmean(ms) if ms else float("nan"), "median": pct(ms, 0.5), "p99": pct(ms, 0.99)}


def encoder_delta(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("graph_hits", "uniform_hits", "eager_batches", "batches",
                                                          "pieces", "cache_hits", "cache_misses", "real_tokens",
                                                          "padded_tokens", "idle_captures", "idle_capture_ms")}
    reasons = after.get("eager_reasons", {})
    d["eager_reasons"] = {r: n - before.get("eager_reasons", {}).get(r, 0) for r, n in reasons.items()}
    tokens = after.get("batch_tokens", 0) - before.get("batch_tokens", 0)
    budget = after.get("batch_budget_tokens", 0) - before.get("batch_budget_tokens", 0)
    d["mean_batch_fill"] = tokens / budget if budget else float("nan")
    d["items_per_batch"] = d["pieces"] / d["batches"] if d["batches"] else float("nan")
    return d


def _body_bytes(workload: Workload, i: int) -> bytes:
    return json.dumps(workload.body(i)).encode()


def map_in_processes(fn, items: range) -> list:
    """`[fn(x) for x in items]`, in a pool of up to 16 processes from 256 items on (spawned: the caller
    may hold Ray's threads, or start Ray later). `fn` must be picklable: a module-level function or a
    functools.partial of one."""
    if len(items) < 256:
        return [fn(x) for x in items]
    with ProcessPoolExecutor(min(16, os.cpu_count() or 1), mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(fn, items, chunksize=64))


def build_bodies(workload: Workload, first: int, n: int) -> list[bytes]:
    """Request bodies for media seeds first .. first + n - 1, built before the clock starts. A 1024² JPEG
    takes about 20 ms to make and encode, so thousands are built in a pool of processes."""
    return map_in_processes(functools.partial(_body_bytes, workload), range(first, first + n))


def _session(url: str, concurrency: int | None, timeout_s: float) -> aiohttp.ClientSession:
    """The load's HTTP client (one per load process). Under a request rate (no `concurrency`) the pool is
    unbounded: a cap of 64 connections queued requests in the client once rate x latency passed it, and
    that wait counted as the server's TTFT (a 0.5 s fake server offered 200 req/s served 114.9)."""
    conn = aiohttp.TCPConnector(limit=max(64, 2 * concurrency) if concurrency else 0)
    # per phase, as httpx's timeout was: a request may queue for a connection at high concurrency
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
    return aiohttp.ClientSession(base_url=url, connector=conn, timeout=timeout)


async def send_timed(client: aiohttp.ClientSession, items: list[tuple[int, bytes]], tag: str,
                     concurrency: int | None, request_rate: float | None, rng: random.Random, t0: float,
                     bar=None) -> list[Result]:
    """The timed part's loop, the same in run_load's own process and in each load process: send the
    (global index, body) `items` at most `concurrency` at a time, or with Poisson gaps at `request_rate`,
    each tagged `{tag}-{index}` (x-request-id) and stamped with when it was sent, from `t0`
    (time.perf_counter(), which is CLOCK_MONOTONIC on Linux and so shared by the processes)."""
    sem = asyncio.Semaphore(concurrency or len(items))

    async def task(i: int, b: bytes) -> Result:
        async with sem:
            start = time.perf_counter() - t0
            r = await one_request(client, b, f"{tag}-{i}")
            r.start_s = start
        if bar is not None:
            bar.update(1)
        return r

    tasks = []
    for i, b in items:
        tasks.append(asyncio.create_task(task(i, b)))
        if request_rate:
            await asyncio.sleep(rng.expovariate(request_rate))
    return list(await asyncio.gather(*tasks))


READY_TIMEOUT_S = 300.0  # for a load process to start, import this module and take its bodies


def _load_worker(k: int, url: str, items: list[tuple[int, bytes]], tag: str, concurrency: int | None,
                 request_rate: float | None, timeout_s: float, go, t0, out) -> None:
    """One load process of run_load(processes=N) (spawned): its own event loop and aiohttp session.
    It says it is ready, waits for the main process to set `go` (after `t0` holds the start time),
    sends its share and puts its Results on `out`; a failure goes on `out` too, so nobody waits."""
    async def load() -> list[Result]:
        async with _session(url, concurrency, timeout_s) as client:
            out.put((k, "ready", None))
            # Blocking the loop is harmless here: nothing else runs in this process yet.
            if not go.wait(2 * READY_TIMEOUT_S):
                raise TimeoutError("the main process never started the run")
            return await send_timed(client, items, tag, concurrency, request_rate, random.Random(k), t0.value)

    try:
        out.put((k, "results", asyncio.run(load())))
    except BaseException as e:
        out.put((k, "error", f"{type(e).__name__}: {e}"))


def _from_each(out, procs: list, kind: str, timeout_s: float | None) -> dict[int, object]:
    """One `kind` message from every load process. The queue is polled rather than waited on: a
    process that died (killed for memory, a crash) never answers, and a bare get() would hang."""
    got: dict[int, object] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    exited: set[int] = set()
    while len(got) < len(procs):
        try:
            k, what, payload = out.get(timeout=1.0)
        except queue.Empty:
            # An exited process's last message may still be in the pipe: give it one more poll.
            dead = {k for k, p in enumerate(procs) if k not in got and p.exitcode is not None}
            if dead & exited:
                codes = ", ".join(f"{k} (exit code {procs[k].exitcode})" for k in sorted(dead & exited))
                raise RuntimeError(f"load process {codes} died before sending its {kind}") from None
            exited |= dead
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(got))
                raise TimeoutError(f"load processes {missing} sent no {kind} within {timeout_s:.0f} s") from None
            continue
        if what == "error":
            raise RuntimeError(f"load process {k} failed: {payload}")
        got[k] = payload
    return got


def split_load(n: int, concurrency: int | None, processes: int) -> tuple[list, list[list[int]]]:
    """(each process's concurrency, or None for a rate; each process's body indices): c // N, +1 for the
    first c % N, and the bodies dealt in proportion to it (equally for a rate)."""
    shares = [None] * processes if concurrency is None else \
        [concurrency // processes + (1 if k < concurrency % processes else 0) for k in range(processes)]
    owner = [k for k, c in enumerate(shares) for _ in range(c or 1)]  # body i goes to owner[i % len(owner)]
    return shares, [[i for i in range(n) if owner[i % len(owner)] == k] for k in range(processes)]


def _load_in_processes(url: str, bodies: list[bytes], tag: str, concurrency: int | None,
                       request_rate: float | None, processes: int, timeout_s: float, start_clock) -> list[Result]:
    """Send `bodies` from `processes` spawned load processes (the caller may hold Ray's threads: never
    fork). Process k gets c // N (+1 for the first c % N) of the concurrency and a share of the bodies
    in proportion to it (an equal share would leave the processes with less concurrency sending the
    run's end alone), or rate/N of a Poisson rate and an equal share (independent Poisson streams add
    up to the whole rate). Each body keeps its index i in its tag. The clock starts (`start_clock()`:
    the monitor, then t0) once every process is ready, so their start-up is not measured. Results in
    body order."""
    ctx = multiprocessing.get_context("spawn")
    out, go, t0 = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    shares, indices = split_load(len(bodies), concurrency, processes)
    procs = []
    for k in range(processes):
        rate = request_rate / processes if request_rate else None
        items = [(i, bodies[i]) for i in indices[k]]
        procs.append(ctx.Process(target=_load_worker, args=(k, url, items, tag, shares[k], rate, timeout_s, go, t0,
                                                            out), name=f"load-{k}", daemon=True))
    try:
        for p in procs:
            p.start()
        _from_each(out, procs, "ready", READY_TIMEOUT_S)
        t0.value = start_clock()
        go.set()
        got = _from_each(out, procs, "results", None)  # each request is bounded by the client's timeouts
        for p in procs:
            p.join(timeout=10)
    finally:  # after a failure the others are stopped, not waited for
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
                p.join()
    results: list = [None] * len(bodies)
    for k, rs in got.items():
        for i, r in zip(indices[k], rs, strict=True):
            results[i] = r
    return results


async def run_load(url: str, workload: Workload, num_requests: int, concurrency: int | None = None,
                   request_rate: float | None = None, warmup: int = 2, progress: bool = True,
                   timeout_s: float = 600, seed_offset: int = 0, monitor_t0: float | None = None,
                   monitor: bool = False, processes: int = 1) -> Report:
    """Warm up, then send `num_requests` at a fixed concurrency or a Poisson request rate. Media seeds
    start at `seed_offset`: give every run its own range, or later runs hit the embedding cache.
    With `monitor`, GPUs and processes are sampled over the timed part (timeline from `monitor_t0`).
    With `processes` > 1 the timed requests are sent from that many spawned processes (one asyncio
    process tops out at a few hundred streamed req/s), splitting the concurrency (at least one each)
    and the rate between them; warm-up and the encoder stats stay here, and there is no progress bar
    (the requests complete in other processes)."""
    if processes < 1 or (processes > 1 and concurrency is not None and concurrency < processes):
        raise ValueError(f"processes={processes} needs 1 <= processes <= concurrency ({concurrency})")
    bodies = build_bodies(workload, seed_offset, num_requests + warmup)
    timed = bodies[warmup:]
    tag = re.sub(r"\W+", "_", workload.label) + f"-c{concurrency or 'r'}-{seed_offset}"
    async with _session(url, concurrency, timeout_s) as client:
        async def encoder_stats() -> dict:
            async with client.get("/v1/encoder/stats") as resp:
                return await resp.json()

        for b in bodies[:warmup]:
            await one_request(client, b)
        before = await encoder_stats()
        bar = None
        if progress and processes == 1:
            from tqdm import tqdm

            bar = tqdm(total=num_requests, desc=f"{workload.kind} c={concurrency} r={request_rate}", file=sys.stderr)
        mon = None

        def start_clock() -> float:
            nonlocal mon
            if monitor:
                from benchmarks.monitor import Monitor

                mon = Monitor(t0=monitor_t0).__enter__()
            return time.perf_counter()

        try:
            if processes == 1:
                t0 = start_clock()
                results = await send_timed(client, list(enumerate(timed)), tag, concurrency, request_rate,
                                           random.Random(0), t0, bar)
                duration = time.perf_counter() - t0
            else:
                results = await asyncio.to_thread(_load_in_processes, url, timed, tag, concurrency, request_rate,
                                                  processes, timeout_s, start_clock)
                # From the shared t0 to the last completion: this process's own clock would also count
                # the hand-back of the results and the processes' exit, which are not load.
                duration = max([r.start_s + r.e2e_s for r in results] + [1e-9])
        finally:
            if mon is not None:
                mon.__exit__(None, None, None)
        after = await encoder_stats()
        if bar is not None:
            bar.close()
    ok = [r for r in results if r.ok]
    return Report(
        workload=workload.label, concurrency=concurrency, request_rate=request_rate, successful=len(ok),
        failed=len(results) - len(ok), duration_s=duration, request_throughput=len(ok) / duration,
        input_token_throughput=sum(r.prompt_tokens for r in ok) / duration,
        output_token_throughput=sum(r.completion_tokens for r in ok) / duration,
        ttft_ms=summarize([r.ttft_s for r in ok]), e2e_ms=summarize([r.e2e_s for r in ok]),
        encoder=encoder_delta(before, after), errors=sorted({r.error for r in results if not r.ok})[:5],
        slowest=[{"sent_s": round(r.start_s, 3), "ttft_ms": round(1e3 * r.ttft_s, 1)}
                 for r in sorted(ok, key=lambda r: -r.ttft_s)[:8]],
        resources=asdict(mon.summary()) if mon is not None else {},
        steady_request_throughput=steady_rate([r.start_s + r.e2e_s for r in ok]), load_processes=processes)


def print_repeats(reports: list[Report]) -> None:
    """One line for a point measured several times: medians, and the range of the throughput."""
    rates = [r.request_throughput for r in reports]
    steady = [r.steady_request_throughput for r in reports]
    ttft = [r.ttft_ms["median"] for r in reports]
    print(f"=== {reports[0].workload}, concurrency {reports[0].concurrency}, {len(reports)} runs: "
          f"req/s median {statistics.median(rates):.2f} (min {min(rates):.2f}, max {max(rates):.2f}); "
          f"steady median {statistics.median(steady):.2f}; TTFT p50 median {statistics.median(ttft):.1f} ms")


def print_report(r: Report, label: str = "") -> None:
    procs = f", {r.load_processes} load processes" if r.load_processes > 1 else ""
    print(f"--- {label} {r.workload}, concurrency {r.concurrency}, rate {r.request_rate}{procs} ---")
    print(f"successful {r.successful}, failed {r.failed}, duration {r.duration_s:.2f} s")
    print(f"request throughput {r.request_throughput:.2f} req/s; input {r.input_token_throughput:.0f} tok/s; "
          f"output {r.output_token_throughput:.0f} tok/s; steady {r.steady_request_throughput:.2f} req/s "
          "(10th to 90th percentile completion)")
    print("TTFT ms: mean {mean:.1f} median {median:.1f} p99 {p99:.1f}".format(**r.ttft_ms))
    print("E2E  ms: mean {mean:.1f} median {median:.1f} p99 {p99:.1f}".format(**r.e2e_ms))
    e = r.encoder
    print(f"encoder: graph hits {e['graph_hits']}, eager {e['eager_batches']} {e['eager_reasons']}, batches "
          f"{e['batches']} ({e['items_per_batch']:.2f} items each), mean batch fill {e['mean_batch_fill']:.2f}, "
          f"cache hits {e['cache_hits']}, uniform-graph hits {e.get('uniform_hits', 0)}, captured while serving "
          f"{e.get('idle_captures', 0)} ({e.get('idle_capture_ms', 0):.0f} ms)")
    print("slowest TTFTs (sent at s: ms):", ", ".join(f"{s['sent_s']:.2f}: {s['ttft_ms']:.0f}" for s in r.slowest))
    for err in r.errors:
        print("error:", err)
    if r.resources:
        from benchmarks.monitor import MonitorSummary, print_summary

        print_summary(MonitorSummary(**r.resources))


# ---------------------------------------------------------------------------- --compare
GRAPHS_OFF = '{"encoder": {"cuda_graphs": false}}'  # what --compare's second side changes by default


def deep_merge(base: dict, change: dict) -> dict:
    out = dict(base)
    for k, v in change.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def init_ray(num_gpus: int | None = None) -> None:
    """Start Ray here as start_app does (once): `num_gpus` limits it, and CUDA_VISIBLE_DEVICES, to the first N."""
    import os

    import ray

    from deployments.ray_env import apply_serve_env

    apply_serve_env()  # as `make serve` starts Ray (RAY_SERVE_THROUGHPUT_OPTIMIZED=0 in the environment: off)
    if num_gpus is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(num_gpus))
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, num_gpus=num_gpus)


def file_config(conf: dict, args: dict, port: int, deployments: dict[str, dict] | None = None) -> dict:
    """A config file's contents as start_app deploys them: Serve's proxy on 127.0.0.1:`port`, the first
    application's args deep-merged with `args`, each listed deployment's options with `deployments`' entry
    of its name (an entry for a deployment the file does not list is added)."""
    conf = {**conf, "http_options": {**conf.get("http_options", {}), "host": "127.0.0.1", "port": port},
            "applications": [dict(a) for a in conf["applications"]]}
    app = conf["applications"][0]
    app["args"] = deep_merge(app.get("args") or {}, args)
    listed = {d["name"]: d for d in app.get("deployments", [])}
    extra = deployments or {}
    app["deployments"] = [deep_merge(d, extra.get(d["name"], {})) for d in listed.values()] + \
        [{"name": n, **o} for n, o in extra.items() if n not in listed]
    return conf


def start_app(args: dict, port: int, serve_config: str | None = None, num_gpus: int | None = None,
              wait: bool = True, deployments: dict[str, dict] | None = None) -> None:
    """Start Ray and the application on this machine. With `serve_config`, deploy that file as
    `serve run FILE` does (its `deployments:` options apply, each deep-merged with `deployments`' entry
    of its name), its args deep-merged with `args`; otherwise build from Python with `args`. `num_gpus`
    limits Ray (and CUDA_VISIBLE_DEVICES) to the first N GPUs. `wait=False` returns once the deployment
    is submitted, before the application runs (benchmarks/goodput.py's cold start polls the HTTP
    endpoints instead)."""
    from ray import serve

    init_ray(num_gpus)
    if serve_config:
        import yaml
        from ray.serve._private import api as serve_api
        from ray.serve.schema import ServeDeploySchema

        conf = file_config(yaml.safe_load(Path(serve_config).read_text()), args, port, deployments)
        client = serve_api.serve_start(http_options=conf["http_options"])
        client.deploy_apps(ServeDeploySchema.model_validate(conf), _blocking=False)
        if wait:
            wait_running(conf["applications"][0]["name"])
            if conf["applications"][0]["args"].get("router_http_port"):
                wait_listening(conf["applications"][0]["args"]["router_http_port"])
        return
    from ray.serve.api import _run

    from deployments.app import build_app

    if deployments:
        raise ValueError("deployment options need a config file (serve_config)")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    _run(build_app(args), _blocking=wait, name="vlm", route_prefix="/")  # serve.run is _run(_blocking=True)
    if wait and args.get("router_http_port"):
        wait_listening(args["router_http_port"])


def wait_listening(port: int, host: str = "127.0.0.1", timeout_s: float = 180.0) -> None:
    """Until something accepts connections on (host, port): the Routers' own port (router_http_port)
    opens after the app's other deployments serve and a Router has warmed itself (deployments/router.py),
    a little after the application reads RUNNING."""
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s") from None
            time.sleep(0.2)


def config_file(a) -> tuple[dict, dict]:
    """--serve-config's contents and its first application's args (both {} without one)."""
    import yaml

    conf = yaml.safe_load(Path(a.serve_config).read_text()) if a.serve_config else {}
    return conf, (conf["applications"][0].get("args") or {}) if conf else {}


def entry_points(a, app_args: dict) -> tuple[int, str]:
    """With --start: (Ray Serve's proxy port, the URL the load goes to). The Routers' own port
    (router_http_port, from the config file's args or --router-port) takes the load unless --via proxy."""
    conf, file_args = config_file(a)
    proxy_port = a.port or conf.get("http_options", {}).get("port", 8000)
    router_port = deep_merge(file_args, app_args).get("router_http_port")
    if router_port == proxy_port:
        raise SystemExit(f"the Routers' port and Ray Serve's proxy port are both {proxy_port}")
    via = a.via if a.via != "auto" else ("port" if router_port else "proxy")
    if via == "port" and not router_port:
        raise SystemExit("--via port needs router_http_port (in the config file's args, or --router-port)")
    return proxy_port, f"http://127.0.0.1:{router_port if via == 'port' else proxy_port}"


def wait_running(name: str, timeout_s: float = 480.0) -> None:
    """Poll until the application runs. Ray's own blocking deploy gives up after 60 s, less than a
    real-shaped model needs on a fresh machine (checkpoint build, weights, graph capture)."""
    from ray import serve

    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        app = serve.status().applications.get(name)
        status = str(app.status) if app else "NOT_STARTED"
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED"):
            raise RuntimeError(f"application {name} failed to deploy: {app.message}")
        time.sleep(1.0)
    raise TimeoutError(f"application {name} not running after {timeout_s:.0f} s")


def stop_app() -> None:
    from ray import serve

    serve.delete("vlm")


# ---------------------------------------------------------------------------- --sweep
def concurrency_ladder(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... up to max_concurrency (included)."""
    out, c = [], 1
    while c < max_concurrency:
        out.append(c)
        c *= 2
    return out + [max_concurrency]


def plateaued(throughputs: list[float], min_gain: float = 0.05, patience: int = 2) -> bool:
    """True once each of the last `patience` points gained less than `min_gain` over the best before it."""
    if len(throughputs) <= patience:
        return False
    for i in range(len(throughputs) - patience, len(throughputs)):
        if throughputs[i] >= (1 + min_gain) * max(throughputs[:i]):
            return False
    return True


def sweep_workload(url: str, wl: Workload, a, seed_offset: int, t0: float) -> list[Report]:
    """Concurrency ladder for one workload until throughput stops growing."""
    reports: list[Report] = []
    for i, c in enumerate(concurrency_ladder(a.max_concurrency)):
        n = max(a.num_requests, a.rounds * c)
        r = asyncio.run(run_load(url, wl, n, c, None, a.warmup, not a.no_progress, seed_offset=seed_offset + 100_000 * i,
                                 monitor_t0=t0, monitor=not a.no_monitor, processes=min(a.load_processes, c)))
        print_report(r, "sweep")
        reports.append(r)
        if plateaued([x.request_throughput for x in reports], a.min_gain, a.patience):
            print(f"throughput stopped growing at concurrency {c} (< {100 * a.min_gain:.0f}% gain {a.patience} times)")
            break
    return reports


def sweep_table(results: dict[str, list[dict]]) -> str:
    lines = ["| workload | concurrency | req/s | TTFT p50 ms | TTFT p99 ms | GPU busy % | busiest processes (cores, "
             "busiest thread) | bottleneck |", "|---|---|---|---|---|---|---|---|"]
    for wl, rs in results.items():
        for r in rs:
            res = r.get("resources") or {}
            gpus = " / ".join(f"{u:.0f}" for u in res.get("gpu_mean", [])) or "-"
            groups = sorted((res.get("groups") or {}).items(), key=lambda kv: -kv[1]["cores"])[:3]
            procs = "; ".join(f"{g} {v['cores']:.2f} ({v['busiest_thread']:.2f})" for g, v in groups) or "-"
            lines.append(f"| {wl} | {r['concurrency']} | {r['request_throughput']:.2f} | {r['ttft_ms']['median']:.1f} | "
                         f"{r['ttft_ms']['p99']:.1f} | {gpus} | {procs} | {'; '.join(res.get('verdict', [])) or '-'} |")
    return "\n".join(lines)


def plot_sweep(results: dict[str, list[dict]], out_dir: Path) -> list[Path]:
    """Throughput against concurrency, and every GPU's utilisation against time over the sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for wl, rs in results.items():
        ax.plot([r["concurrency"] for r in rs], [r["request_throughput"] for r in rs], "o-", label=wl)
    ax.set(xscale="log", xlabel="concurrency", ylabel="requests/s", title="throughput against concurrency")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out_dir / "sweep_throughput.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 4.5))
    gpus: dict[int, list[tuple[float, float]]] = {}
    for wl, rs in results.items():
        for r in rs:
            res = r.get("resources") or {}
            timeline = res.get("gpu_timeline") or []
            for t, utils in timeline:
                for idx, u in zip(res.get("gpu_indices", []), utils):
                    gpus.setdefault(idx, []).append((t, u))
            if timeline:
                ax.axvline(timeline[0][0], color="0.85", lw=0.8)
                ax.text(timeline[0][0], 101, f"{wl[:5]} c{r['concurrency']}", fontsize=6, rotation=90, va="bottom")
    for idx, pts in sorted(gpus.items()):
        ax.plot([t for t, _ in pts], [u for _, u in pts], lw=1, label=f"GPU {idx}")
    ax.set(xlabel="seconds", ylabel="GPU busy %", ylim=(0, 115), title="GPU utilisation over the sweep")
    if gpus:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no GPU sampled", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    paths.append(out_dir / "sweep_gpu_util.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for rs in results.values() for r in rs})
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 4 * len(workloads)), squeeze=False)
    for row, wl in enumerate(workloads):
        for mode, rs in results.items():
            rs = sorted((r for r in rs if r["workload"] == wl), key=lambda r: r["concurrency"])
            c = [r["concurrency"] for r in rs]
            axes[row][0].plot(c, [r["ttft_ms"]["median"] for r in rs], "o-", label=f"{mode} TTFT p50")
            axes[row][0].plot(c, [r["ttft_ms"]["p99"] for r in rs], "o--", label=f"{mode} TTFT p99")
            axes[row][0].plot(c, [r["e2e_ms"]["p99"] for r in rs], "x:", label=f"{mode} E2E p99")
            axes[row][1].plot(c, [r["request_throughput"] for r in rs], "o-", label=mode)
        axes[row][0].set(title=f"{wl}: latency", xlabel="concurrency", ylabel="ms", xscale="log")
        axes[row][1].set(title=f"{wl}: throughput", xlabel="concurrency", ylabel="requests/s", xscale="log")
        axes[row][0].legend(fontsize=7)
        axes[row][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def workload_from_spec(spec: str, a) -> Workload:
    """`image`, `image@1024`, `video`, `mixed` with the command line's sizes."""
    kind, _, size = spec.partition("@")
    if kind not in ("image", "video", "mixed"):
        raise SystemExit(f"unknown workload {spec!r}: image, image@<size>, video, mixed")
    return Workload(kind, int(size) if size and kind == "image" else a.image_size, a.video_size, a.video_frames,
                    a.video_fps, a.prompt_words, a.output_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--workload", nargs="+", default=["image"], help="image, image@<size>, video, mixed")
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--video-size", type=int, default=224)
    p.add_argument("--video-frames", type=int, default=8)
    p.add_argument("--video-fps", type=int, default=2, help="with the server's 2 fps sampling, all frames are kept")
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32, help="per point (--sweep: at least --rounds x concurrency)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8])
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals instead of fixed concurrency")
    p.add_argument("--sweep", action="store_true", help="concurrency 1, 2, 4, ... until throughput stops growing")
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4, help="--sweep: requests per point >= rounds x concurrency")
    p.add_argument("--min-gain", type=float, default=0.05, help="--sweep: a point must beat the best by this much")
    p.add_argument("--patience", type=int, default=2, help="--sweep: stop after this many points without gain")
    p.add_argument("--no-monitor", action="store_true", help="do not sample GPUs and processes")
    p.add_argument("--load-processes", type=int, default=1,
                   help="send each point's timed requests from this many processes (the concurrency split between "
                        "them; a point of lower concurrency uses one process per request): raise it when the "
                        "monitor shows the load generator's busiest thread near one core, as one process is at "
                        "several hundred streamed req/s")
    p.add_argument("--start", action="store_true", help="start Ray and the application here, then measure it")
    p.add_argument("--serve-config", default=None, help="with --start: deploy this file as `serve run FILE` does")
    p.add_argument("--num-gpus", type=int, default=None, help="with --start: give Ray the first N GPUs only")
    p.add_argument("--placement", default=None, choices=["auto", "colocate", "fused", "split"], help="args.placement.policy")
    p.add_argument("--encoder-gpus", type=int, default=None, help="split: GPUs for the encoder")
    p.add_argument("--llm-gpus", type=int, default=None, help="split: GPUs for the LLM")
    p.add_argument("--llm-replicas", type=int, default=None, help="LLM replicas (several may share a GPU)")
    p.add_argument("--compare", action="store_true", help="start the app with graphs on, then off; same workload")
    p.add_argument("--compare-to", default=GRAPHS_OFF,
                   help="with --compare: JSON of encoder/llm settings the second side changes (default: graphs off)")
    p.add_argument("--model", default=None, help="with --start/--compare (default: the config file's, else embedded:tiny)")
    p.add_argument("--app-args", default="{}", help="with --start/--compare: JSON deep-merged into the application args")
    p.add_argument("--port", type=int, default=None,
                   help="with --start: Ray Serve's proxy port (default: the config file's http_options.port, else 8000)")
    p.add_argument("--router-port", type=int, default=None,
                   help="with --start: Routers also serve HTTP on this shared port (router_http_port)")
    p.add_argument("--via", choices=("auto", "proxy", "port"), default="auto",
                   help="with --start: send the load through Ray Serve's proxy or to the Routers' own port "
                        "(auto: the Routers' port when router_http_port is set, as the GPU presets set it)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each fixed point this many times in a row on the same server (new media each "
                        "time) and print the median and range: runs of one server spread by 20%% (RESULTS.md)")
    p.add_argument("--out-dir", default="benchmarks/serve_results")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args()

    app_args = json.loads(a.app_args)
    if a.model or not a.serve_config:
        app_args["model"] = a.model or "embedded:tiny"
    placement = {k: v for k, v in (("policy", a.placement), ("encoder_gpus", a.encoder_gpus),
                                   ("llm_gpus", a.llm_gpus), ("llm_replicas", a.llm_replicas)) if v is not None}
    if placement:
        app_args = deep_merge(app_args, {"placement": placement})
    workloads = [workload_from_spec(w, a) for w in a.workload]

    def fixed(url: str, label: str) -> list[dict]:
        out = []
        for wl in workloads:
            for c in a.concurrency:
                point = []
                for _ in range(a.repeat):
                    offset = 100_000 * len(out)  # the same ranges on both sides of --compare
                    r = asyncio.run(run_load(url, wl, a.num_requests, None if a.request_rate else c, a.request_rate,
                                             a.warmup, not a.no_progress, seed_offset=offset, monitor=not a.no_monitor,
                                             processes=a.load_processes if a.request_rate else min(a.load_processes, c)))
                    print_report(r, label)
                    out.append(asdict(r))
                    point.append(r)
                if a.repeat > 1:
                    print_repeats(point)
        return out

    if a.router_port:  # the Routers' own shared port (app/api/shared_port.py)
        app_args = deep_merge(app_args, {"router_http_port": a.router_port, "router_http_host": "127.0.0.1"})
    proxy_port, entry_url = entry_points(a, app_args)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.compare:
        base = app_args
        results = {}
        other = json.loads(a.compare_to)
        second = "graphs off" if other == json.loads(GRAPHS_OFF) else f"with {a.compare_to}"
        for mode, change in (("graphs on", {}), (second, other)):
            start_app(deep_merge(base, change), proxy_port, a.serve_config, a.num_gpus)
            results[mode] = fixed(entry_url, mode)
            stop_app()
        print("\n| workload | concurrency | TTFT p50 on / off ms | TTFT p99 on / off ms | p99 ratio (off/on) "
              "| req/s on / off |")
        print("|---|---|---|---|---|---|")
        for on, off in zip(results["graphs on"], results[second]):
            print(f"| {on['workload']} | {on['concurrency']} | {on['ttft_ms']['median']:.1f} / "
                  f"{off['ttft_ms']['median']:.1f} | {on['ttft_ms']['p99']:.1f} / {off['ttft_ms']['p99']:.1f} | "
                  f"{off['ttft_ms']['p99'] / on['ttft_ms']['p99']:.2f}x | {on['request_throughput']:.2f} / "
                  f"{off['request_throughput']:.2f} |")
        plot(results, out_dir / "serve_compare.png")
        (out_dir / "serve_results.json").write_text(json.dumps(results, indent=1))
        print(f"wrote {out_dir / 'serve_results.json'}")
        return

    url = a.url
    if a.start:
        t = time.perf_counter()
        start_app(app_args, proxy_port, a.serve_config, a.num_gpus)
        url = entry_url
        print(f"application ready in {time.perf_counter() - t:.1f} s; load to {url}")
    if not a.sweep:
        results = {"server": fixed(url, "")}
        (out_dir / "serve_results.json").write_text(json.dumps(results, indent=1))
        print(f"wrote {out_dir / 'serve_results.json'}")
        return
    t0 = time.perf_counter()
    results = {}
    meta = {"app_args": app_args, "serve_config": a.serve_config, "num_gpus": a.num_gpus, "url": url}
    for i, wl in enumerate(workloads):
        results[wl.label] = [asdict(r) for r in sweep_workload(url, wl, a, 10_000_000 * (i + 1), t0)]
        # written after every workload: a run cut short by a time limit keeps what it measured
        (out_dir / "sweep_results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print("\n" + sweep_table(results))
    paths = plot_sweep(results, out_dir)
    print(f"wrote {out_dir / 'sweep_results.json'}, " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
