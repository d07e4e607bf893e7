"""The whole application on Ray Serve (CPU), over real HTTP."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import httpx
import pytest

from benchmarks.serve import wait_listening
from deployments.ray_env import apply_serve_env
from helpers import mp4_bytes, png_bytes

pytestmark = pytest.mark.integration
PORT = 8765
METRICS_PORT = 8766
DIRECT_PORT = 8767  # router_http_port: the Routers' own shared port, beside the proxy's
SERVER_ARGS = {"model": "embedded:tiny", "encoder": {"min_budget": 64, "max_budget": 1024, "batch_wait_ms": 20},
               "media": {"max_input_pixels": 1_000_000, "max_items_per_request": 4,
                         "max_frames_per_request": 10},
               "router_http_port": DIRECT_PORT, "router_http_host": "127.0.0.1"}


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def server(model_cache):
    ray = pytest.importorskip("ray")
    from ray import serve

    from deployments.app import build_app

    apply_serve_env()  # as `make serve` starts Ray
    saved_triton = os.environ.pop("TRITON_CACHE_DIR", None)  # the replicas choose theirs (test below)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=METRICS_PORT)
    if saved_triton is not None:
        os.environ["TRITON_CACHE_DIR"] = saved_triton
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(SERVER_ARGS | {"cache_dir": model_cache}), name="vlm", route_prefix="/")
    wait_listening(DIRECT_PORT)  # the Routers' own port: open once they have warmed
    client = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=120)
    try:
        yield client
    finally:
        client.close()
        serve.shutdown()
        ray.shutdown()


def chat(client, content, **kw):
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                     "max_tokens": 6, "temperature": 0, **kw})


def expect_ok(resp, images: int = 0, videos: int = 0) -> dict:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    u = body["usage"]
    d = u["prompt_tokens_details"]
    # the prompt's placeholders equal the embeddings the encoder produced for it
    assert d["image_tokens"] + d["video_tokens"] == d["vision_embeddings"]
    assert (d["image_tokens"] > 0) == (images > 0) and (d["video_tokens"] > 0) == (videos > 0)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 0 < u["completion_tokens"] <= 6
    return body


def test_health_and_models(server):
    assert server.get("/health").json() == {"status": "ok"}
    model = server.get("/v1/models").json()["data"][0]
    assert model["id"] == "tiny"
    # the embedded checkpoint's generation config (Qwen3-VL-Instruct's values) is what omitted parameters take
    assert model["sampling_defaults"] == {"source": "generation_config.json", "temperature": 0.7, "top_p": 0.8,
                                         "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 256}


def test_the_llm_replicas_report_the_phases_of_their_start(server):
    """/v1/llm/load: each LLM replica's start, phase by phase in wall-clock order, ending before it was
    ready (app/serving/startup.py): the tower where the replica holds one (`fused`), the engine's weights
    and KV cache (no graphs on the CPU)."""
    for r in server.get("/v1/llm/load").json()["replicas"]:
        phases = r["startup"]["phases"]
        names = [p["name"] for p in phases]
        assert names[names.index("engine: weights"):][:2] == ["engine: weights", "engine: KV cache"]
        assert "tower" not in names or names.index("tower") < names.index("engine: weights")
        assert r["startup"]["started_at"] <= phases[0]["start"]
        assert all(p["start"] <= p["end"] for p in phases)
        assert all(a["end"] <= b["start"] for a, b in zip(phases, phases[1:]))
        assert phases[-1]["end"] <= r["ready_at"]


def test_the_llm_replicas_keep_their_triton_kernels_under_cache_dir(server, model_cache):
    """app/gpu/kernel_cache.py: a replica's compiled kernels go beside the model cache, which a deployment
    keeps on a volume (the fixture starts Ray without a TRITON_CACHE_DIR, which would win)."""
    want = str(Path(model_cache).resolve() / "triton")
    replicas = server.get("/v1/llm/load").json()["replicas"]
    assert replicas and all(r["kernel_cache"] == want for r in replicas)
    assert Path(want).is_dir()
    assert all(r["gpu_sharing"] is None for r in replicas)  # on the CPU there is no GPU to share (app/gpu/sharing.py)


def test_the_replicas_heaps_are_frozen_and_their_collections_counted(server):
    """app/serving/gc_pauses.py: Ray Serve froze what every LLM replica and the Router that answers held
    when their constructors returned (a process that imported torch and transformers holds well over
    50,000 objects), so full collections skip it; the pauses of later collections are counted."""
    load = server.get("/v1/llm/load").json()
    for r in load["replicas"]:
        assert r["gc"]["frozen_objects"] > 50_000
        assert len(r["gc"]["collections"]) == len(r["gc"]["pause_ms_max"]) == 3
    assert load["router_gc"]["frozen_objects"] > 50_000


def test_the_cluster_runs_ray_serve_in_its_low_overhead_mode(server):
    """The environment set before Ray starts (deployments/ray_env.py, as `make serve` does) reaches the
    cluster's processes, where Ray Serve reads it."""
    import ray

    @ray.remote(num_cpus=0)
    def mode():
        from ray.serve._private import constants as c

        return (c.RAY_SERVE_THROUGHPUT_OPTIMIZED, c.RAY_SERVE_ENABLE_DIRECT_INGRESS,
                c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, c.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP,
                os.environ.get("RAY_max_direct_call_object_size"))  # read by Ray's core when a worker starts

    assert ray.get(mode.remote()) == (True, False, False, False, str(512 * 1024))


