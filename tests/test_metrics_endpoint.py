"""GET /metrics (app/serving/prometheus.py), without Ray: the replicas' snapshots summed exactly, the text
parsed back by prometheus_client's own parser, a request's counters on the CPU engine equal to what its
usage reports, a slow or failing replica left out and counted. The endpoint on the deployed application
is checked in tests/test_integration.py (test_metrics_on_the_serving_port_count_the_requests)."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.errors import ClientError, Overloaded
from app.serving.prometheus import (
    E2E_BOUNDS,
    TTFT_BOUNDS,
    Histogram,
    RequestMetrics,
    gather_within,
    merge_snapshots,
    one_two_five,
    render,
    scrape_text,
)


def parse(body: bytes) -> dict[str, dict]:
    """{family name: {(sample name, sorted labels without model_name): value}}"""
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        samples = {}
        for s in fam.samples:
            assert s.labels.get("model_name") == "tiny", s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
        out[fam.name] = samples
    return out


def replica(prompt, generation, finished, ttft_values, e2e_values, load, encoder=None) -> dict:
    m = RequestMetrics(max_model_len=1000)
    m.prompt_tokens, m.generation_tokens = prompt, generation
    m.finished.update(finished)
    for v in ttft_values:
        m.ttft.observe(v)
    for v in e2e_values:
        m.e2e.observe(v)
    m.generation_hist.observe(generation)
    return {**m.snapshot(), "load": load, "encoder": encoder}


def load(running, waiting, blocks, free, queried=0, hits=0, preemptions=0) -> dict:
    return {"running": running, "waiting": waiting, "kv_usage": 1 - free / blocks, "kv_blocks": blocks,
            "kv_blocks_free": free, "prefix_cache_queried_tokens": queried, "prefix_cache_hit_tokens": hits,
            "preemptions": preemptions}


TWO = [replica(100, 40, {"stop": 2, "length": 1}, [0.003, 0.05], [0.4, 2.2],
               load(2, 1, 100, 75, queried=64, hits=32, preemptions=1)),
       replica(30, 7, {"stop": 1, "abort": 1}, [0.05, 3000.0], [0.4],
               load(1, 0, 300, 225, queried=16, hits=0))]


def test_two_replicas_snapshots_sum_exactly():
    merged = merge_snapshots(TWO)
    assert merged["prompt_tokens"] == 130 and merged["generation_tokens"] == 47
    assert merged["finished"] == {"stop": 3, "length": 1, "abort": 1, "error": 0}
    ttft = merged["histograms"]["ttft"]
    assert ttft["bounds"] == list(TTFT_BOUNDS)
    by_bound = dict(zip(ttft["bounds"] + [float("inf")], ttft["counts"]))
    assert by_bound[0.005] == 1 and by_bound[0.06] == 2 and by_bound[float("inf")] == 1  # 3000 s > every bound
    assert sum(ttft["counts"]) == 4 and ttft["sum"] == pytest.approx(3000.103)
    e2e = dict(zip(list(E2E_BOUNDS) + [float("inf")], merged["histograms"]["e2e"]["counts"]))
    assert e2e[0.5] == 2 and e2e[2.5] == 1 and sum(e2e.values()) == 3
    assert merged["load"] == {"running": 3, "waiting": 1, "kv_blocks": 400, "kv_blocks_free": 300,
                              "prefix_cache_queried_tokens": 80, "prefix_cache_hit_tokens": 32, "preemptions": 1}


def test_the_text_parses_back_with_vllms_names_and_the_summed_values():
    body, content_type = scrape_text((TWO, 1), None, "tiny")
    assert content_type.startswith("text/plain")
    m = parse(body)

    def value(family, sample=None, **labels):
        return m[family][(sample or family, tuple(sorted(labels.items())))]

    assert value("vllm:num_requests_running") == 3 and value("vllm:num_requests_waiting") == 1
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(0.25)  # 100 of 400 blocks, not the mean of the two
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 130
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 47
    assert value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 80
    assert value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 32
    assert value("vllm:num_preemptions", "vllm:num_preemptions_total") == 1
    success = {dict(labels)["finished_reason"]: v for (name, labels), v in m["vllm:request_success"].items()}
    assert success == {"stop": 3, "length": 1, "abort": 1, "error": 0}
    ttft = m["vllm:time_to_first_token_seconds"]
    assert ttft[("vllm:time_to_first_token_seconds_bucket", (("le", "0.001"),))] == 0
    assert ttft[("vllm:time_to_first_token_seconds_bucket", (("le", "0.005"),))] == 1
    assert ttft[("vllm:time_to_first_token_seconds_bucket", (("le", "0.06"),))] == 3  # cumulative
    assert ttft[("vllm:time_to_first_token_seconds_bucket", (("le", "2560.0"),))] == 3
    assert ttft[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 4
    assert ttft[("vllm:time_to_first_token_seconds_count", ())] == 4
    assert ttft[("vllm:time_to_first_token_seconds_sum", ())] == pytest.approx(3000.103)
    gen = m["vllm:request_generation_tokens"]
    assert gen[("vllm:request_generation_tokens_bucket", (("le", "5.0"),))] == 0
    assert gen[("vllm:request_generation_tokens_bucket", (("le", "10.0"),))] == 1  # the 7
    assert gen[("vllm:request_generation_tokens_bucket", (("le", "50.0"),))] == 2  # and the 40
    for name in ("vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens"):
        assert (f"{name}_count", ()) in m[name]
    assert value("vlm:metrics_replicas", deployment="LLM") == 2
    assert value("vlm:metrics_replicas_unanswered", deployment="LLM") == 1
    assert not any(name.startswith("vlm:encoder") for name in m)  # no tower answered


def test_towers_of_fused_replicas_and_encoder_replicas_add_up():
    tower = {"batches": 3, "pieces": 5, "graph_hits": 2, "uniform_hits": 1, "eager_batches": 1,
             "eager_reasons": {"tokens": 1}, "real_tokens": 900, "padded_tokens": 100, "cache_hits": 4,
             "cache_misses": 5, "batch_tokens": 900, "batch_budget_tokens": 1200}
    fused = [{**TWO[0], "encoder": tower}, {**TWO[1], "encoder": tower}]
    m = parse(scrape_text((fused, 0), None, "tiny")[0])
    assert m["vlm:encoder_batches"][("vlm:encoder_batches_total", ())] == 6
    assert m["vlm:encoder_items"][("vlm:encoder_items_total", ())] == 10
    assert m["vlm:encoder_graph_hits"][("vlm:encoder_graph_hits_total", ())] == 4
    assert m["vlm:encoder_eager_fallbacks"][("vlm:encoder_eager_fallbacks_total", (("reason", "tokens"),))] == 2
    assert m["vlm:encoder_padding_ratio"][("vlm:encoder_padding_ratio", ())] == pytest.approx(0.1)
    assert m["vlm:encoder_batch_fill"][("vlm:encoder_batch_fill", ())] == pytest.approx(0.75)
    # split / colocate: the VisionEncoder replicas answer apart, and are counted apart
    m = parse(scrape_text((TWO, 0), ([tower], 1), "tiny")[0])
    assert m["vlm:encoder_batches"][("vlm:encoder_batches_total", ())] == 3
    assert m["vlm:metrics_replicas"][("vlm:metrics_replicas", (("deployment", "VisionEncoder"),))] == 1
    assert m["vlm:metrics_replicas_unanswered"][
        ("vlm:metrics_replicas_unanswered", (("deployment", "VisionEncoder"),))] == 1


def test_no_replica_answering_still_renders_every_family_at_zero():
    m = parse(scrape_text(([], 2), None, "tiny")[0])
    assert m["vllm:num_requests_running"][("vllm:num_requests_running", ())] == 0
    assert m["vllm:kv_cache_usage_perc"][("vllm:kv_cache_usage_perc", ())] == 0
    assert m["vllm:time_to_first_token_seconds"][("vllm:time_to_first_token_seconds_count", ())] == 0
    assert m["vlm:metrics_replicas_unanswered"][("vlm:metrics_replicas_unanswered", (("deployment", "LLM"),))] == 2


def test_the_classic_text_format_keeps_vllms_colon_names():
    """prometheus_client's OpenMetrics output would write `vllm_prompt_tokens_total`: the endpoint
    always answers in the text format, which keeps `vllm:prompt_tokens_total`."""
    body, content_type = render(merge_snapshots(TWO), None, "tiny", {"LLM": (2, 0)})
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    text = body.decode()
    assert 'vllm:prompt_tokens_total{model_name="tiny"} 130.0' in text.splitlines()
    assert "vllm_" not in text


def test_histograms_of_other_bounds_fold_into_the_first_ones():
    """A replica of another max_model_len during a redeploy: its token buckets go to the first bound at or
    above their own, never below a value they may hold."""
    a, b = Histogram(one_two_five(100)), Histogram(one_two_five(1000))
    a.observe(3)
    b.observe(300)  # (200, 500] -> above every bound of a
    b.observe(7)  # (5, 10] -> a's 10
    merged = merge_snapshots([{"histograms": {"prompt_tokens": a.snapshot()}},
                              {"histograms": {"prompt_tokens": b.snapshot()}}])["histograms"]["prompt_tokens"]
    assert merged["bounds"] == [1, 2, 5, 10, 20, 50, 100]
    assert merged["counts"] == [0, 0, 1, 1, 0, 0, 0, 1] and merged["sum"] == 310


# ------------------------------------------------------------------------------------- RequestMetrics
def chunk(tokens, finish=None, index=0, completion=0):
    return SimpleNamespace(index=index, token_ids=list(range(tokens)), finish_reason=finish,
                           completion_tokens=completion)


async def stream(chunks, fail: BaseException | None = None):
    for c in chunks:
        await asyncio.sleep(0)
        yield c
    if fail is not None:
        raise fail


async def drain(metrics, chunks, prompt, n=1, fail=None, stop_after=None):
    got = []
    agen = metrics.observe(stream(chunks, fail), prompt, n)
    try:
        async for c in agen:
            got.append(c)
            if stop_after is not None and len(got) == stop_after:
                break  # the client went away
    except Exception:
        pass
    finally:
        await agen.aclose()
    return got


def test_request_metrics_count_each_choice_and_the_prompt_once():
    m = RequestMetrics(max_model_len=1000)

    async def main():
        await drain(m, [chunk(1), chunk(3), chunk(0, "stop", completion=4)], prompt=11)
        # n = 2: interleaved choices, one cut by max_tokens; the prompt counts once
        await drain(m, [chunk(1, index=0), chunk(1, index=1), chunk(2, "length", index=1, completion=3),
                        chunk(1, "stop", index=0, completion=2)], prompt=20, n=2)
        await drain(m, [chunk(1), chunk(2), chunk(2)], prompt=5, stop_after=2)  # the client leaves: abort
        await drain(m, [chunk(1)], prompt=6, fail=RuntimeError("replica lost its GPU"))  # mid-stream: error
        await drain(m, [], prompt=7, fail=Overloaded())  # refused before its first token: not counted
        await drain(m, [], prompt=8, fail=ClientError("too long"))

    asyncio.run(main())
    snap = m.snapshot()
    assert snap["prompt_tokens"] == 11 + 20 + 5 + 6
    assert snap["generation_tokens"] == 4 + 5 + 3 + 1
    assert snap["finished"] == {"stop": 2, "length": 1, "abort": 1, "error": 1}
    h = snap["histograms"]
    assert sum(h["ttft"]["counts"]) == 5  # one per choice that produced a chunk
    assert sum(h["e2e"]["counts"]) == 5 and sum(h["generation_tokens"]["counts"]) == 5
    assert sum(h["prompt_tokens"]["counts"]) == 4 and h["prompt_tokens"]["sum"] == 42
    # the tokens after each choice's first chunk: 3 (request 1), 1 + 2 (its choices, request 2), 2 (abort)
    assert sum(h["itl"]["counts"]) == 3 + 3 + 2


def test_the_first_chunks_timing_fills_the_time_to_first_token_parts():
    """Each choice's first chunk says where its time to first token went (Chunk.timing): vLLM's queue and
    prefill times and the fused tower's encoding, summed over replicas and rendered in vLLM's names."""
    m = RequestMetrics(max_model_len=1000)
    first = SimpleNamespace(**vars(chunk(1)), timing={"queue_s": 0.012, "prefill_s": 0.030, "encode_s": 0.004,
                                                       "unknown_s": 9.0})
    later = SimpleNamespace(**vars(chunk(0, "stop", completion=3)), timing={"queue_s": 5.0})  # not a first

    async def main():
        await drain(m, [first, chunk(2), later], prompt=4)
        await drain(m, [chunk(1), chunk(0, "length", completion=1)], prompt=4)  # no timing (an older replica)

    asyncio.run(main())
    h = m.snapshot()["histograms"]
    assert (h["queue"]["sum"], sum(h["queue"]["counts"])) == (0.012, 1)
    assert (h["prefill"]["sum"], sum(h["prefill"]["counts"])) == (0.030, 1)
    assert (h["encode"]["sum"], sum(h["encode"]["counts"])) == (0.004, 1)
    snap = {**m.snapshot(), "load": load(0, 0, 10, 10)}
    parsed = parse(scrape_text(([snap, snap], 0), None, "tiny")[0])
    for family, total in (("vllm:request_queue_time_seconds", 0.024), ("vllm:request_prefill_time_seconds", 0.06),
                          ("vlm:request_encode_time_seconds", 0.008)):
        assert parsed[family][(f"{family}_count", ())] == 2
        assert parsed[family][(f"{family}_sum", ())] == pytest.approx(total)


def test_engine_counters_equal_the_requests_usage(tiny_checkpoint):
    """The CPU engine with the tiny model: token totals equal what the final chunks (the responses'
    usage) report, finished requests by reason equal the chunks' reasons."""
    from transformers import AutoTokenizer

    from app.llm.async_engine import AsyncEngine
    from app.llm.engine import Engine
    from app.llm.sampling import SamplingParams
    from app.llm.sequence import GenerationRequest

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    engine = Engine(str(tiny_checkpoint))
    streams = AsyncEngine(engine, stream_interval_s=0.0)
    metrics = RequestMetrics(engine.max_model_len)
    timings = []

    def request(text, **params):
        ids = tok(text).input_ids
        return GenerationRequest(ids, [0] * len(ids), [], SamplingParams(**{"temperature": 0, **params}))

    async def run(req):
        return [c async for c in metrics.observe(streams.generate(req), len(req.input_ids), req.params.n)]

    async def main():
        greedy = await run(request("Tell me a story", max_tokens=6, ignore_eos=True))
        timings.extend(c.timing for c in greedy)
        ids = [t for c in greedy for t in c.token_ids]
        # a stop token id the greedy answer reaches at its third token ends it there ("stop")
        chunks = greedy + await run(request("Tell me a story", max_tokens=6, stop_token_ids=[ids[2]]))
        chunks += await run(request("What is in the picture?", max_tokens=4, ignore_eos=True, n=2, seed=1,
                                    temperature=1.0))
        prompts = [len(tok("Tell me a story").input_ids)] * 2 + [len(tok("What is in the picture?").input_ids)]
        return [c for c in chunks if c.finish_reason], prompts

    try:
        finals, prompts = asyncio.run(main())
    finally:
        engine.shutdown()
    snap = metrics.snapshot()
    assert snap["generation_tokens"] == sum(c.completion_tokens for c in finals)
    assert snap["prompt_tokens"] == sum(prompts)  # the n = 2 request's prompt once, as its usage
    reasons = Counter(c.finish_reason for c in finals)
    assert reasons == {"length": 3, "stop": 1}
    assert {r: n for r, n in snap["finished"].items() if n} == dict(reasons)
    assert sum(snap["histograms"]["ttft"]["counts"]) == 4 and sum(snap["histograms"]["e2e"]["counts"]) == 4
    assert snap["histograms"]["generation_tokens"]["sum"] == snap["generation_tokens"]
    # the engine's part of each choice's time to first token, on its first chunk only (no tower here)
    assert set(timings[0]) == {"queue_s", "prefill_s"} and min(timings[0].values()) >= 0
    assert all(t is None for t in timings[1:])
    h = snap["histograms"]
    assert sum(h["queue"]["counts"]) == sum(h["prefill"]["counts"]) == 4 and sum(h["encode"]["counts"]) == 0
    assert h["queue"]["sum"] + h["prefill"]["sum"] <= h["ttft"]["sum"]


