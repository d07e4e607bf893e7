"""The `fused` placement: the tower inside the LLM replica, its embeddings handed to the engine where
they were made. Its answers must equal the reference pipeline's (ChatService + LocalBackend: no Ray,
no batching, no cache) for concurrent requests batched together, images and videos mixed; a request
the engine would refuse is refused before its media is encoded. The Ray test deploys
serve_config.yaml with `placement.policy: fused` and checks the same through HTTP and the `openai`
client."""

from __future__ import annotations

import asyncio
import base64

import pytest

from helpers import local_chat, mp4_bytes, png_bytes

ARGS = {"model": "embedded:tiny", "encoder": {"min_budget": 64, "max_budget": 1024, "batch_wait_ms": 20},
        "media": {"max_input_pixels": 1_000_000, "max_items_per_request": 4, "max_frames_per_request": 10}}


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image(seed: int, h: int = 48, w: int = 64) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(png_bytes(h, w, seed=seed), "image/png")}}


def video(frames: int) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(frames, fps=2), "video/mp4")}}


def bodies() -> list[dict]:
    """Twelve requests: images of several sizes, a video, an image with a video, text only."""
    contents = [[image(2000 + i, 40 + 8 * (i % 3), 64), {"type": "text", "text": f"request {i}"}] for i in range(8)]
    contents += [[video(4), {"type": "text", "text": "the video"}],
                 [image(3000), video(6), {"type": "text", "text": "both"}],
                 [{"type": "text", "text": "no media at all"}],
                 [image(2000, 40, 64), {"type": "text", "text": "the first picture again"}]]
    return [{"messages": [{"role": "user", "content": c}], "max_tokens": 5, "temperature": 0} for c in contents]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Each body's answer from the in-process reference pipeline, one request at a time."""
    from app.config import AppConfig

    chat = local_chat(AppConfig(**ARGS | {"model": str(tiny_checkpoint), "device": "cpu"}), tiny_checkpoint)

    async def one(body):
        return await chat.complete(*(await chat.prepare(body)))

    try:
        return [asyncio.run(one(b)) for b in bodies()]
    finally:
        chat.backend.engine.shutdown()


def same_answer(got: dict, want: dict) -> None:
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    assert got["usage"] == want["usage"]


def fp32_config(tiny_checkpoint, device: str, **encoder):
    """ARGS in float32 on `device`, with a small KV pool: the GPU default (most of the free memory)
    would starve the tests that follow."""
    from app.config import AppConfig

    fp32 = {"dtype": "float32"}
    return AppConfig(**ARGS | {"model": str(tiny_checkpoint), "device": device,
                               "encoder": ARGS["encoder"] | fp32 | encoder, "llm": fp32 | {"num_kv_blocks": 256}})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_backend_batches_concurrent_requests_and_answers_as_the_reference(tiny_checkpoint, reference, device):
    """On CUDA (fp32, graphs on) the embeddings go from the tower's batch to the engine without leaving
    the GPU; the answers still equal the CPU reference's."""
    import torch

    from app.serving.fused import FusedBackend

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = fp32_config(tiny_checkpoint, device)
    fused = FusedBackend.build(cfg, str(tiny_checkpoint))
    assert fused.encoder.keep_on_device and fused.engine.device.type == device
    try:
        check_fused_answers(fused, cfg, tiny_checkpoint, reference, device)
    finally:
        fused.engine.shutdown()