def test_text_only(server):
    body = expect_ok(chat(server, "Hello there"))
    assert body["usage"]["prompt_tokens_details"]["vision_embeddings"] == 0


def test_one_image(server):
    body = expect_ok(chat(server, [{"type": "image_url", "image_url": {"url": data_url(png_bytes(64, 96), "image/png")}},
                                   {"type": "text", "text": "What is this?"}]), images=1)
    from app.media.preprocess import smart_resize

    h, w = smart_resize(64, 96, 32, 64 * 32 * 32, 1024 * 1024)
    assert body["usage"]["prompt_tokens_details"]["image_tokens"] == (h // 16) * (w // 16) // 4


def test_one_video(server):
    body = expect_ok(chat(server, [{"type": "video_url", "video_url": {"url": data_url(mp4_bytes(8), "video/mp4")}},
                                   {"type": "text", "text": "What happens?"}]), videos=1)
    from app.media.preprocess import smart_resize

    # 8 frames at 4 fps = 2 s -> 4 frames sampled at 2 fps -> 2 temporal groups
    h, w = smart_resize(64, 64, 32, 64 * 32 * 32, 256 * 32 * 32)
    assert body["usage"]["prompt_tokens_details"]["video_tokens"] == 2 * (h // 16) * (w // 16) // 4


def test_image_and_video_in_one_request(server):
    expect_ok(chat(server, [{"type": "text", "text": "Compare"},
                            {"type": "image_url", "image_url": {"url": data_url(png_bytes(80, 80, 1), "image/png")}},
                            {"type": "text", "text": "with"},
                            {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(6, seed=2), "video/mp4")}}]),
              images=1, videos=1)


