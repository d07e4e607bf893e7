"""Warming a replica before it reports ready, so that ready means ready.

A fresh replica answers its first requests slowly (kernels compile and autotune, libraries pick
algorithms, allocators grow, decoders import codecs): at half capacity, 503s and multi-second TTFTs in
the first 20 s after `/health` turned green (issue 45, "Real traffic").

So each LLM replica sends itself real requests through the real path before its constructor returns
(Ray Serve routes to it only after that): the chat API, media and the tower (under `fused`: a small and
a large image, a video), prefill longer than a step's budget, concurrent decodes, every sampling filter,
log-probabilities, a JSON schema, several choices, a stream. A media replica decodes one item of each
kind; a Router, once the app's other deployments serve and before it listens on its own port, sends
requests through its own routes (`warm_router`), counted in no metric (app/api/chat.py, WARM_UP).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from dataclasses import dataclass, field

from ..api.chat import WARM_UP
from ..media.synthetic import image_bytes, mp4_bytes

log = logging.getLogger(__name__)
WARM_UP_SEED = 1_000_000_000  # the warm-up's synthetic media: seeds far from any benchmark's


@dataclass
class WarmupReport:
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _part(kind: str, data: bytes, mime: str) -> dict:
    """A chat content part carrying `data` inline: kind "image_url" or "video_url"."""
    return {"type": kind, kind: {"url": _data_url(data, mime)}}


def _user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


def warmup_bodies(max_num_batched_tokens: int, media: bool) -> list[dict]:
    """The requests a replica sends itself: every path a request can take, small enough to be quick."""
    long_text = " ".join(["word"] * (max_num_batched_tokens + max_num_batched_tokens // 4))  # two prefill chunks
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    bodies = [
        {"messages": _user("Hello"), "max_tokens": 4, "temperature": 0},
        {"messages": _user(long_text), "max_tokens": 2, "temperature": 0},
        {"messages": _user("Count to three"), "max_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
         "frequency_penalty": 0.5, "presence_penalty": 0.5, "seed": 1, "min_p": 0.05, "repetition_penalty": 1.1,
         "min_tokens": 2},
        {"messages": _user("Pick one"), "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 5},
        {"messages": _user("Answer in JSON"), "max_tokens": 8, "temperature": 0,
         "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
        {"messages": _user("Two ways"), "max_tokens": 4, "temperature": 1.0, "n": 2, "seed": 2},
        {"messages": _user("Stream this"), "max_tokens": 4, "temperature": 0, "stream": True},
    ]
    bodies += [{"messages": _user(f"Short question {i}"), "max_tokens": 8, "temperature": 0} for i in range(8)]
    if media:
        small = _part("image_url", image_bytes(448, 448, WARM_UP_SEED + 1, "JPEG"), "image/jpeg")
        large = _part("image_url", image_bytes(768, 1024, WARM_UP_SEED + 2, "PNG"), "image/png")
        video = _part("video_url", mp4_bytes(8, seed=WARM_UP_SEED + 3), "video/mp4")
        text = {"type": "text", "text": "What is this?"}
        bodies += [{"messages": _user([small, text]), "max_tokens": 4, "temperature": 0},
                   {"messages": _user([large, text]), "max_tokens": 4, "temperature": 0},
                   {"messages": _user([video, text]), "max_tokens": 4, "temperature": 0},
                   {"messages": _user([small, small, text]), "max_tokens": 4, "temperature": 0.7, "top_p": 0.8}]
    return bodies


async def _one(chat, body: dict, report: WarmupReport) -> None:
    try:
        req, gen, payload = await chat.prepare(body)
        if req.stream:
            async for _ in await chat.open_stream(req, gen, payload, time.perf_counter()):
                pass
        else:
            await chat.complete(req, gen, payload)
    except Exception as e:  # noqa: BLE001 - a warm-up request that fails is reported, not fatal
        report.errors.append(f"{type(e).__name__}: {e}"[:300])


async def warm_chat(chat, bodies: list[dict], rounds: int = 2) -> WarmupReport:
    """Every body at once (decodes batched together), `rounds` times: the second round meets what the
    first compiled, and the prefix cache, as real traffic will."""
    report, t0 = WarmupReport(), time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*(_one(chat, b, report) for b in bodies))
        report.requests += len(bodies)
    report.seconds = time.perf_counter() - t0
    return report


def run_off_loop(coro_fn, timeout_s: float = 600):
    """Run `coro_fn()` on an event loop of its own thread and wait: a replica's constructor may itself
    run inside an event loop, where asyncio.run cannot."""
    box = {}

    def go():
        try:
            box["value"] = asyncio.run(coro_fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=go, name="warmup", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"warm-up did not finish in {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def warm_llm_replica(cfg, checkpoint: str, backend, media: bool) -> WarmupReport:
    """An LLM replica's warm-up: a local chat service (the Router's parsing and prompts, this process's
    own media preparation) over the replica's own backend."""
    from ..api.chat import ChatService
    from ..checkpoints.tokenizer_loader import load_tokenizer
    from ..media.pipeline import MediaPipeline
    from ..media.spec import patch_spec_for

    chat = ChatService(cfg, load_tokenizer(checkpoint),
                       MediaPipeline(cfg.media, patch_spec_for(checkpoint)), backend)
    bodies = warmup_bodies(cfg.llm.max_num_batched_tokens, media)
    report = run_off_loop(lambda: warm_chat(chat, bodies))
    log.info("warm-up: %d requests in %.1f s, %d errors%s", report.requests, report.seconds, len(report.errors),
             f" (first: {report.errors[0]})" if report.errors else "")
    return report