def check_fused_answers(fused, cfg, tiny_checkpoint, reference, device):
    chat = local_chat(cfg, tiny_checkpoint, fused)

    async def run_all():
        async def one(body):
            return await chat.complete(*(await chat.prepare(body)))

        first = await asyncio.gather(*(one(b) for b in bodies()[:-1]))  # concurrent: shared encoder batches
        last = await one(bodies()[-1])  # an image seen before: from the embedding cache
        return [*first, last]

    answers = asyncio.run(run_all())
    for got, want in zip(answers, reference, strict=True):
        same_answer(got, want)
    stats = fused.encoder.stats()
    # 8 + 1 + 2 items were encoded (the 12th request's image came from the cache), in fewer batches
    assert stats["pieces"] == 11 and stats["batches"] < stats["pieces"], stats
    assert stats["cache_hits"] == 1 and stats["cache_entries"] == 11
    # handed-out and cached items have their own storage, not views of a whole batch's output
    main, deepstack = next(iter(fused.encoder.cache._data.values()))
    assert main.device.type == device  # kept where the tower made it
    assert main.untyped_storage().nbytes() == main.numel() * main.element_size()
    assert all(d.untyped_storage().nbytes() == d.numel() * d.element_size() for d in deepstack)


def test_the_fused_encoder_waits_longer_only_while_the_engine_has_a_backlog(tiny_checkpoint, reference, monkeypatch):
    """`encoder.backlog_wait_ms`: the tower's batcher asks the engine whether requests wait for a slot
    (Engine.short_of_room). Off by default; on, the answers are unchanged and the engine's own
    scheduling state is what it reads."""
    from app.serving.fused import FusedBackend

    off = FusedBackend.build(fp32_config(tiny_checkpoint, "cpu"), str(tiny_checkpoint))
    try:
        assert off.encoder.batcher.backlog is None
    finally:
        off.engine.shutdown()
    cfg = fp32_config(tiny_checkpoint, "cpu", backlog_wait_ms=50)
    fused = FusedBackend.build(cfg, str(tiny_checkpoint))
    try:
        assert fused.encoder.batcher.backlog_wait_s == 0.05  # the config reached the batcher
        check_fused_answers(fused, cfg, tiny_checkpoint, reference, "cpu")
        assert fused.encoder.batcher.backlog() is False  # all answered: nothing waits
        monkeypatch.setattr(fused.engine.scheduler, "short_of_room", True)  # as a full engine's scheduling sets it
        assert fused.encoder.batcher.backlog() is True
    finally:
        fused.engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("stream", ["own", "shared"])
def test_the_fused_tower_hands_over_only_finished_embeddings(tiny_checkpoint, reference, monkeypatch, stream):
    """With `encoder.stream: own` the tower's batches run on a stream of their own, beside the
    engine's. Its stream is held up by a 50 ms kernel before every batch: the embeddings handed
    over, read at once on the caller's stream, still equal the same batch encoded on that stream, and
    the engine's answers still equal the reference's. (Without the shared stream's ordering, a
    hand-off before the tower's stream has made them would read unwritten memory.)"""
    import torch

    from app.serving.fused import FusedBackend
    from app.vision.graphs import VisionItem

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = fp32_config(tiny_checkpoint, "cuda", stream=stream)
    fused = FusedBackend.build(cfg, str(tiny_checkpoint))
    enc = fused.encoder
    try:
        assert (enc._stream is not None) == (stream == "own")
        g = torch.Generator().manual_seed(5)
        grids = [(1, 8, 8), (1, 6, 10), (2, 4, 4)]  # two images and a video: one batch
        items = [(torch.randint(0, 256, (t * h * w, 1536), generator=g, dtype=torch.uint8).numpy(), (t, h, w), None)
                 for t, h, w in grids]
        want = enc.manager.encode([VisionItem(torch.from_numpy(px), grid) for px, grid, _ in items])
        want = [(w.main.cpu(), [d.cpu() for d in w.deepstack]) for w in want]
        real = enc.manager.encode_batch

        def held_up(batch, *args, **kwargs):
            torch.cuda._sleep(100_000_000)  # on the current stream: the tower's (about 50 ms)
            return real(batch, *args, **kwargs)

        monkeypatch.setattr(enc.manager, "encode_batch", held_up)
        check_fused_answers(fused, cfg, tiny_checkpoint, reference, "cuda")
        before = enc.batcher.stats.batches
        got = asyncio.run(enc.encode_async(items))
        assert enc.batcher.stats.batches == before + 1
        for (main, deepstack), (want_main, want_deepstack) in zip(got, want, strict=True):
            assert torch.equal(main.cpu(), want_main)  # .cpu() reads on this thread's stream
            assert all(torch.equal(d.cpu(), w) for d, w in zip(deepstack, want_deepstack, strict=True))
    finally:
        fused.engine.shutdown()


