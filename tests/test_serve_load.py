"""benchmarks/serve.py's load generator against a fake OpenAI server (aiohttp, no Ray): the timed
requests spread over several processes arrive once each with their tags, within the concurrency."""

from __future__ import annotations

import asyncio
import json
import queue
import random
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
from aiohttp import web

from benchmarks.serve import Workload, _from_each, run_load
from netfakes import serve_aiohttp

USAGE = {"prompt_tokens": 3, "completion_tokens": 2}


class FakeServer:
    """Streams three SSE events per chat completion (the last with usage), slowly enough that
    requests overlap; records each request's x-request-id and the most requests in flight at once."""

    def __init__(self):
        self.ids: list[str | None] = []
        self.in_flight = self.max_in_flight = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.ids.append(request.headers.get("x-request-id"))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
        await asyncio.sleep(0.03)
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n")
        self.in_flight -= 1  # before [DONE]: the client may send its next request once it reads it
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({})  # encoder_delta reads every counter with a default of 0


@pytest.fixture
def server():
    """The fake on a free port, served by its own event loop in a background thread."""
    fake = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.chat)
    app.router.add_get("/v1/encoder/stats", fake.stats)
    for url in serve_aiohttp(app):
        yield fake, url


def _load(url: str, n: int = 40, **kw):
    return asyncio.run(run_load(url, Workload("image", image_size=32), n, warmup=2, progress=False, **kw))


def _check(fake: FakeServer, report, tags: list[str]) -> None:
    n = len(tags)
    assert (report.successful, report.failed) == (n, 0), report.errors
    assert Counter(fake.ids) == Counter(tags + [None, None])  # each tag once, and two untagged warm-ups
    assert round(report.output_token_throughput * report.duration_s) == 2 * n
    assert round(report.input_token_throughput * report.duration_s) == 3 * n


@pytest.mark.parametrize("processes", [3, 1])
def test_the_timed_requests_split_over_processes_arrive_once_each_within_the_concurrency(server, processes):
    fake, url = server
    report = _load(url, concurrency=7, processes=processes)
    _check(fake, report, [f"image_32_2-c7-0-{i}" for i in range(40)])
    assert 1 < fake.max_in_flight <= 7
    assert report.load_processes == processes


def test_a_poisson_rate_is_split_over_processes(server):
    """20 req/s over 2 processes: each sends its 5 requests at 10 req/s with gaps from random.Random(k),
    so the run lasts until process k's last send (the sum of its first 4 gaps) plus one response."""
    fake, url = server
    report = _load(url, n=10, request_rate=20.0, processes=2, seed_offset=5)
    _check(fake, report, [f"image_32_2-cr-5-{i}" for i in range(10)])
    last_sent = max(sum(rng.expovariate(10.0) for _ in range(4)) for rng in map(random.Random, range(2)))
    assert last_sent + 0.03 <= report.duration_s < last_sent + 0.25  # 0.41 s; at the whole rate each, 0.21 s


def test_more_processes_than_the_concurrency_is_refused():
    with pytest.raises(ValueError, match="processes"):
        asyncio.run(run_load("http://127.0.0.1:1", Workload("image", image_size=32), 4, concurrency=2, processes=3))


def test_a_dead_load_process_raises_instead_of_hanging():
    """A load process that died (here: killed, exit code -9) and sent nothing fails the run within a
    couple of polls. Run in a thread so that a regression fails the test instead of hanging it."""
    raised: list[BaseException] = []

    def collect():
        try:
            _from_each(queue.Queue(), [SimpleNamespace(exitcode=-9)], "results", None)
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "waited for a dead load process"
    assert isinstance(raised[0], RuntimeError)
    assert "load process 0 (exit code -9) died before sending its results" in str(raised[0])


def test_each_load_process_gets_bodies_in_proportion_to_its_concurrency():
    """An equal share of bodies with unequal concurrency (7 over 3 processes: 3, 2, 2) left the
    processes with less concurrency sending the run's end alone: 33% fewer req/s at c=6 over 4."""
    from benchmarks.serve import split_load

    shares, indices = split_load(70, 7, 3)
    assert shares == [3, 2, 2] and [len(x) for x in indices] == [30, 20, 20]
    assert sorted(i for x in indices for i in x) == list(range(70))
    shares, indices = split_load(10, None, 3)  # a Poisson rate: equal shares
    assert shares == [None] * 3 and [len(x) for x in indices] == [4, 3, 3]


def test_a_request_rate_is_never_queued_behind_a_connection_cap():
    """Poisson arrivals: the client's pool has no limit (a cap of 64 made rate x latency queue in the
    client and count as TTFT); a fixed concurrency keeps a pool twice its size."""
    import asyncio

    from benchmarks.serve import _session

    async def limits():
        async with _session("http://127.0.0.1:1", None, 1.0) as rate, _session("http://127.0.0.1:1", 100, 1.0) as c:
            return rate.connector.limit, c.connector.limit

    assert asyncio.run(limits()) == (0, 200)
