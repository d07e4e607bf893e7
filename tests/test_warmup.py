"""Ready means ready: a replica warms every path a request can take before it reports ready
(app/serving/warmup.py). On the CPU with the tiny model: the warm-up's requests all succeed, reach the engine's
every kind of step (chunked prefill, batched decodes, sampling filters, log-probabilities, a grammar,
several choices, a stream, images and a video through the tower), and leave the engine serving
answers equal to a cold engine's."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module")
def fused_chat(tiny_checkpoint):
    from app.config import AppConfig
    from app.serving.fused import FusedBackend

    cfg = AppConfig(model=str(tiny_checkpoint), llm={"max_num_batched_tokens": 64},
                    encoder={"min_budget": 64, "max_budget": 1024})
    return cfg, FusedBackend.build(cfg, str(tiny_checkpoint))


def test_the_warm_up_runs_every_path_and_every_request_succeeds(fused_chat, tiny_checkpoint):
    from app.serving.warmup import warm_llm_replica, warmup_bodies

    cfg, backend = fused_chat
    engine = backend.engine
    steps0 = engine.steps
    report = warm_llm_replica(cfg, str(tiny_checkpoint), backend, media=True)
    bodies = warmup_bodies(64, True)
    assert report.errors == [] and report.requests == 2 * len(bodies)
    assert engine.steps > steps0
    batches = {seqs for seqs, *_ in engine.step_log}
    assert max(batches) >= 8  # decodes batched together
    tokens = [t for _, t, *_ in engine.step_log]
    assert max(tokens) == 64  # the long prompt was prefilled in chunks of the step's budget
    assert engine.grammars._tokenizer is not None  # the grammar compiler's vocabulary is built
    stats = backend.encoder.stats()
    assert stats["batches"] >= 4  # the tower ran (two image sizes, a video, two images)


def test_a_warmed_replica_answers_as_a_cold_one(fused_chat, tiny_checkpoint):
    from helpers import local_chat

    cfg, backend = fused_chat
    cold = local_chat(cfg, tiny_checkpoint)
    warm = local_chat(cfg, tiny_checkpoint, backend=backend)
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8, "temperature": 0}

    async def answer(chat):
        return (await chat.complete(*(await chat.prepare(body))))["choices"][0]["message"]["content"]

    assert asyncio.run(answer(warm)) == asyncio.run(answer(cold))


def test_media_warm_up_prepares_each_kind(tiny_checkpoint):
    from app.config import AppConfig
    from app.media.pipeline import MediaPipeline
    from app.media.spec import patch_spec_for
    from app.serving.warmup import warm_media

    cfg = AppConfig(model=str(tiny_checkpoint))
    assert warm_media(MediaPipeline(cfg.media, patch_spec_for(tiny_checkpoint))) > 0


def test_the_builder_turns_warm_up_on_only_with_gpus(monkeypatch):
    import deployments.app as builder

    seen = {}
    monkeypatch.setattr(builder, "resolve_model", lambda *a: None)
    monkeypatch.setattr(builder, "node_gpus", lambda: [])
    for gpus in (0, 2):
        monkeypatch.setattr(builder, "cluster_resources", lambda g=gpus: (g, 16.0))
        monkeypatch.setattr(builder, "deployment_options",
                            lambda cfg, *a, g=gpus: (seen.__setitem__(g, cfg.warmup), ({}, None))[1])
        with pytest.raises((KeyError, AttributeError)):  # stops right after the options: nothing is built
            builder.build_app({})
    assert seen == {0: False, 2: True}


def test_a_routers_warm_up_requests_are_answered_but_counted_in_no_metrics(fused_chat, tiny_checkpoint):
    """`warm_router` sends its requests through the Router's own ASGI app; every Router now does so at a
    first deploy too, so they would have shown in `vlm_requests_total` and the LLM replicas' counters as
    traffic nobody sent. They are answered as any request, the record reaches no observer, and the
    generation dict says `warm_up` (the LLM replica then counts nothing); a client's request afterwards,
    streamed or not, counts as before."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from app.api.chat import WARM_UP
    from app.serving.warmup import router_warmup_bodies, warm_router
    from helpers import local_chat

    cfg, backend = fused_chat
    gens, records = [], []

    class Recording:
        def stream(self, gen, payload):
            gens.append(gen["warm_up"])
            return backend.stream(gen, payload)

    chat = local_chat(cfg, tiny_checkpoint, Recording())
    chat.observer = records.append

    async def completions(request):
        req, gen, payload = await chat.prepare(await request.json())
        if req.stream:
            return StreamingResponse(await chat.open_stream(req, gen, payload), media_type="text/event-stream")
        return JSONResponse(await chat.complete(req, gen, payload))

    app = Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"]),
                            Route("/v1/models", lambda r: JSONResponse({"data": []}))])

    async def main():
        report = await warm_router(app, None, rounds=1)
        assert report.errors == [] and report.requests == 1 + len(router_warmup_bodies())
        assert records == [] and gens and all(gens)  # answered, counted nowhere
        assert not WARM_UP.get()  # reset after
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://client") as client:
            for stream in (False, True):
                r = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream})
                assert r.status_code == 200
        assert len(records) == 2 and gens[-2:] == [False, False]

    asyncio.run(main())


@pytest.mark.filterwarnings("ignore:coroutine 'LLM.__del__' was never awaited:RuntimeWarning")
def test_the_llm_replica_counts_no_warm_up_request():
    """deployments/llm.py: a generation the Router's warm-up sent (`warm_up`) goes straight through; any
    other is counted in the replica's request metrics and marks its first request (scale-up timelines)."""
    pytest.importorskip("ray")
    from app.serving.loop_lag import LoopLag
    from app.serving.prometheus import RequestMetrics
    from deployments.llm import LLM

    cls = LLM.func_or_class
    replica = cls.__new__(cls)
    replica.request_metrics, replica.first_request_at, replica.loop_lag = RequestMetrics(64), None, LoopLag()

    async def chunks():
        yield "chunk"

    warm = {"warm_up": True, "input_ids": [1, 2], "params": {}}
    stream = chunks()
    assert replica._observed(warm, stream) is stream and replica.first_request_at is None
    other = {"warm_up": False, "input_ids": [1, 2], "params": {}}

    async def first_request():  # on the replica's event loop, which its loop-lag ticks then watch
        return replica._observed(other, stream)

    assert replica.loop_lag._loop is None  # not started by the warm-up's request
    observed = asyncio.run(first_request())
    assert observed is not stream and replica.first_request_at is not None  # RequestMetrics.observe's
    assert replica.loop_lag._loop is not None