def test_streaming(server):
    resp = chat(server, [{"type": "image_url", "image_url": {"url": data_url(png_bytes(), "image/png")}}],
                stream=True, stream_options={"include_usage": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache" and resp.headers["x-accel-buffering"] == "no"
    events = [line[len("data: "):] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # OpenAI: null until the usage chunk
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["image_tokens"] == usage["prompt_tokens_details"]["vision_embeddings"] > 0
    # streamed text equals the non-streamed greedy answer
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    full = chat(server, [{"type": "image_url", "image_url": {"url": data_url(png_bytes(), "image/png")}}]).json()
    assert text == full["choices"][0]["message"]["content"]


def test_logprobs_through_the_official_client(server):
    """`logprobs` / `top_logprobs` over HTTP with the openai client, answered and streamed: the same
    entries both ways, one per generated token (their numbers against transformers: test_logprobs.py)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    kw = {"model": "tiny", "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2,
          "messages": [{"role": "user", "content": [
              {"type": "image_url", "image_url": {"url": data_url(png_bytes(48, 64, 3), "image/png")}},
              {"type": "text", "text": "Describe it"}]}]}
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens > 0
    for e in content:
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert len(e.top_logprobs) == 2 and e.logprob <= 0
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6  # greedy: the most likely token
        assert bytes(e.bytes).decode(errors="replace") == e.token
    streamed = [e for chunk in client.chat.completions.create(**kw, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(**(kw | {"logprobs": False, "top_logprobs": None}))
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == full.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**(kw | {"logprobs": False}))
    assert e.value.body["param"] == "top_logprobs"


def test_n_choices_through_the_official_client(server):
    """`n` over HTTP with the openai client: each choice is the one-choice answer with seed + index,
    the usage counts the prompt once and every choice's tokens, and the stream's choices (told apart
    by `index`) carry the same texts."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    kw = {"model": "tiny", "max_tokens": 6, "temperature": 1.0, "seed": 21,
          "messages": [{"role": "user", "content": [
              {"type": "image_url", "image_url": {"url": data_url(png_bytes(56, 72, 5), "image/png")}},
              {"type": "text", "text": "Describe it"}]}]}
    full = client.chat.completions.create(**kw, n=3)
    assert [c.index for c in full.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**(kw | {"seed": 21 + i})) for i in range(3)]
    assert [c.message.content for c in full.choices] == [a.choices[0].message.content for a in alone]
    assert full.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert full.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts = ["", "", ""]
    for chunk in client.chat.completions.create(**kw, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in full.choices]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, n=65)
    assert e.value.body["param"] == "n"


def test_structured_output_through_the_official_client(server):
    """`response_format` with a JSON schema over HTTP: each of two sampled choices about an image is
    JSON for the schema, answered and streamed alike, finishing with "stop"; a bad schema is a 400."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    schema = {"type": "object", "additionalProperties": False, "required": ["animal", "count"],
              "properties": {"animal": {"enum": ["cat", "dog"]}, "count": {"type": "integer", "minimum": 1, "maximum": 5}}}
    kw = {"model": "tiny", "max_tokens": 40, "temperature": 1.0, "seed": 5, "n": 2,
          "response_format": {"type": "json_schema", "json_schema": {"name": "pets", "schema": schema}},
          "messages": [{"role": "user", "content": [
              {"type": "image_url", "image_url": {"url": data_url(png_bytes(56, 72, 8), "image/png")}},
              {"type": "text", "text": "Which animal, how many?"}]}]}
    full = client.chat.completions.create(**kw)
    for c in full.choices:
        obj = json.loads(c.message.content)
        assert c.finish_reason == "stop" and set(obj) == {"animal", "count"}
        assert obj["animal"] in ("cat", "dog") and type(obj["count"]) is int and 1 <= obj["count"] <= 5
    texts = ["", ""]
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in full.choices]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**(kw | {"response_format": {"type": "json_schema",
                                                                    "json_schema": {"schema": {"type": "nope"}}}}))
    assert e.value.body["param"] == "response_format"


def test_tool_calls_through_the_official_client(server):
    """Tool calling over HTTP with the official client: a forced call comes back as the client's
    `tool_calls` (arguments following the schema, finish "tool_calls"), the same streamed (the client's
    stream accumulator rebuilds it); the call and its result sent back as history are answered; an
    unknown named tool is a 400 naming tool_choice."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {
        "name": "count_animals", "description": "Count the animals in the picture",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["animal", "count"],
                       "properties": {"animal": {"enum": ["cat", "dog"]},
                                      "count": {"type": "integer", "minimum": 1, "maximum": 5}}}}}]
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(56, 72, 8), "image/png")}},
        {"type": "text", "text": "How many?"}]}]
    kw = {"model": "tiny", "max_tokens": 300, "temperature": 0, "tools": tools, "messages": messages,
          "tool_choice": {"type": "function", "function": {"name": "count_animals"}}}
    full = client.chat.completions.create(**kw)
    c = full.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "count_animals" and call.id.startswith("call_")
    assert args["animal"] in ("cat", "dog") and type(args["count"]) is int and 1 <= args["count"] <= 5
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    history = messages + [c.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "3 cats"}]
    answer = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0, tools=tools, messages=history)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > full.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**(kw | {"tool_choice": {"type": "function", "function": {"name": "nope"}}}))
    assert e.value.body["param"] == "tool_choice"