def test_a_request_the_engine_would_refuse_is_refused_before_its_media_is_encoded(tiny_checkpoint):
    from app.config import AppConfig
    from app.errors import ClientError
    from app.serving.fused import FusedBackend

    cfg = AppConfig(**ARGS | {"model": str(tiny_checkpoint), "llm": {"max_waiting": 0}})
    fused = FusedBackend.build(cfg, str(tiny_checkpoint))
    chat = local_chat(cfg, tiny_checkpoint, fused)

    async def send(body):
        req, gen, payload = await chat.prepare(body)
        return await chat.complete(req, gen, payload)

    try:
        with pytest.raises(ClientError) as busy:
            asyncio.run(send(bodies()[0]))
        assert busy.value.status == 503 and busy.value.headers == {"Retry-After": "1"}
        assert fused.encoder.stats()["pieces"] == 0  # the image was never encoded
    finally:
        fused.engine.shutdown()


def test_the_first_chunk_says_how_long_the_media_took_to_encode(tiny_checkpoint):
    """A request's first chunk carries its time to first token's parts: the tower's (queue and batch, and
    its wait, run and wake), then the engine's queue and prefill; the later chunks carry none."""
    from app.config import AppConfig
    from app.serving.fused import FusedBackend

    cfg = AppConfig(**ARGS | {"model": str(tiny_checkpoint)})
    fused = FusedBackend.build(cfg, str(tiny_checkpoint))
    chat = local_chat(cfg, tiny_checkpoint, fused)

    async def chunks(body):
        _, gen, payload = await chat.prepare(body)
        return [c async for c in fused.stream(gen, payload)]

    try:
        got = asyncio.run(chunks(bodies()[0]))
    finally:
        fused.engine.shutdown()
    first, *rest = got
    t = first["timing"]
    assert set(t) == {"encode_s", "encode_wait_s", "encode_run_s", "encode_wake_s", "queue_s", "prefill_s"}
    assert min(t.values()) >= 0 and t["encode_run_s"] > 0 and all(c["timing"] is None for c in rest)
    # the encode time's parts follow one another inside it (the cache lookup and the copies are the rest)
    assert t["encode_wait_s"] + t["encode_run_s"] + t["encode_wake_s"] <= t["encode_s"]


# ---------------------------------------------------------------- through Ray Serve
@pytest.fixture(scope="module")
def served_fused(model_cache):
    pytest.importorskip("ray")
    import httpx

    from served import config_from_file, deployed

    port = 8781
    conf = config_from_file(port, ARGS | {"cache_dir": model_cache, "placement": {"policy": "fused"}})
    with deployed(conf), httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
        yield http, port


@pytest.mark.integration
def test_served_fused_runs_no_encoder_replica_and_answers_as_the_reference(served_fused, reference):
    import httpx
    from ray import serve

    http, port = served_fused
    states = serve.status().applications["vlm"].deployments
    assert states["VisionEncoder"].replica_states.get("RUNNING", 0) == 0
    assert states["LLM"].replica_states.get("RUNNING", 0) == 1

    async def fire(batch):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in batch))

    before = http.get("/v1/encoder/stats").json()
    assert before["num_replicas"] == 1  # the LLM replica's tower
    responses = asyncio.run(fire(bodies()[:-1])) + asyncio.run(fire(bodies()[-1:]))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    for resp, want in zip(responses, reference, strict=True):
        same_answer(resp.json(), want)
    after = http.get("/v1/encoder/stats").json()
    assert after["pieces"] - before["pieces"] == 11 and after["cache_hits"] - before["cache_hits"] == 1


