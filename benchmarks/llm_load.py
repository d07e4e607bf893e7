"""The LLM replica's share of serving, without Ray: is the engine what caps serving throughput?

Requests shaped like `benchmarks/serve.py`'s `image` workload (one 448^2 image = 196 vision rows with
their deepstack features, arriving as CPU tensors as the encoder's response does, a 32-word prompt,
16 output tokens with `ignore_eos`) go through `AsyncEngine` on an event loop, as in the LLM replica.
Closed loop: `c` clients, each sending its next request when the last one ends, as serve.py does.

Per concurrency it prints requests/s, TTFT and latency percentiles, and what the engine's steps were:
how many were decode-only (decode CUDA graphs) and how many mixed a prefill in (step graphs on CUDA), with their median wall
time, and the time spent building sequences on the event loop (`engine.submit`). Comparing req/s here
with serve.py's at the same concurrency says whether the engine or the path around it is the limit.

    python benchmarks/llm_load.py --concurrency 1 64 256 --requests 512 --out $OUT/llm_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.checkpoints.model_builder import build_tokenizer, load_preset  # noqa: E402
from app.llm.async_engine import AsyncEngine  # noqa: E402
from app.llm.engine import Engine  # noqa: E402
from app.llm.sampling import SamplingParams  # noqa: E402
from app.llm.sequence import GenerationRequest, VisionInput  # noqa: E402
from benchmarks.stats import pct  # noqa: E402


def q(xs: list[float]) -> dict:
    return {"p50": round(pct(xs, 0.5), 3), "p90": round(pct(xs, 0.9), 3), "p99": round(pct(xs, 0.99), 3)}

RNG = np.random.default_rng(0)


def image_request(engine: Engine, text: int, side: int, new: int, hidden: int, deepstack: int, i: int,
                  dtype: torch.dtype = torch.bfloat16) -> GenerationRequest:
    """A prompt of `text` random tokens around one image of side x side patches (merge 2)."""
    rows = (side // engine.rope.merge) ** 2
    before = RNG.integers(0, 150000, 8).tolist()
    after = RNG.integers(0, 150000, max(text - 8, 1)).tolist()
    ids = before + [engine.vision_ids[0]] * rows + after
    types = [0] * len(before) + [1] * rows + [0] * len(after)
    main = torch.randn(rows, hidden, dtype=dtype)
    ds = [torch.randn(rows, hidden, dtype=dtype) for _ in range(deepstack)]
    vision = [VisionInput((1, side, side), main, ds, key=f"img-{i}")]  # distinct: no prefix-cache hits
    return GenerationRequest(ids, types, vision, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))


async def closed_loop(engine: Engine, streams: AsyncEngine, reqs: list[GenerationRequest], c: int) -> dict:
    queue = list(reversed(reqs))
    ttft, latency, submit_ms, engine_ms, delivery_ms = [], [], [], [], []
    finished: dict[int, float] = {}  # seq id -> when the engine thread emitted its last token
    emit = engine.emit

    def timed_emit(outputs):
        now = time.perf_counter()
        for seq, delta in outputs:
            if delta.finish_reason:
                finished[seq.id] = now
        emit(outputs)

    engine.emit = timed_emit

    async def client():
        while queue:
            req = queue.pop()
            t0 = time.perf_counter()
            seen = {}

            def on_submit(seq, t0=t0, seen=seen):
                seen["seq"] = seq
                submit_ms.append(1e3 * (time.perf_counter() - t0))

            async for _ in streams.generate(req, on_submit=on_submit):
                pass
            end = time.perf_counter()
            seq = seen["seq"]
            ttft.append(1e3 * (seq.first_token_time - t0))
            latency.append(1e3 * (end - t0))
            engine_ms.append(1e3 * (finished[seq.id] - seq.arrival_time))  # built to last token emitted
            delivery_ms.append(1e3 * (end - finished[seq.id]))  # last token emitted to the client's loop end

    steps0 = engine.steps
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(c)))
    finally:
        engine.emit = emit
    wall = time.perf_counter() - t0
    new_steps = engine.steps - steps0  # the step log keeps the last STEP_LOG steps
    steps = list(engine.step_log)[-new_steps:] if new_steps else []
    graph = [s for s in steps if s[2] == "decode"]
    mixed = [s for s in steps if s[2] != "decode"]
    busy = sum(s[4] for s in steps)
    return {"concurrency": c, "requests": len(reqs), "wall_s": round(wall, 3), "req_s": round(len(reqs) / wall, 2),
            "ttft_ms": q(ttft), "latency_ms": q(latency), "submit_ms": q(submit_ms),
            "engine_ms": q(engine_ms), "delivery_ms": q(delivery_ms),
            "steps": len(steps), "graph_steps": len(graph), "mixed_steps": len(mixed),
            "mixed_graph_steps": sum(s[2] == "step" for s in mixed),
            "graph_step_ms_median": round(1e3 * float(np.median([s[4] for s in graph])), 3) if graph else None,
            "mixed_step_ms_median": round(1e3 * float(np.median([s[4] for s in mixed])), 3) if mixed else None,
            "mixed_step_tokens_median": float(np.median([s[1] for s in mixed])) if mixed else None,
            "mixed_step_seqs_median": float(np.median([s[0] for s in mixed])) if mixed else None,
            "engine_busy_fraction": round(busy / wall, 3)}


def main() -> None:
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-vl-2b")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--text", type=int, default=45, help="text tokens (a 32-word prompt and the template)")
    p.add_argument("--side", type=int, default=28, help="image patches a side (448 px / 16)")
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--switch-interval-ms", type=float, nargs="+", default=[None],
                   help="sys.setswitchinterval for the run (the GIL hand-off between the engine thread and the loop); "
                        "several values: the concurrencies are run once per value")
    p.add_argument("--profile-loop", action="store_true", help="cProfile the event loop's thread (top functions)")
    p.add_argument("--device", default="cuda", help="cpu with --preset tiny: a smoke run")
    p.add_argument("--out", default="benchmarks/llm_load.json")
    a = p.parse_args()
    cfg = AutoConfig.for_model(**load_preset(a.preset))
    cfg.text_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    with torch.device(a.device):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=dtype).eval()
    model.model.visual = None
    engine = Engine.from_model(model, build_tokenizer(), a.device, max_num_seqs=a.max_num_seqs, gpu_memory_utilization=0.5)
    hidden = cfg.text_config.hidden_size
    deepstack = len(cfg.vision_config.deepstack_visual_indexes)
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else a.device, "preset": a.preset, "max_num_seqs": engine.max_num_seqs,
           "max_num_batched_tokens": engine.cfg.max_num_batched_tokens, "runs": []}

    async def run_all():
        streams = AsyncEngine(engine, engine.cfg.stream_interval_ms / 1e3)
        warm = [image_request(engine, a.text, a.side, a.new, hidden, deepstack, -i - 1, dtype) for i in range(32)]
        await closed_loop(engine, streams, warm, 16)
        default = sys.getswitchinterval()
        for k, interval in enumerate(a.switch_interval_ms):
            sys.setswitchinterval(default if interval is None else interval / 1e3)
            for c in a.concurrency:
                n = max(a.requests, 4 * c) if c > 1 else min(a.requests, 64)
                reqs = [image_request(engine, a.text, a.side, a.new, hidden, deepstack, 10**6 * k + 1000 * c + i, dtype)
                        for i in range(n)]
                r = {"switch_interval_ms": 1e3 * sys.getswitchinterval(), **await closed_loop(engine, streams, reqs, c)}
                res["runs"].append(r)
                print(json.dumps(r), flush=True)
                Path(a.out).write_text(json.dumps(res, indent=1))
        sys.setswitchinterval(default)

    if a.profile_loop:  # the loop runs on this thread; the engine's own thread is not profiled
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(run_all())
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())
    else:
        asyncio.run(run_all())
    engine.shutdown()
    print("\n| switch ms | c | req/s | TTFT p50 ms | TTFT p99 ms | latency p50 ms | steps decode/mixed | decode step ms | "
          "mixed step ms (tokens, seqs) | submit ms p50 | engine ms p50 | delivery ms p50 | engine busy |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["runs"]:
        print(f"| {r['switch_interval_ms']:g} | {r['concurrency']} | {r['req_s']} | {r['ttft_ms']['p50']:.1f} | {r['ttft_ms']['p99']:.1f} | "
              f"{r['latency_ms']['p50']:.1f} | {r['graph_steps']}/{r['mixed_steps']} | {r['graph_step_ms_median']} | "
              f"{r['mixed_step_ms_median']} ({r['mixed_step_tokens_median']}, {r['mixed_step_seqs_median']}) | "
              f"{r['submit_ms']['p50']:.2f} | {r['engine_ms']['p50']:.1f} | {r['delivery_ms']['p50']:.1f} | "
              f"{r['engine_busy_fraction']} |")


if __name__ == "__main__":
    main()
