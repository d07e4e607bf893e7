"""A tensor-parallel LLM replica served on Ray Serve (CPU, gloo) over HTTP with the official `openai`
client: the tiny Qwen3-VL-MoE split over two ranks (the replica and a follower actor in its placement
group) answers as the whole pipeline in one process with one unsplit engine does: text, an image,
streaming. Then a follower is killed: the replica's health check fails, Serve replaces the whole
group, and requests are answered again."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

from deployments.ray_env import apply_serve_env
from helpers import png_bytes

pytestmark = pytest.mark.integration
PORT = 8791
ARGS = {"model": "embedded:tiny-qwen3-vl-moe", "placement": {"llm_tensor_parallel": 2},
        "encoder": {"min_budget": 64, "max_budget": 1024, "batch_wait_ms": 5}}
IMAGE = {"type": "image_url",
         "image_url": {"url": "data:image/png;base64," + base64.b64encode(png_bytes(120, 160, 3)).decode()}}


@pytest.fixture(scope="module")
def served(model_cache):
    ray = pytest.importorskip("ray")
    openai = pytest.importorskip("openai")
    from ray import serve

    from app.checkpoints.model_builder import resolve_model
    from app.config import AppConfig
    from deployments.app import build_app
    from helpers import local_chat

    args = ARGS | {"cache_dir": model_cache}
    cfg = AppConfig(**args)
    local = local_chat(cfg.model_copy(update={"placement": cfg.placement.model_copy(
        update={"llm_tensor_parallel": 1})}), resolve_model(cfg.model, cfg.cache_dir))
    apply_serve_env()
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(args), name="vlm", route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield {"client": client, "local": local, "ray": ray}
    finally:
        serve.shutdown()
        ray.shutdown()


def _reference(served, content) -> dict:
    chat = served["local"]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}

    async def go():
        return await chat.complete(*(await chat.prepare(body)))

    return asyncio.run(go())


def _ask(served, content, **kw):
    return served["client"].chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                                    max_tokens=8, temperature=0, **kw)


@pytest.mark.parametrize("content", ["Tell me a story", [IMAGE, {"type": "text", "text": "What is this?"}]])
def test_a_two_rank_replica_answers_as_one_engine(served, content):
    got, want = _ask(served, content), _reference(served, content)
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert got.usage.model_dump(exclude_none=True) == want["usage"]


def test_streaming_from_a_two_rank_replica(served):
    content = [IMAGE, {"type": "text", "text": "Describe it."}]
    text = "".join(c.choices[0].delta.content or "" for c in _ask(served, content, stream=True) if c.choices)
    assert text == _reference(served, content)["choices"][0]["message"]["content"]


def test_a_dead_follower_takes_its_replica_down_and_serve_restores_the_group(served):
    ray = served["ray"]

    def followers():  # named by their group: a replaced group's follower has a new name
        return sorted((a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith("llm-follower-"))

    first = followers()
    assert len(first) == 1
    ray.kill(ray.get_actor(first[0][0], namespace=first[0][1]))
    deadline = time.time() + 240
    while time.time() < deadline:  # the health check (10 s period) fails, the group is replaced
        now = followers()
        if now and now != first:
            break
        time.sleep(2)
    else:
        pytest.fail("no new follower within 240 s")
    for _ in range(60):  # the new replica joins the routing once it is ready
        try:
            got = _ask(served, "Tell me a story")
            break
        except Exception:  # noqa: BLE001 - 503s while the replacement starts
            time.sleep(2)
    assert got.choices[0].message.content == _reference(served, "Tell me a story")["choices"][0]["message"]["content"]