def test_the_routers_own_port_serves_the_same_api_without_the_proxy(server):
    """router_http_port (app/api/shared_port.py): the same FastAPI app served by the Router process itself.
    Same answers as through Ray Serve's proxy, streamed and not, and the same OpenAI error shape."""
    import openai

    content = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(), "image/png")}},
               {"type": "text", "text": "Describe"}]
    via_proxy = expect_ok(chat(server, content), images=1)["choices"][0]["message"]["content"]
    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{DIRECT_PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": content}]
    r = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == via_proxy and r.usage.prompt_tokens_details.image_tokens > 0
    stream = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == via_proxy
    with pytest.raises(openai.BadRequestError) as e:
        direct.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": [{"type": "audio_url", "audio_url": {}}]}])
    assert e.value.status_code == 400 and e.value.body["code"] == "unsupported_content_type"
    assert httpx.get(f"http://127.0.0.1:{DIRECT_PORT}/health").json() == {"status": "ok"}


BAD_REQUESTS = [
    ("malformed JSON", b"{not json", "invalid_json"),
    ("unknown part type", {"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {}}]}]},
     "unsupported_content_type"),
    ("undecodable image", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"nope").decode()}}]}]},
     "invalid_image"),
    ("undecodable video", {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"\0" * 64).decode()}}]}]},
     "invalid_video"),
    ("loopback URL", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/none.png"}}]}]}, "media_url_forbidden"),
    ("metadata URL", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}}]}]},
     "media_url_forbidden"),
    ("unresolvable host", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://no-such-host.invalid/x.png"}}]}]}, "media_fetch_failed"),
    ("missing messages", {"model": "tiny"}, None),
    ("n above 64", {"messages": [{"role": "user", "content": "hi"}], "n": 65}, None),
]


@pytest.mark.parametrize("name,body,code", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_client_errors_are_4xx_and_the_server_keeps_serving(server, name, body, code):
    if isinstance(body, bytes):
        resp = server.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    else:
        resp = server.post("/v1/chat/completions", json=body)
    assert 400 <= resp.status_code < 500, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code
    expect_ok(chat(server, "still there?"))  # the replica survived


def test_sixteen_concurrent_requests_share_encoder_batches_and_get_their_own_answers(server, tiny_checkpoint):
    import asyncio

    from app.config import AppConfig
    from helpers import local_chat

    bodies = [{"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(48 + 8 * (i % 4), 64, seed=1000 + i), "image/png")}},
        {"type": "text", "text": f"request {i}"}]}], "max_tokens": 5, "temperature": 0} for i in range(16)]
    before = server.get("/v1/encoder/stats").json()

    async def fire():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))

    responses = asyncio.run(fire())
    after = server.get("/v1/encoder/stats").json()
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    pieces, batches = after["pieces"] - before["pieces"], after["batches"] - before["batches"]
    assert pieces == 16 and batches < pieces, (pieces, batches)
    assert 0 < after["batch_fill"] <= 1 and after["queue_wait_ms_max"] >= 0
    # per replica, what dispatch learned: nothing on the CPU, where no auto-tune table gives it a choice
    assert [(r["dispatch_observed"], r["explored_batches"]) for r in after["replicas"]] == [({}, 0)] * len(after["replicas"])

    # The same requests through the whole pipeline in-process, each alone, no batching, no cache.
    chat = local_chat(AppConfig(**SERVER_ARGS | {"model": str(tiny_checkpoint)}), tiny_checkpoint)

    async def reference(body):
        return await chat.complete(*(await chat.prepare(body)))

    for body, resp in zip(bodies, responses):
        want = asyncio.run(reference(body))
        got = resp.json()
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["usage"] == want["usage"]


def test_a_repeated_image_is_served_from_the_cache(server):
    content = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(40, 40, seed=77), "image/png")}}]
    first = expect_ok(chat(server, content), images=1)
    before = server.get("/v1/encoder/stats").json()
    second = expect_ok(chat(server, content), images=1)
    after = server.get("/v1/encoder/stats").json()
    assert after["cache_hits"] == before["cache_hits"] + 1 and after["pieces"] == before["pieces"]
    assert first["choices"][0]["message"] == second["choices"][0]["message"]


