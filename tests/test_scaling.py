"""The application started the way `serve run serve_config.yaml` starts it (the repository's config file,
deployed through Ray Serve's config path), on the CPU: the config file's deployment options are
honoured, the LLM scales up under load (the new replica warmed up before its first request) and back
down, requests go to the least-loaded LLM replica, and the official `openai` client works against it.
Ray is told the machine has 2 GPUs (it has none: replicas still run on the CPU), so that the
`colocate` placement runs as on a 2-GPU node."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from helpers import png_bytes
from served import deployed

pytestmark = pytest.mark.integration
PORT = 8775
ROOT = Path(__file__).resolve().parent.parent
# Autoscaling metrics every 0.5 s instead of 10 s, so that the test scales within seconds.
FAST_METRICS = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}
LLM_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0,
                   "downscale_delay_s": 2, "look_back_period_s": 2, "metrics_interval_s": 0.5,
                   "policy": {"policy_function": "app.serving.autoscaling:LLMAutoscalingPolicy",
                              "policy_kwargs": {"target_kv_usage": 0.8}}}


def scaling_config():
    """serve_config.yaml with the test's model cache and small limits; the LLM autoscales (1-2 replicas)
    and the CPU deployments stay at one replica each, so that two LLM replicas fit 2 CPUs."""
    conf = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    conf["http_options"] = {"host": "127.0.0.1", "port": PORT}
    app = conf["applications"][0]
    app["args"]["encoder"].update({"min_budget": 64, "max_budget": 1024})
    app["args"]["llm"].update({"max_model_len": 8192})
    app["args"]["placement"].update({"policy": "colocate", "num_cpus": 0.25})
    app["args"]["warmup"] = True  # as on GPUs: a replica added under load must be warm before it is routed
    deployments = {d["name"]: d for d in app["deployments"]}
    for name in ("Router", "MediaPreprocessor"):
        deployments[name]["autoscaling_config"].update({"min_replicas": 1, "max_replicas": 1})
        deployments[name]["ray_actor_options"] = {"num_cpus": 0.25}
    deployments["LLM"]["autoscaling_config"] = LLM_AUTOSCALING
    return conf


@pytest.fixture(scope="module")
def served(model_cache):
    pytest.importorskip("ray")
    conf = scaling_config()
    conf["applications"][0]["args"]["cache_dir"] = model_cache
    with deployed(conf, num_gpus=2, env=FAST_METRICS) as client:
        with httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=120) as http:
            yield http, client


def running_replicas(deployment: str) -> int:
    from ray import serve

    return serve.status().applications["vlm"].deployments[deployment].replica_states.get("RUNNING", 0)


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def image_part(seed: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(64, 64, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_the_config_files_deployment_options_are_honoured(served):
    _, client = served
    deployments = client.get_serve_details()["applications"]["vlm"]["deployments"]
    assert set(deployments) == {"Router", "MediaPreprocessor", "VisionEncoder", "LLM"}
    llm = deployments["LLM"]["deployment_config"]
    # listed in the file: replaces the builder's fixed replica count
    assert llm["autoscaling_config"]["max_replicas"] == 2
    assert llm["autoscaling_config"]["policy"]["policy_function"] == "app.serving.autoscaling:LLMAutoscalingPolicy"
    # not listed: the builder's values stay (its request router, its CPU share)
    assert llm["request_router_config"]["request_router_class"] == "deployments.routing:LeastLoadedRouter"
    opts = dict(llm["ray_actor_options"])
    # no runtime_env (it would start a fresh worker for each replica): the cluster's environment runs the
    # replicas' code on Ray Serve's own loop (tests/test_integration.py checks that part)
    assert opts.get("runtime_env") in (None, {})
    opts.pop("runtime_env", None)
    assert opts == {"num_cpus": 0.25, "num_gpus": 1.0} and llm["max_ongoing_requests"] == 128
    media = deployments["MediaPreprocessor"]["deployment_config"]
    assert media["ray_actor_options"]["num_cpus"] == 0.25 and media["autoscaling_config"]["max_replicas"] == 1
    assert running_replicas("LLM") == 1


def test_colocate_puts_an_encoder_on_every_gpu(served):
    http, client = served
    encoder = client.get_serve_details()["applications"]["vlm"]["deployments"]["VisionEncoder"]["deployment_config"]
    assert encoder["num_replicas"] == 2 and encoder["ray_actor_options"]["num_gpus"] == 0
    stats = http.get("/v1/encoder/stats").json()
    # each encoder reserved no GPU in Ray and pinned itself to the GPU of its rank on the node
    assert stats["num_replicas"] == 2 and {r["cuda_visible_devices"] for r in stats["replicas"]} == {"0", "1"}


def test_openai_client_streams_and_gets_openai_errors(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": [image_part(1), {"type": "text", "text": "What is this?"}]}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens_details.image_tokens > 0
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and chunks[-1].usage.total_tokens == full.usage.total_tokens
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no").decode()}}]}])
    assert bad.value.code == "invalid_image"


class LongStreams:
    """Clients that each keep a long streamed answer open against `port`, one after another, until
    `stop()`; a status other than 200, or a stream that breaks, ends that client and is kept in `errors`.
    The clients are tasks on one event loop of their own, so `stop()` cancels each at once, wherever it
    waits: a request queued behind the others waits for its first byte, and a blocking client's read
    there could only end at its timeout (stop() joined each such thread for 30 s, 2026-12-02)."""

    BODY = {"messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 8000, "temperature": 0,
            "stream": True, "ignore_eos": True}

    def __init__(self, port: int):
        self.port, self.errors, self.tasks = port, [], []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="long-streams")
        self.thread.start()

    def start(self, n: int) -> None:
        async def spawn() -> None:
            self.tasks += [asyncio.create_task(self._client()) for _ in range(n)]

        asyncio.run_coroutine_threadsafe(spawn(), self.loop).result(10)

    def stop(self) -> None:
        """Cancel every client on its loop and wait until each has closed its connection (the server then
        lets its request go), then stop and close the loop. An exception other than the cancellation
        is kept in `errors`."""
        async def cancel() -> None:
            for t in self.tasks:
                t.cancel()
            for outcome in await asyncio.gather(*self.tasks, return_exceptions=True):
                if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                    self.errors.append(repr(outcome))

        try:
            asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.loop.close()

    async def _client(self) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=120) as c:
            while True:
                try:
                    async with c.stream("POST", "/v1/chat/completions", json=self.BODY) as resp:
                        if resp.status_code != 200:
                            self.errors.append(resp.status_code)
                            return
                        async for _ in resp.aiter_lines():
                            pass
                except httpx.HTTPError as e:  # a stream that broke or stalled (cancellation is not one)
                    self.errors.append(repr(e))
                    return


def test_llm_scales_up_under_load_routes_to_the_idle_replica_and_scales_back_down(served):
    http, _ = served
    streams = LongStreams(PORT)
    try:
        streams.start(6)
        # 6 streams against target_ongoing_requests 2: the autoscaler asks for 3, max_replicas caps it at 2
        wait_for(lambda: running_replicas("LLM") == 2, 120, "a second LLM replica")
        streams.start(3)
        # the new replica has nothing in flight: the least-loaded router sends it the new streams
        per_replica = wait_for(lambda: (lambda r: r if len(r) == 2 and all(x["running"] for x in r) else None)(
            http.get("/v1/llm/load").json()["replicas"]), 60, "streams on both LLM replicas")
        assert sum(r["running"] + r["waiting"] for r in per_replica) >= 6
        # each LLM replica reserved a whole GPU, so Ray gave them different ones
        assert {r["cuda_visible_devices"] for r in per_replica} == {"0", "1"}
        # the replica added under load warmed up first and took its first request only once ready
        assert all(r["warmed"] for r in per_replica)
        assert all(r["first_request_at"] >= r["ready_at"] for r in per_replica), per_replica
    finally:
        streams.stop()
    assert not streams.errors, streams.errors
    wait_for(lambda: running_replicas("LLM") == 1, 120, "the LLM scaled back to one replica")
    wait_for(lambda: http.get("/v1/llm/load").json()["running"] == 0, 30, "every stream cancelled")
    resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [image_part(2)]}],
                                                   "max_tokens": 4})
    assert resp.status_code == 200, resp.text