@pytest.mark.integration
def test_served_fused_streams_to_the_openai_client_and_refuses_bad_media(served_fused):
    openai = pytest.importorskip("openai")
    _, port = served_fused
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": [image(5), {"type": "text", "text": "What is this?"}]}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(b"not an image", "image/png")}}]}])
    assert bad.value.code == "invalid_image"
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == full.choices[0].message.content  # the replica survived
    # Asked for its TTFT's parts, the stream opens with an SSE comment, which the openai client skips; an
    # X-Request-Id names the answer, as in vLLM
    told = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
                                          extra_headers={"x-ttft-parts": "1", "x-request-id": "fused-parts-1"})
    chunks = list(told)
    assert {c.id for c in chunks} == {"chatcmpl-fused-parts-1"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content


@pytest.mark.integration
def test_served_fused_answers_say_where_their_first_token_went(served_fused):
    """The comment a client asks for carries the Router's parts and the fused replica's, the way there and
    back split by the wall clocks; the parts fit inside the Router's time to first token."""
    from benchmarks.serve import parse_parts_comment

    http, _ = served_fused
    body = {"model": "tiny", "messages": [{"role": "user", "content": [image(7), {"type": "text", "text": "hi"}]}],
            "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"x-ttft-parts": "1"}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert resp.status_code == 200 and lines[0].startswith(": ttft_ms=") and lines[1].startswith("data: ")
    ttft, parts = parse_parts_comment(lines[0])
    assert {"before", "parse", "media", "prompt", "to_replica", "from_replica", "replica", "payload", "encode",
            "queue", "prefill"} <= set(parts), parts
    assert parts["payload"] + parts["encode"] + parts["queue"] + parts["prefill"] <= parts["replica"] + 0.2
    assert parts["before"] + parts["replica"] <= ttft + 0.2  # ms, rounded to 0.1 on the line
    assert parts["to_replica"] >= 0 and parts["from_replica"] >= 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_start_up_timeline_splits_the_towers_phase(tiny_checkpoint, device):
    """An LLM replica's start on one H100 spent 28 of its 32 s in the tower's phase (2026-11-28); its parts
    (weights; on CUDA the GEMM choice, the graphs and the auto-tune) are now phases of their own, inside it."""
    import torch

    from app.serving.fused import FusedBackend
    from app.serving.startup import StartupTimeline

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    timeline, cfg = StartupTimeline(), fp32_config(tiny_checkpoint, device)
    fused = FusedBackend.build(cfg, str(tiny_checkpoint), timeline)
    fused.engine.shutdown()
    phases = {p["name"]: p for p in timeline.as_dict()["phases"]}
    parts = [n for n in phases if n.startswith("tower: ")]
    graphs = device == "cuda" and cfg.encoder.cuda_graphs
    # the weights' own steps (64.8 s to ready on one H200, 10.9 s of each replica's in the weights, 2026-12-01)
    steps = (["tower: weights: CUDA context"] * (device == "cuda")
             + [f"tower: weights: {n}" for n in ("module and config", "read", "to the device", "graph-friendly tower",
                                                  "static buffers")])
    expected = (["tower: weights", *steps] + ["tower: GEMM choice"] * (device == "cuda") + ["tower: graphs"] * graphs
                + ["tower: auto-tune"] * (graphs and cfg.encoder.autotune))
    assert parts == expected
    tower, weights = phases["tower"], phases["tower: weights"]
    assert all(tower["start"] <= phases[n]["start"] <= phases[n]["end"] <= tower["end"] for n in parts)
    assert all(weights["start"] <= phases[n]["start"] <= phases[n]["end"] <= weights["end"] for n in steps)
    assert "engine: weights" in phases and phases["engine: weights"]["start"] >= tower["end"]
    if device == "cuda":
        assert "engine: matrix-vector choice" in phases