def _solid_png(h: int, w: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


LIMIT_CASES = [
    ("video sent as image_url", [{"type": "image_url", "image_url": {"url": data_url(mp4_bytes(4), "image/png")}}],
     400, "media_type_mismatch"),
    ("image over max_input_pixels", [{"type": "image_url", "image_url": {"url": data_url(_solid_png(1100, 1000),
                                                                                         "image/png")}}],
     400, "image_too_large"),
    ("more items than allowed", [{"type": "image_url", "image_url": {"url": data_url(png_bytes(), "image/png")}}] * 5,
     400, "too_many_media_items"),
    ("more video frames than allowed", [{"type": "video_url", "video_url": {"url": data_url(mp4_bytes(12, fps=2),
                                                                                           "video/mp4")}}] * 2,
     400, "too_many_frames"),
    ("a MIME type that lies", [{"type": "image_url", "image_url": {"url": data_url(png_bytes(), "video/mp4")}}],
     200, None),
    ("still image sent as video_url", [{"type": "video_url", "video_url": {"url": data_url(png_bytes(), "image/png")}}],
     200, None),
]


@pytest.mark.parametrize("name,content,status,code", LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_detection_and_limits_follow_the_documented_rules(server, name, content, status, code):
    resp = chat(server, content)
    assert resp.status_code == status, resp.text
    if code:
        assert resp.json()["error"]["code"] == code
    elif name.startswith("still image"):
        expect_ok(resp, videos=1)
    else:
        expect_ok(resp, images=1)


@pytest.mark.parametrize("port", [PORT, DIRECT_PORT], ids=["proxy", "routers_port"])
def test_a_client_that_disconnects_frees_its_llm_slot(server, port):
    import time

    body = {"messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 4000,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(lines)  # the stream is running
        assert server.get("/v1/llm/load").json()["running"] == 1
    deadline = time.time() + 20  # the connection is closed: the slot must come free
    while server.get("/v1/llm/load").json()["running"] and time.time() < deadline:
        time.sleep(0.1)
    assert server.get("/v1/llm/load").json()["running"] == 0


METRIC_NAMES = [
    "vlm_requests_total", "vlm_ttft_ms", "vlm_e2e_latency_ms", "vlm_encoder_batch_latency_ms",
    "vlm_encoder_batch_fill", "vlm_encoder_queue_wait_ms", "vlm_encoder_graph_hits_total",
    "vlm_encoder_eager_fallbacks_total", "vlm_encoder_padding_ratio", "vlm_encoder_cache_hits_total",
    "vlm_encoder_cache_misses_total", "vlm_llm_running_requests", "vlm_llm_waiting_requests",
    "vlm_llm_kv_cache_usage", "vlm_media_requests_total",
]


def test_serving_benchmark_report_and_metrics_endpoint(server, tmp_path):
    import asyncio
    import time
    from dataclasses import asdict

    from benchmarks.serve import Workload, plot_sweep, run_load

    reports = {}
    for kind in ("image", "video"):
        rep = asyncio.run(run_load(f"http://127.0.0.1:{PORT}", Workload(kind, image_size=64, video_size=64,
                                                                        video_frames=4, output_tokens=4),
                                   num_requests=4, concurrency=2, warmup=1, progress=False, monitor=True))
        reports[rep.workload] = [asdict(rep)]
        assert rep.successful == 4 and rep.failed == 0, rep.errors
        # CPU per deployment from the replicas' process titles; no GPU here, so none sampled
        res = rep.resources
        assert {"Router", "MediaPreprocessor", "VisionEncoder", "LLM", "load generator"} <= set(res["groups"])
        assert sum(g["cores"] for g in res["groups"].values()) > 0 and res["verdict"]
        assert res["gpu_mean"] == [] or res["gpu_source"] != "none"
        assert rep.request_throughput > 0 and rep.output_token_throughput > 0
        assert set(rep.ttft_ms) == set(rep.e2e_ms) == {"mean", "median", "p99"}
        assert 0 < rep.ttft_ms["median"] <= rep.e2e_ms["p99"]
        assert rep.encoder["pieces"] == 4 and rep.encoder["graph_hits"] + rep.encoder["eager_batches"] >= 1
        assert 0 < rep.encoder["mean_batch_fill"] <= 1
    # an eager fallback (896 x 896 is 3136 patches > the 1024-token budget) and a cache hit; a noise PNG
    # this large (over `router_local_bytes` as a data: URL) is prepared by a MediaPreprocessor replica even
    # when sent alone, as the videos are; a lone small image (test_one_image) by the Router itself
    big = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(900, 900, seed=5), "image/png")}}]
    expect_ok(chat(server, big), images=1)
    expect_ok(chat(server, big), images=1)
    deadline, missing = time.time() + 60, METRIC_NAMES
    while missing and time.time() < deadline:
        text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
        missing = [n for n in METRIC_NAMES if f"ray_{n}" not in text]
        time.sleep(1)
    assert not missing, missing
    assert 'reason="tokens"' in text
    media = [line for line in text.splitlines() if line.startswith("ray_vlm_media_requests_total")]
    assert any('where="local"' in line for line in media) and any('where="remote"' in line for line in media), media
    assert all(p.stat().st_size > 0 for p in plot_sweep(reports, tmp_path))


