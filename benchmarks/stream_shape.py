"""The shape of a streamed answer as a client sees it, one request at a time against a running server:
how many HTTP chunks arrive until [DONE], and how long [DONE] trails the finish event (the wait for
the replica's end of stream, before the Router's writes were merged: app/api/chat.py `_sse`).

    python3 benchmarks/stream_shape.py --url http://127.0.0.1:8000 --requests 60

448² noise JPEGs and a 32-word prompt, 16 output tokens, as `serve.py`'s image workload; the first 5
requests are warm-up. Medians and means in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time

import aiohttp
import numpy as np
from PIL import Image


def body(seed: int, size: int) -> str:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe " * 32}]}],
        "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})


async def one(session: aiohttp.ClientSession, url: str, data: str) -> dict:
    t0, first, finish, chunks = time.perf_counter(), None, None, 0
    async with session.post(f"{url}/v1/chat/completions", data=data,
                            headers={"content-type": "application/json"}) as resp:
        async for raw, _ in resp.content.iter_chunks():
            t, chunks = 1e3 * (time.perf_counter() - t0), chunks + 1
            first = t if first is None and b"data:" in raw else first
            finish = t if b'"finish_reason":"' in raw.replace(b" ", b"") and finish is None else finish
            if b"[DONE]" in raw:
                return {"ttft": first, "done": t, "finish_to_done": t - finish, "chunks": chunks}
    raise RuntimeError("stream ended without [DONE]")


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--image-size", type=int, default=448)
    a = p.parse_args()
    bodies = [body(1000 + i, a.image_size) for i in range(a.requests)]
    async with aiohttp.ClientSession() as session:
        rows = [await one(session, a.url, b) for b in bodies][5:]
    for key in ("chunks", "finish_to_done", "ttft", "done"):
        vals = [r[key] for r in rows]
        print(f"{key:>15}: median {statistics.median(vals):8.1f}  mean {statistics.mean(vals):8.1f}")


if __name__ == "__main__":
    asyncio.run(main())
