"""Each request's time to first token, split into its parts on its Router's log line, and what the slowest
requests waited for (benchmarks/ttft_tail.py): the parts a request reports fit inside its time to first
token, an `X-Request-Id` names the request as in vLLM, and the attribution's means add up exactly."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from app.api.chat import TTFT_PARTS_ASKED
from app.api.schemas import with_header_request_id
from benchmarks import ttft_tail
from benchmarks.serve import parse_parts_comment
from helpers import png_bytes, sse_data, world_chat


@pytest.fixture(scope="module")
def chat(world):
    return world_chat(world)


def _image_body(stream: bool) -> dict:
    import base64

    url = "data:image/png;base64," + base64.b64encode(png_bytes(64, 48)).decode()
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "what is it"}]}],
            "max_tokens": 4, "temperature": 0, "stream": stream}


@pytest.mark.parametrize("stream", [True, False])
def test_a_requests_log_line_carries_the_parts_of_its_time_to_first_token(chat, caplog, stream):
    records = []
    chat.observer = records.append
    try:
        async def go():
            TTFT_PARTS_ASKED.set(True)  # as the Router does for an X-TTFT-Parts header
            t0 = time.perf_counter()  # the Router's clock starts before the request is prepared
            req, gen, payload = await chat.prepare(with_header_request_id(_image_body(stream), f"parts-{stream}"))
            if stream:
                return req, [w async for w in await chat.open_stream(req, gen, payload, t0)]
            return req, await chat.complete(req, gen, payload, t0)

        with caplog.at_level(logging.INFO, logger="app.api.chat"):
            req, out = asyncio.run(go())
    finally:
        chat.observer = None
    assert req.id == f"chatcmpl-parts-{stream}"  # the header's id, as vLLM names the answer
    (rec,) = records
    parts = rec["parts"]
    assert {"before_s", "parse_s", "media_s", "prompt_s", "queue_s", "prefill_s"} <= set(parts)
    assert all(v >= 0 for v in parts.values())
    # the Router's parts happen before the backend's call, the engine's after it, all before the first token
    assert parts["parse_s"] + parts["media_s"] + parts["prompt_s"] <= parts["before_s"]
    assert parts["before_s"] + parts["queue_s"] + parts["prefill_s"] <= rec["ttft_s"]
    (line,) = [r.getMessage() for r in caplog.records if req.id in r.getMessage()]
    rid, ttft_ms, logged = ttft_tail.parse_line("INFO x -- " + line)
    assert rid == req.id and ttft_ms == pytest.approx(1e3 * rec["ttft_s"], abs=0.05)
    assert logged == {k.removesuffix("_s"): pytest.approx(1e3 * v, abs=0.05) for k, v in parts.items()}
    if stream:  # the answer opens with the same parts, as a comment that SSE clients skip
        comment, _, rest = out[0].partition("\n\n")
        assert parse_parts_comment(comment) == (ttft_ms, logged)
        assert rest.startswith("data: ") and not any(":" == w[0] for w in out[1:])
        assert sse_data(out)[-1] == "[DONE]" and sse_data(out)[0]["id"] == req.id


def test_an_answer_nobody_asked_parts_for_has_no_comment(chat):
    async def go():
        req, gen, payload = await chat.prepare(_image_body(True))
        return [w async for w in await chat.open_stream(req, gen, payload)]

    out = asyncio.run(go())
    assert out[0].startswith("data: ")


def test_the_header_names_a_request_whose_body_does_not():
    """The body's `request_id` wins: Ray Serve's proxy adds an X-Request-Id to every request it forwards.
    A header that could not be an id (empty, too long) is ignored rather than refused."""
    body = {"messages": []}
    assert with_header_request_id(body, "from-header")["request_id"] == "from-header"
    assert with_header_request_id(body, "") is body and with_header_request_id(body, "x" * 257) is body
    assert with_header_request_id(body, "x" * 256)["request_id"] == "x" * 256
    assert "request_id" not in body  # the caller's body is not changed
    named = {"messages": [], "request_id": "from-body"}
    assert with_header_request_id(named, "from-header") is named
    assert with_header_request_id(body, None) is body
    assert with_header_request_id([1, 2], "h") == [1, 2]  # not an object: left for the parser to refuse


def _parts(**ms) -> dict:
    return ms


def test_the_slowest_requests_parts_add_up_to_their_time_to_first_token():
    fast = [(50.0 + i, 45.0 + i, _parts(before=10.0, parse=1.0, media=4.0, prompt=0.5, replica=30.0 + i,
                                        payload=1.0, encode=9.0, encode_wait=2.0, encode_run=5.0, encode_wake=1.0,
                                        queue=3.0, prefill=15.0 + i)) for i in range(99)]
    slow = (400.0, 390.0, _parts(before=12.0, parse=1.0, media=5.0, prompt=0.5, replica=360.0, payload=2.0,
                                 encode=300.0, encode_wait=250.0, encode_run=40.0, encode_wake=8.0, queue=4.0,
                                 prefill=50.0))
    att = ttft_tail.attribution([*fast, slow], share=0.01)
    assert att["requests"] == 100 and att["slowest"] == 1 and att["slowest_from_ms"] == 400.0
    s = att["slow"]
    assert s["ttft"] == 400.0
    assert (s["body"], s["encode wait"], s["encode rest"], s["to replica"], s["client"]) == (5.5, 250.0, 2.0, 18.0, 10.0)
    assert s["replica rest"] == 360.0 - 2.0 - 300.0 - 4.0 - 50.0
    for col in (att["all"], att["slow"]):
        assert sum(col[label] for label, _ in ttft_tail.PARTS) == pytest.approx(col["ttft"], abs=1e-9)
    lines = ttft_tail.table(att)
    assert lines[2] == "| **TTFT** | **102.0** | **400.0** |"  # (50 + ... + 148 + 400) / 100


def test_a_request_without_the_replicas_own_time_counts_the_rest_as_the_way_there():
    """A replica that reports no `replica` time (not `fused`: queue and prefill only): what the Router's
    TTFT has beyond its own parts and those is the way to the replica and back, and the parts still add up."""
    att = ttft_tail.attribution([(30.0, 28.0, _parts(before=8.0, parse=1.0, media=2.0, prompt=1.0, queue=2.0,
                                                     prefill=10.0))])
    a = att["all"]
    assert a["to replica"] == 28.0 - 8.0 - 12.0 and a["replica rest"] == 0.0 and a["client"] == 2.0
    assert sum(a[label] for label, _ in ttft_tail.PARTS) == pytest.approx(30.0)


def test_the_way_to_the_replica_and_back_is_split_by_the_wall_clocks():
    """The replica's wall times (handler start, first chunk out) against the Router's (call, first chunk
    in) split the hops; they leave the parts, and the attribution still sums to the TTFT."""
    from app.api.chat import ttft_parts
    from app.api.schemas import ChatRequest
    from app.llm.sampling import SamplingParams

    req = ChatRequest([], [], SamplingParams(), timing={"parse_s": 0.001, "media_s": 0.004, "prompt_s": 0.0005})
    replica = {"replica_s": 0.030, "queue_s": 0.002, "prefill_s": 0.020, "replica_in_at": 100.004,
               "replica_out_at": 100.034}
    parts = ttft_parts(req, 0.010, replica, (100.000, 100.040))
    assert "replica_in_at" not in parts and "replica_out_at" not in parts
    assert parts["to_replica_s"] == pytest.approx(0.004) and parts["from_replica_s"] == pytest.approx(0.006)
    assert "to_replica_s" not in ttft_parts(req, 0.010, dict(replica))  # no wall times of the call: no split
    ms = {k.removesuffix("_s"): 1e3 * v for k, v in parts.items()}
    att = ttft_tail.attribution([(53.0, 50.0, ms)])["all"]
    assert (att["to replica"], att["from replica"]) == (pytest.approx(4.0), pytest.approx(6.0))
    assert sum(att[label] for label, _ in ttft_tail.PARTS) == pytest.approx(53.0)


def test_router_lines_are_read_by_their_ids(tmp_path):
    (tmp_path / "replica_vlm_Router_abc.log").write_text(
        "INFO 2026-12-03 05:00:00,000 vlm_Router abc -- request chatcmpl-goodput-1-5-0 status=200 items=1 "
        "prompt_tokens=9 completion_tokens=4 ttft_ms=41.5 e2e_ms=90.0 retries=0 parts_ms=before:10.0,parse:1.0,"
        "media:5.0,prompt:0.5,queue:2.0,prefill:20.0\n"
        "INFO 2026-12-03 05:00:00,001 vlm_Router abc -- request chatcmpl-goodput-1-5-1 status=503 items=1 "
        "prompt_tokens=0 completion_tokens=0 ttft_ms=- e2e_ms=3.0 retries=0\n"
        "INFO 2026-12-03 05:00:00,002 vlm_Router abc -- request chatcmpl-other-2 status=200 items=0 "
        "prompt_tokens=9 completion_tokens=4 ttft_ms=11.0 e2e_ms=30.0 retries=0 parts_ms=before:1.0\n"
        "INFO 2026-12-03 05:00:00,003 vlm_Router abc -- request chatcmpl-goodput-1-50-0 status=200 items=0 "
        "prompt_tokens=9 completion_tokens=4 ttft_ms=12.0 e2e_ms=30.0 retries=0 parts_ms=before:1.0\n")
    assert ttft_tail.read_parts(tmp_path, "goodput-1-5") == {
        "goodput-1-5-0": (41.5, {"before": 10.0, "parse": 1.0, "media": 5.0, "prompt": 0.5, "queue": 2.0, "prefill": 20.0})}
