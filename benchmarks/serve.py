"""Load generator for the OpenAI endpoint: TTFT, latency, throughput and encoder behaviour.

Against a running server:
    python benchmarks/serve.py --url http://127.0.0.1:8000 --workload image --image-size 448 \
        --concurrency 8 --num-requests 64

Graphs on vs off, side by side (starts the application itself, twice):
    python benchmarks/serve.py --compare --model embedded:qwen3-vl-2b --workload image video \
        --concurrency 1 8 32 --num-requests 96 --out-dir benchmarks/serve_results

Every request carries distinct random media (seeded by its index), so the embedding cache does
not flatter the numbers; the same seeds are used for both sides of --compare. Requests stream,
with `ignore_eos` so each generates exactly --output-tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.media.synthetic import image_bytes, mp4_bytes  # noqa: E402
from benchmarks.stats import pct  # noqa: E402


@dataclass
class Workload:
    kind: str  # image | video | mixed
    image_size: int = 448
    video_size: int = 224
    video_frames: int = 8
    video_fps: int = 2  # of the generated mp4; at the server's 2 fps sampling every frame is kept
    prompt_words: int = 32
    output_tokens: int = 32

    def body(self, i: int) -> dict:
        kind = self.kind if self.kind != "mixed" else ("image" if i % 2 == 0 else "video")
        if kind == "image":
            part = {"type": "image_url", "image_url": {
                "url": "data:image/jpeg;base64," + base64.b64encode(
                    image_bytes(self.image_size, self.image_size, i, "JPEG")).decode()}}
        else:
            part = {"type": "video_url", "video_url": {
                "url": "data:video/mp4;base64," + base64.b64encode(
                    mp4_bytes(self.video_frames, self.video_size, self.video_size, self.video_fps, i)).decode()}}
        text = " ".join(random.Random(i).choice(["describe", "the", "scene", "colors", "objects", "now"])
                        for _ in range(self.prompt_words))
        return {"model": "bench", "messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}],
                "max_tokens": self.output_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
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


async def one_request(client: httpx.AsyncClient, body: dict) -> Result:
    t0 = time.perf_counter()
    ttft, usage = None, {}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return Result(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return Result(False, error=obj["error"]["message"])
                if ttft is None:  # the server streams its first event once the first token exists
                    ttft = time.perf_counter() - t0
                usage = obj.get("usage") or usage
    except httpx.HTTPError as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - t0
    return Result(True, ttft if ttft is not None else e2e, e2e, usage.get("prompt_tokens", 0),
                  usage.get("completion_tokens", 0))


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


async def run_load(url: str, workload: Workload, num_requests: int, concurrency: int | None = None,
                   request_rate: float | None = None, warmup: int = 2, progress: bool = True,
                   timeout_s: float = 600, seed_offset: int = 0) -> Report:
    """Warm up, then send `num_requests` at a fixed concurrency or a Poisson request rate. Media seeds
    start at `seed_offset`: give every run its own range, or later runs hit the embedding cache."""
    bodies = [workload.body(seed_offset + i) for i in range(num_requests + warmup)]
    limits = httpx.Limits(max_connections=max(64, (concurrency or 0) * 2))
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        for b in bodies[:warmup]:
            await one_request(client, b)
        before = (await client.get("/v1/encoder/stats")).json()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=num_requests, desc=f"{workload.kind} c={concurrency} r={request_rate}", file=sys.stderr)
        sem = asyncio.Semaphore(concurrency or num_requests)

        async def task(b):
            async with sem:
                start = time.perf_counter() - t0
                r = await one_request(client, b)
                r.start_s = start
            if bar is not None:
                bar.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        rng = random.Random(0)
        for b in bodies[warmup:]:
            tasks.append(asyncio.create_task(task(b)))
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after = (await client.get("/v1/encoder/stats")).json()
        if bar is not None:
            bar.close()
    ok = [r for r in results if r.ok]
    return Report(
        workload=workload.kind, concurrency=concurrency, request_rate=request_rate, successful=len(ok),
        failed=len(results) - len(ok), duration_s=duration, request_throughput=len(ok) / duration,
        input_token_throughput=sum(r.prompt_tokens for r in ok) / duration,
        output_token_throughput=sum(r.completion_tokens for r in ok) / duration,
        ttft_ms=summarize([r.ttft_s for r in ok]), e2e_ms=summarize([r.e2e_s for r in ok]),
        encoder=encoder_delta(before, after), errors=sorted({r.error for r in results if not r.ok})[:5],
        slowest=[{"sent_s": round(r.start_s, 3), "ttft_ms": round(1e3 * r.ttft_s, 1)}
                 for r in sorted(ok, key=lambda r: -r.ttft_s)[:8]])


def print_report(r: Report, label: str = "") -> None:
    print(f"--- {label} {r.workload}, concurrency {r.concurrency}, rate {r.request_rate} ---")
    print(f"successful {r.successful}, failed {r.failed}, duration {r.duration_s:.2f} s")
    print(f"request throughput {r.request_throughput:.2f} req/s; input {r.input_token_throughput:.0f} tok/s; "
          f"output {r.output_token_throughput:.0f} tok/s")
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


# ---------------------------------------------------------------------------- --compare
GRAPHS_OFF = '{"encoder": {"cuda_graphs": false}}'  # what --compare's second side changes by default
def start_app(args: dict, port: int):
    import os

    import ray
    from ray import serve

    from deployments.app import build_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="vlm", route_prefix="/")


def stop_app() -> None:
    from ray import serve

    serve.delete("vlm")


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--workload", nargs="+", default=["image"], choices=["image", "video", "mixed"])
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--video-size", type=int, default=224)
    p.add_argument("--video-frames", type=int, default=8)
    p.add_argument("--video-fps", type=int, default=2, help="with the server's 2 fps sampling, all frames are kept")
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8])
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals instead of fixed concurrency")
    p.add_argument("--compare", action="store_true", help="start the app with graphs on, then off; same workload")
    p.add_argument("--compare-to", default=GRAPHS_OFF,
                   help="with --compare: JSON of encoder/llm settings the second side changes (default: graphs off)")
    p.add_argument("--model", default="embedded:tiny", help="with --compare")
    p.add_argument("--app-args", default="{}", help="with --compare: JSON merged into the application args")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out-dir", default="benchmarks/serve_results")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args()

    def workload(kind):
        return Workload(kind, a.image_size, a.video_size, a.video_frames, a.video_fps, a.prompt_words, a.output_tokens)

    def sweep(url: str, label: str) -> list[dict]:
        out = []
        for kind in a.workload:
            for c in a.concurrency:
                offset = 100_000 * len(out)  # the same ranges on both sides of --compare
                r = asyncio.run(run_load(url, workload(kind), a.num_requests, None if a.request_rate else c,
                                         a.request_rate, a.warmup, not a.no_progress, seed_offset=offset))
                print_report(r, label)
                out.append(asdict(r))
        return out

    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not a.compare:
        results = {"server": sweep(a.url, "")}
    else:
        base = {"model": a.model, **json.loads(a.app_args)}
        results = {}
        other = json.loads(a.compare_to)
        second = "graphs off" if other == json.loads(GRAPHS_OFF) else f"with {a.compare_to}"
        for mode, change in (("graphs on", {}), (second, other)):
            args = {**base, **{k: {**base.get(k, {}), **v} for k, v in change.items()}}
            start_app(args, a.port)
            results[mode] = sweep(f"http://127.0.0.1:{a.port}", mode)
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


if __name__ == "__main__":
    main()