def warm_media(pipeline) -> float:
    """A media replica's warm-up: a JPEG, a PNG and an MP4 prepared by its own pipeline (codecs, lazy
    imports, the worker pool's threads); seconds."""
    from ..media.ref import MediaRef

    refs = [MediaRef("image", _data_url(image_bytes(64, 64, 0, "JPEG"), "image/jpeg"), "warmup"),
            MediaRef("image", _data_url(image_bytes(64, 64, 0, "PNG"), "image/png"), "warmup"),
            MediaRef("video", _data_url(mp4_bytes(4, seed=0), "video/mp4"), "warmup")]
    t0 = time.perf_counter()
    run_off_loop(lambda: pipeline.prepare_all(refs), timeout_s=120)
    return time.perf_counter() - t0


def router_warmup_bodies() -> list[dict]:
    """A Router's own warm-up requests: short answers over its routes and handles, a stream, and three
    images; sent at once, one is prepared on the Router's own threads and the others by the media
    replicas (media.router_local_below), so both paths run."""
    # seeds no benchmark uses (benchmarks/serve.py draws image i with seed i): an image equal to one of
    # its requests would be an embedding-cache hit there
    tiny = _part("image_url", image_bytes(64, 64, WARM_UP_SEED + 4, "JPEG"), "image/jpeg")
    jpeg = _part("image_url", image_bytes(448, 448, WARM_UP_SEED + 5, "JPEG"), "image/jpeg")
    png = _part("image_url", image_bytes(640, 480, WARM_UP_SEED + 6, "PNG"), "image/png")
    text = {"type": "text", "text": "What is this?"}
    return [{"messages": _user("Hello"), "max_tokens": 2, "temperature": 0},
            {"messages": _user("Stream this"), "max_tokens": 2, "temperature": 0, "stream": True},
            {"messages": _user([tiny, text]), "max_tokens": 2, "temperature": 0},
            {"messages": _user([jpeg, text]), "max_tokens": 2, "temperature": 0},
            {"messages": _user([png, text]), "max_tokens": 2, "temperature": 0, "stream": True}]


async def warm_router(asgi_app, api_key: str | None, rounds: int = 2) -> WarmupReport:
    """`router_warmup_bodies` and GET /v1/models through the Router's ASGI app in this process (FastAPI's
    parsing, the API key check, the chat service, the handles to the media and LLM replicas), all at
    once, `rounds` times. A failed request is reported, not raised."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report, t0 = WarmupReport(), time.perf_counter()
    warming = WARM_UP.set(True)  # answered as any request, counted in no metrics (app/api/chat.py)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://warmup",
                                     headers=headers, timeout=None) as client:
            for _ in range(rounds):
                calls = [client.get("/v1/models")]
                calls += [client.post("/v1/chat/completions", json=b) for b in router_warmup_bodies()]
                for r in await asyncio.gather(*calls, return_exceptions=True):
                    report.requests += 1
                    if isinstance(r, Exception):
                        report.errors.append(f"{type(r).__name__}: {r}"[:300])
                    elif r.status_code != 200:
                        report.errors.append(f"HTTP {r.status_code}: {r.text}"[:300])
    finally:
        WARM_UP.reset(warming)
    report.seconds = time.perf_counter() - t0
    return report
