"""A fake OpenAI chat server with known timings (the 2026-12-05 cross-check on the CPU machine): the first token
after TTFT_MS, then 15 more every TPOT_MS; /own gives its own TTFT percentiles, /bodies what clients sent.

    python3 fake_sse.py PORT
"""
import asyncio
import json
import os
import sys
import time

from aiohttp import web

TTFT, TPOT, N = float(os.environ.get("TTFT_MS", 30)) / 1e3, float(os.environ.get("TPOT_MS", 5)) / 1e3, 16
own = []
samples = []
peers = set()
running = 0
async def chat(request):
    global running
    t0 = time.perf_counter()
    raw = await request.read()
    peers.add(request.transport.get_extra_info("peername"))
    if len(samples) < 400:
        samples.append((request.headers.get("user-agent", ""), raw))
    running += 1
    try:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(TTFT)
        for i in range(N):
            if i:
                await asyncio.sleep(TPOT)
            await resp.write(b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" a"}}]}\n\n')
            if i == 0:
                own.append(time.perf_counter() - t0)
        usage = {"prompt_tokens": 3, "completion_tokens": N, "total_tokens": N + 3}
        await resp.write(b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    finally:
        running -= 1
async def load(r): return web.json_response({"running": running, "waiting": 0, "kv_usage": 0.0, "num_replicas": 1, "replicas": []})
async def enc(r): return web.json_response({"batches": 0})
async def health(r): return web.json_response({"status": "ok"})
async def models(r): return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})
async def bodies(r):
    import base64
    import io

    from PIL import Image
    out = []
    for ua, raw in samples:
        b = json.loads(raw)
        info = {"ua": ua[:40], "bytes": len(raw), "keys": sorted(k for k in b if k != "messages")}
        info["params"] = {k: v for k, v in b.items() if k not in ("messages", "model")}
        for m in b["messages"]:
            c = m["content"]
            if isinstance(c, str):
                info.setdefault("texts", []).append(len(c))
                continue
            for part in c:
                if part["type"] == "text":
                    info.setdefault("texts", []).append(len(part["text"]))
                elif part["type"] == "image_url":
                    u = part["image_url"]["url"]
                    head, data = u.split(",", 1)
                    im = Image.open(io.BytesIO(base64.b64decode(data)))
                    info.setdefault("images", []).append([head, im.size, im.format, len(data)])
        out.append(info)
    samples.clear()
    n = len(peers)
    peers.clear()
    return web.json_response({"connections": n, "bodies": out})
async def stats(r):
    xs = sorted(own)
    own.clear()

    def q(p):
        return 1e3 * xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None
    return web.json_response({"n": len(xs), "p50": q(0.5), "p99": q(0.99)})
app = web.Application(client_max_size=64 << 20)
for m, p, h in [("post", "/v1/chat/completions", chat), ("get", "/v1/llm/load", load), ("get", "/v1/encoder/stats", enc),
                ("get", "/health", health), ("get", "/v1/models", models), ("get", "/own", stats), ("get", "/bodies", bodies)]:
    getattr(app.router, "add_" + m)(p, h)
web.run_app(app, port=int(sys.argv[1]), access_log=None, print=None)
