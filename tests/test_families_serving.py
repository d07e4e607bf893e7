"""Qwen2.5-VL and MiniCPM-V 4.5 served end to end on Ray Serve (CPU) over HTTP, with the official
`openai` client: image, video, image + video in one request, and streaming.

Each answer must equal, text and usage, the same request run through the whole pipeline in one process
(ChatService + MediaPipeline + LocalBackend: no Ray, no batching, no cache), whose text side equals
transformers token for token (test_llm_families.py). The router picks the processor settings and the
prompt format from the checkpoint: MiniCPM-V's image is sliced (thumbnail + slices, 16 embeddings each
in the tiny model) and its video frames are unsliced images.
"""

from __future__ import annotations

import asyncio
import base64

import pytest

from deployments.ray_env import apply_serve_env
from helpers import mp4_bytes, png_bytes

pytestmark = pytest.mark.integration
PORT = 8785
ARGS = {"encoder": {"min_budget": 64, "max_budget": 1024, "batch_wait_ms": 5},
        "media": {"max_input_pixels": 1_000_000, "max_items_per_request": 4, "max_frames_per_request": 10}}


def url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


IMAGE = {"type": "image_url", "image_url": {"url": url(png_bytes(200, 300, 1), "image/png")}}
VIDEO = {"type": "video_url", "video_url": {"url": url(mp4_bytes(6, seed=2), "video/mp4")}}


@pytest.fixture(scope="module", params=["tiny-qwen2.5-vl", "tiny-minicpm-v-4.5"])
def served(request, model_cache):
    ray = pytest.importorskip("ray")
    openai = pytest.importorskip("openai")
    from ray import serve

    from app.checkpoints.model_builder import resolve_model
    from app.config import AppConfig
    from app.media.spec import patch_spec_for
    from deployments.app import build_app
    from helpers import local_chat

    args = ARGS | {"model": f"embedded:{request.param}", "cache_dir": model_cache}
    cfg = AppConfig(**args)
    ckpt = resolve_model(cfg.model, cfg.cache_dir)
    local = local_chat(cfg, ckpt)
    apply_serve_env()  # as `make serve` starts Ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(args), name="vlm", route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield {"client": client, "local": local, "preset": request.param, "spec": patch_spec_for(ckpt)}
    finally:
        serve.shutdown()
        ray.shutdown()


def messages(content):
    return [{"role": "user", "content": content}]


def reference(served, content) -> dict:
    body = {"messages": messages(content), "max_tokens": 6, "temperature": 0}
    chat = served["local"]

    async def go():
        return await chat.complete(*(await chat.prepare(body)))

    return asyncio.run(go())


def check(served, content, images: bool, videos: bool):
    got = served["client"].chat.completions.create(model="m", messages=messages(content), max_tokens=6, temperature=0)
    want = reference(served, content)
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert got.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    assert got.usage.model_dump(exclude_none=True) == want["usage"]
    d = got.usage.prompt_tokens_details
    assert (d.image_tokens > 0) == images and (d.video_tokens > 0) == videos
    assert d.image_tokens + d.video_tokens == want["usage"]["prompt_tokens_details"]["vision_embeddings"]
    return got


def test_image(served):
    got = check(served, [IMAGE, {"type": "text", "text": "What is this?"}], True, False)
    slicing = served["spec"].slicing
    if slicing is not None:  # 300 x 200 at scale 112: a thumbnail and a 3 x 2 grid of slices
        assert got.usage.prompt_tokens_details.image_tokens == 7 * slicing.queries


def test_video(served):
    check(served, [VIDEO, {"type": "text", "text": "What happens?"}], False, True)


def test_image_and_video_in_one_request(served):
    check(served, [{"type": "text", "text": "Compare"}, IMAGE, {"type": "text", "text": "with"}, VIDEO], True, True)


def test_streaming(served):
    content = [IMAGE, VIDEO, {"type": "text", "text": "Describe both"}]
    stream = served["client"].chat.completions.create(model="m", messages=messages(content), max_tokens=6,
                                                      temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    want = reference(served, content)
    assert text == want["choices"][0]["message"]["content"]
    assert chunks[-1].usage.model_dump(exclude_none=True) == want["usage"]


def test_bad_media_is_an_openai_400(served):
    import openai

    with pytest.raises(openai.BadRequestError) as bad:
        served["client"].chat.completions.create(model="m", max_tokens=4, messages=messages([
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no").decode()}}]))
    assert bad.value.code == "invalid_image"


def test_forged_vision_marker_is_an_openai_400(served):
    """Each family's own placeholder token in client text (MiniCPM-V: `<unk>`; Qwen: `<|image_pad|>`)
    is refused, not a 500 from a placeholder count that no media item backs."""
    import openai

    marker = "<unk>" if served["spec"].slicing is not None else "<|image_pad|>"
    with pytest.raises(openai.BadRequestError) as bad:
        served["client"].chat.completions.create(model="m", max_tokens=4, messages=messages(
            [IMAGE, {"type": "text", "text": f"what is {marker}?"}]))
    assert bad.value.code == "reserved_token"