def test_metrics_on_the_serving_port_count_the_requests(server):
    """GET /metrics on the serving port, where AIPerf looks for it, in vLLM's names, without a key: two
    chat requests add two finished requests and exactly the tokens their usage reports."""
    from prometheus_client.parser import text_string_to_metric_families

    model = server.get("/v1/models").json()["data"][0]["id"]

    def scrape() -> dict:
        resp = server.get("/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain"), resp.text
        out = {}
        for fam in text_string_to_metric_families(resp.text):
            for s in fam.samples:
                assert s.labels["model_name"] == model
                out[(s.name, *sorted(v for k, v in s.labels.items() if k != "model_name"))] = s.value
        return out

    before = scrape()
    usage = [expect_ok(chat(server, f"Say something about {topic}"))["usage"] for topic in ("cats", "boats")]
    after = scrape()

    def grew(*key):
        return after.get(key, 0) - before.get(key, 0)

    assert grew("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert grew("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
    assert grew("vllm:request_success_total", "stop") + grew("vllm:request_success_total", "length") == 2
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert grew(f"{name}_count") == 2, name
        assert grew(f"{name}_bucket", "+Inf") == 2, name
    assert ("vllm:num_requests_running",) in after and 0 <= after[("vllm:kv_cache_usage_perc",)] <= 1
    assert after[("vlm:metrics_replicas", "LLM")] >= 1 and after[("vlm:metrics_replicas_unanswered", "LLM")] == 0
    assert ("vlm:encoder_batches_total",) in after  # the VisionEncoder replicas' (no fused placement on CPU)


def test_more_streams_than_ray_serves_default_replica_limit_reach_the_llm_together(server):
    """Ray Serve lets a replica take 5 requests at once unless told otherwise, which capped the LLM's
    continuous batching at 5 (and the encoder's cross-request batching). Of 12 long streams opened at
    once, more than 5 must be in the LLM engine together (decoding, or admitted and waiting for a slot)."""
    import threading
    import time

    body = {"messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 8000,
            "temperature": 0, "stream": True, "ignore_eos": True}
    stop = threading.Event()

    def stream():  # read as a client does (a stream nobody reads finishes its 8000 tokens in a blink)
        with server.stream("POST", "/v1/chat/completions", json=body) as resp:
            for _ in resp.iter_lines():
                if stop.is_set():
                    break

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(12)]
    for t in threads:
        t.start()
    peak, deadline = 0, time.time() + 60
    while peak < 6 and time.time() < deadline:
        load = server.get("/v1/llm/load").json()
        peak = max(peak, load["running"] + load["waiting"])
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(30)
    assert peak >= 6, peak
    deadline = time.time() + 30
    while server.get("/v1/llm/load").json()["running"] and time.time() < deadline:
        time.sleep(0.1)
    assert server.get("/v1/llm/load").json()["running"] == 0