# --------------------------------------------------------------------------------- replicas, auth
def test_a_slow_or_failing_replica_is_left_out_and_counted():
    async def answer(value, delay=0.0, fail=False):
        await asyncio.sleep(delay)
        if fail:
            raise RuntimeError("replica died")
        return value

    async def main():
        return await gather_within([answer(1), answer(2, delay=30), answer(3, fail=True), answer(4)], 0.2)

    results, missing = asyncio.run(main())
    assert sorted(results) == [1, 4] and missing == 2


def test_broadcast_within_waits_on_each_replica_apart():
    pytest.importorskip("ray")
    from deployments.metrics import broadcast_within

    class Call:
        def __init__(self, value, delay):
            self.value, self.delay = value, delay

        async def get_async(self):
            await asyncio.sleep(self.delay)
            return self.value

    class Response:
        async def _fetch_replica_results_async(self):
            return [Call("a", 0), Call("slow", 30), Call("b", 0.01)]

    handle = SimpleNamespace(broadcast=lambda method: Response())
    results, missing = asyncio.run(broadcast_within(handle, "metrics_snapshot", 0.3))
    assert sorted(results) == ["a", "b"] and missing == 1


def test_metrics_needs_no_api_key():
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse
    from fastapi.testclient import TestClient

    from app.api.auth import ApiKeyMiddleware

    api = FastAPI()
    api.add_middleware(ApiKeyMiddleware, get_key=lambda: "sk-secret")

    @api.get("/metrics")
    async def metrics():
        return PlainTextResponse("# scraped\n")

    @api.get("/v1/llm/load")
    async def llm_load():
        return {}

    client = TestClient(api)
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/llm/load").status_code == 401
