"""The fuzz corpus (tests/fuzz/fuzz_corpus.py, > 1,000 cases from a fixed seed) sent over HTTP to the
CPU application deployed from serve_config.yaml, a few at a time.

Asserted: no 5xx at all (a 503 only with Retry-After, as overload); every refusal is a 4xx with
OpenAI's error JSON; every case the corpus marks malformed or hostile is refused; a 200 is a
well-formed completion; no replica restarted (Serve's replica actor names and the replica processes'
pid + start time are the same before and after); a normal image request still succeeds; the Router's
resident memory grew by less than ROUTER_GROWTH_BOUND. The counts go to the test output."""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import time

import httpx
import pytest

from fuzz_corpus import REFUSE, SEED, Case, corpus
from helpers import png_bytes
from netfakes import MediaServer
from replicas import replica_identities, rss_bytes, serve_replica_ids
from served import config_from_file, deployed

pytestmark = pytest.mark.integration
PORT = 8795
CONCURRENCY = 6
ROUTER_GROWTH_BOUND = 400 << 20  # bytes; the corpus itself is ~33 MB of bodies
ARGS = {"model": "embedded:tiny", "max_request_bytes": 8 << 20,
        "encoder": {"min_budget": 64, "max_budget": 1024, "batch_wait_ms": 5, "autotune": False},
        "llm": {"max_model_len": 4096}}


@pytest.fixture(scope="module", params=["auto", "fused"])
def served(model_cache, request):
    """The CPU default (separate encoder replica), then the `fused` placement (the GPU default: the
    LLM replica reads and encodes the media itself, so hostile items reach it)."""
    pytest.importorskip("ray")
    media_server = MediaServer(png_bytes(32, 32, seed=1))
    media = {"max_media_bytes": 4 << 20, "fetch_timeout_s": 2.0, "decode_timeout_s": 10.0,
             "allowed_private_endpoints": [f"127.0.0.1:{media_server.port}"]}
    conf = config_from_file(PORT, ARGS | {"cache_dir": model_cache, "media": media,
                                          "placement": {"policy": request.param}})
    try:
        with deployed(conf):
            yield f"http://127.0.0.1:{media_server.port}"
    finally:
        media_server.close()


def image_request() -> dict:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(48, 64, seed=3)).decode()
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "what is this?"}]}],
            "max_tokens": 4, "temperature": 0}


def problem(case: Case, status: int, headers: httpx.Headers, body: bytes) -> str | None:
    """Why this answer breaks the contract, or None."""
    if status >= 500 and not (status == 503 and "retry-after" in headers):
        return f"{status}"
    if status == 429 and "retry-after" not in headers:
        return "429 without Retry-After"
    try:
        doc = json.loads(body)
    except ValueError:
        return f"{status} with a body that is not JSON: {body[:80]!r}"
    if status == 200:
        if case.expect == REFUSE:
            return "200 for a malformed or hostile request"
        if doc.get("object") != "chat.completion" or not doc.get("choices"):
            return "200 without a completion"
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    if not (400 <= status < 500 or status == 503) or not isinstance(err, dict):
        return f"{status} without OpenAI's error object"
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str) or "code" not in err:
        return f"{status} error object lacks message/type/code: {err}"
    return None


async def send_all(cases: list[Case]) -> list[tuple[Case, int, str | None, str | None]]:
    sem = asyncio.Semaphore(CONCURRENCY)
    timeout = httpx.Timeout(120, connect=30)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=timeout,
                                 limits=httpx.Limits(max_connections=CONCURRENCY)) as client:
        async def one(case: Case):
            async with sem:
                try:
                    resp = await client.request(case.method, case.path, content=case.body, headers=case.headers)
                except httpx.HTTPError as e:  # a hang or a dropped connection breaks the contract too
                    return case, -1, f"{type(e).__name__}: {e}", None
                code = None
                try:
                    code = (json.loads(resp.content).get("error") or {}).get("code")
                except (ValueError, AttributeError):
                    pass
                return case, resp.status_code, problem(case, resp.status_code, resp.headers, resp.content), code

        return await asyncio.gather(*(one(c) for c in cases))


def test_the_fuzz_corpus_gets_4xx_never_5xx_and_restarts_nothing(served, request):
    fused = request.node.callspec.params["served"] == "fused"
    warm = httpx.post(f"http://127.0.0.1:{PORT}/v1/chat/completions", json=image_request(), timeout=120)
    assert warm.status_code == 200, warm.text
    cases = corpus(SEED, served)
    assert len(cases) >= 1000
    actors, processes = serve_replica_ids(), replica_identities()
    want = {"Router", "MediaPreprocessor", "LLM"} | (set() if fused else {"VisionEncoder"})
    assert {d for d, _, _ in processes} >= want, processes
    assert fused == ("VisionEncoder" not in {d for d, _, _ in processes})  # fused: the LLM replica encodes
    router_before = rss_bytes("Router")

    t0 = time.monotonic()
    results = asyncio.run(send_all(cases))
    elapsed = time.monotonic() - t0

    router_growth = rss_bytes("Router") - router_before
    statuses = collections.Counter(status for _, status, _, _ in results)
    codes = collections.Counter(code for _, status, _, code in results if status != 200)
    five_xx = sum(status >= 500 or status < 0 for _, status, _, _ in results)
    by_category = collections.Counter(c.category for c in cases)
    answered = sum(status == 200 for _, status, _, _ in results)
    print(f"\nfuzz corpus (seed {SEED}): {len(cases)} cases ({sum(c.expect == REFUSE for c in cases)} must be "
          f"refused), sent {CONCURRENCY} at a time in {elapsed:.0f} s; 5xx: {five_xx}; 200 (tolerated cases that "
          f"decoded): {answered}; Router RSS growth {router_growth / 2**20:.0f} MiB")
    print(f"  categories: {dict(by_category)}")
    print(f"  statuses: {dict(sorted(statuses.items()))}")
    print(f"  error codes: {dict(codes.most_common())}")

    bad = [(c.category, c.name, status, why) for c, status, why, _ in results if why is not None]
    assert not bad, bad[:20]
    assert five_xx == 0
    assert serve_replica_ids() == actors, "a replica restarted"
    assert replica_identities() == processes, "a replica process restarted"
    after = httpx.post(f"http://127.0.0.1:{PORT}/v1/chat/completions", json=image_request(), timeout=120)
    assert after.status_code == 200 and after.json()["usage"]["prompt_tokens_details"]["image_tokens"] > 0, after.text
    assert router_growth < ROUTER_GROWTH_BOUND, router_growth
