"""What one `fused` LLM replica can do without Ray: the GPU's ceiling for a serving workload.

Serving throughput is the least of what each stage can do. This script measures the stages that run on
the GPU, in one process, with the application's own classes and config file, and no Ray, HTTP or
Router in the way:

- `tower`: the vision tower alone (`EncoderService.encode_async`, cross-request batching as in the
  replica), `c` callers each encoding one request's items at a time;
- `llm`: the engine alone (`AsyncEngine`), fed embeddings already on the GPU;
- `fused`: both, as the replica runs them (`FusedBackend.chunks`).

If the tower takes `t` ms of GPU per request and the engine `l` ms, the fused replica cannot beat
1000 / (t + l) req/s on one GPU when they share its default stream (`encoder.stream: shared`, the
default); on streams of their own they may run side by side. Serving below the `fused` row here is
the host path's doing, above it is impossible. With `--profile` the fused run at the highest
concurrency is traced and its CUDA kernels are summed by kind (GEMM, attention, norms, copies ...).

Requests: `benchmarks/serve.py`'s `image` workload (a seeded random JPEG of --image-size, a 32-word prompt,
16 output tokens, ignore_eos), prepared once through the real media pipeline and prompt builder
before the clock starts (media preparation runs in other processes when serving). Distinct images:
each request gets its own cache key, so neither the embedding cache nor the prefix cache hits.

    python3 benchmarks/fused_load.py configs/qwen3-vl-2b-gpu.yaml --image-size 448 1024 --concurrency 1 32 128 \
        --requests 384 --profile --out $OUT/fused_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.api.chat import ChatService  # noqa: E402
from app.checkpoints.model_builder import resolve_model  # noqa: E402
from app.config import AppConfig  # noqa: E402
from app.llm.sequence import GenerationRequest  # noqa: E402
from app.media.pipeline import MediaPipeline  # noqa: E402
from app.media.spec import patch_spec_for  # noqa: E402
from app.serving.fused import FusedBackend  # noqa: E402
from benchmarks.serve import Workload, deep_merge  # noqa: E402
from benchmarks.stats import pct  # noqa: E402

KINDS = [  # (kind, substrings of the kernel name), first match wins
    # Attention first: FlashAttention's kernel names carry `cutlass::` template arguments. `_varlen_fwd`
    # is the tower's Triton attention (app/vision/attention.py).
    ("attention", ("attn", "attention", "fmha", "flash", "cudnn", "_varlen_fwd")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "splitkreduce")),
    ("norm", ("norm",)),
    ("rotary/rope", ("rotary", "rope")),
    ("copy", ("memcpy", "memset", "copy")),
    ("activation", ("silu", "gelu")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, subs in KINDS if any(s in low for s in subs)), "other elementwise")


def q(xs: list[float]) -> dict:
    return {"p50": round(pct(xs, 0.5), 2), "p99": round(pct(xs, 0.99), 2)} if xs else {}


async def prepare(cfg: AppConfig, ckpt: str, size: int, n: int) -> list[tuple[dict, list]]:
    """`n` distinct requests as the Router makes them: (generation dict, tower items)."""
    from transformers import AutoTokenizer

    chat = ChatService(cfg, AutoTokenizer.from_pretrained(ckpt),
                       MediaPipeline(cfg.media, patch_spec_for(ckpt)), backend=None)
    work = Workload("image", image_size=size)
    return [(await chat.prepare(work.body(i)))[1:] for i in range(n)]


def rekey(reqs: list, tag: str) -> list:
    """The same requests under new cache keys: no embedding-cache or prefix-cache hits across runs."""
    out = []
    for i, (gen, payload) in enumerate(reqs):
        gen = copy.copy(gen)
        gen["media_keys"] = [f"{k}-{tag}-{i}" for k in gen["media_keys"]]
        out.append((gen, [(rows, grid, f"{key}-{tag}-{i}") for rows, grid, key in payload]))
    return out


async def closed_loop(reqs: list, c: int, one) -> dict:
    """`c` clients; `one(req)` returns (ttft_s or None, latency_s, completion tokens)."""
    todo = list(reversed(reqs))
    ttft, lat, tokens = [], [], []

    async def client():
        while todo:
            t, total, n = await one(todo.pop())
            lat.append(1e3 * total)
            tokens.append(n)
            if t is not None:
                ttft.append(1e3 * t)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(c)))
    wall = time.perf_counter() - t0
    return {"concurrency": c, "requests": len(reqs), "req_s": round(len(reqs) / wall, 2),
            "ttft_ms": q(ttft), "latency_ms": q(lat), "completion_tokens": sum(tokens)}


def kernel_table(prof) -> list[dict]:
    by_kind: dict[str, float] = defaultdict(float)
    top = []
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
        if not us or evt.device_type.name != "CUDA":
            continue
        by_kind[kind_of(evt.key)] += us
        top.append((us, evt.key[:70], evt.count))
    total = sum(by_kind.values())
    rows = [{"kind": k, "ms": round(v / 1e3, 2), "share": round(v / total, 3)} for k, v in
            sorted(by_kind.items(), key=lambda kv: -kv[1])]
    rows += [{"kernel": name, "ms": round(us / 1e3, 2), "calls": n} for us, name, n in sorted(top, reverse=True)[:40]]
    return rows


async def run(a) -> dict:
    import torch

    conf = yaml.safe_load(Path(a.config).read_text())
    cfg = AppConfig(**deep_merge(conf["applications"][0]["args"], json.loads(a.app_args)))
    if a.gpu_memory_utilization is not None:
        cfg = cfg.model_copy(update={"llm": cfg.llm.model_copy(update={"gpu_memory_utilization": a.gpu_memory_utilization})})
    ckpt = resolve_model(cfg.model, cfg.cache_dir)
    backend = FusedBackend.build(cfg, ckpt)
    enc, streams = backend.encoder, backend.streams
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "config": a.config,
           "runs": []}

    async def tower_one(req):
        t0 = time.perf_counter()
        await enc.encode_async(req[1])
        return None, time.perf_counter() - t0, 0

    async def timed(chunks):
        t0, first, n = time.perf_counter(), None, 0
        async for chunk in chunks:
            first, n = first or time.perf_counter() - t0, chunk.completion_tokens
        return first, time.perf_counter() - t0, n

    async def llm_one(req):  # embeddings made before the clock: req[2]
        return await timed(streams.generate(GenerationRequest.from_router(req[0], req[2])))

    async def fused_one(req):
        return await timed(backend.chunks(req[0], req[1]))

    for size in a.image_size:
        distinct = await prepare(cfg, ckpt, size, a.distinct)
        await closed_loop(rekey(distinct, "warm")[:16], 8, fused_one)
        for c in a.concurrency:
            n = max(a.requests, 3 * c) if c > 1 else min(a.requests, 48)
            reqs = [distinct[i % len(distinct)] for i in range(n)]
            for stage, one in (("tower", tower_one), ("llm", llm_one), ("fused", fused_one)):
                if stage not in a.stages:
                    continue
                batch = [(g, p, i) for i, (g, p) in enumerate(rekey(reqs, f"{stage}{c}"))]
                if stage == "llm":  # embeddings on the GPU first, outside the clock
                    batch = [(g, p, await enc.encode_async(p)) for g, p, _ in batch]
                r = {"image": size, "stage": stage, **await closed_loop(batch, c, one)}
                del batch
                res["runs"].append(r)
                print(json.dumps(r), flush=True)
            if a.profile and c == max(a.concurrency) and torch.cuda.is_available():
                from torch.profiler import ProfilerActivity, profile

                sample = rekey(reqs[: min(len(reqs), 2 * c)], "profile")
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    t0 = time.perf_counter()
                    await closed_loop(sample, c, fused_one)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - t0
                table = kernel_table(prof)
                res.setdefault("profiles", []).append({"image": size, "concurrency": c, "requests": len(sample),
                                                       "wall_ms": round(1e3 * wall, 1), "kernels": table})
                print(json.dumps(res["profiles"][-1]), flush=True)
            Path(a.out).write_text(json.dumps(res, indent=1))
    streams.engine.shutdown()
    return res


def print_tables(res: dict) -> None:
    print("\n| image | stage | c | req/s | TTFT p50 ms | latency p50 ms | latency p99 ms |\n|---|---|---|---|---|---|---|")
    for r in res["runs"]:
        print(f"| {r['image']}^2 | {r['stage']} | {r['concurrency']} | {r['req_s']} | {r['ttft_ms'].get('p50', '-')} | "
              f"{r['latency_ms']['p50']} | {r['latency_ms']['p99']} |")
    for p in res.get("profiles", []):
        busy = sum(k["ms"] for k in p["kernels"] if "kind" in k)
        print(f"\n{p['image']}^2, c={p['concurrency']}, {p['requests']} requests: {busy:.0f} ms of kernels in "
              f"{p['wall_ms']:.0f} ms ({busy / p['requests']:.2f} ms per request)\n| kernels | ms | share |\n|---|---|---|")
        for k in p["kernels"]:
            print(f"| {k.get('kind') or k['kernel']} | {k['ms']} | {k.get('share', k.get('calls'))} |")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a serve config file; its application args are used")
    p.add_argument("--image-size", type=int, nargs="+", default=[448])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--distinct", type=int, default=32, help="distinct images prepared (reused under new cache keys)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--app-args", default="{}", help="JSON deep-merged into the config file's application args")
    p.add_argument("--stages", nargs="+", default=["tower", "llm", "fused"], choices=["tower", "llm", "fused"])
    p.add_argument("--profile", action="store_true", help="kernels of the fused run at the highest concurrency")
    p.add_argument("--out", default="benchmarks/fused_load.json")
    a = p.parse_args(argv)
    res = asyncio.run(run(a))
    print_tables(res)
    return res


if __name__ == "__main__":
    main()
