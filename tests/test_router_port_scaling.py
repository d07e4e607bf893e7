"""The Routers scale on the requests that come in on their own shared port (router_http_port), which
never pass through Ray Serve: started from serve_config.yaml as `serve run` starts it, on the CPU. Each
Router reports its port's requests in flight (`record_autoscaling_stats`) and
app.serving.autoscaling:RouterAutoscalingPolicy adds them to Serve's count; with Serve's own policy the Routers
would see no load at all here and stay at one replica. A Router added so opens its port only once it is
Serve's replica and has warmed itself: new connections all through its start get 200s, and its log says
what its warm-up sent."""

from __future__ import annotations

import re
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml
from test_scaling import FAST_METRICS, LongStreams, running_replicas, wait_for

from served import deployed

pytestmark = pytest.mark.integration
PORT, DIRECT_PORT = 8785, 8786
ROOT = Path(__file__).resolve().parent.parent
ROUTER_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0,
                      "downscale_delay_s": 2, "look_back_period_s": 2, "metrics_interval_s": 0.5,
                      "policy": {"policy_function": "app.serving.autoscaling:RouterAutoscalingPolicy"}}


def port_config(model_cache: str) -> dict:
    """serve_config.yaml with the Routers' shared port on, a Router that scales 1-2 at 2 requests each,
    and one replica of everything else (fused: the tower inside the LLM replica)."""
    conf = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    conf["http_options"] = {"host": "127.0.0.1", "port": PORT}
    app = conf["applications"][0]
    app["args"].update({"cache_dir": model_cache, "router_http_port": DIRECT_PORT, "router_http_host": "127.0.0.1"})
    app["args"]["encoder"].update({"min_budget": 64, "max_budget": 1024})
    app["args"]["placement"].update({"policy": "fused", "num_cpus": 0.25})
    deployments = {d["name"]: d for d in app["deployments"]}
    # the file's Router entry names the policy itself: a listed autoscaling_config replaces the builder's
    assert deployments["Router"]["autoscaling_config"]["policy"] == ROUTER_AUTOSCALING["policy"]
    deployments["Router"]["autoscaling_config"] = ROUTER_AUTOSCALING
    deployments["MediaPreprocessor"]["autoscaling_config"].update({"min_replicas": 1, "max_replicas": 1})
    for name in ("Router", "MediaPreprocessor"):
        deployments[name]["ray_actor_options"] = {"num_cpus": 0.25}
    return conf


@pytest.fixture(scope="module")
def served(model_cache):
    pytest.importorskip("ray")
    # replica logs unbuffered: the test reads the new Router's warm-up line while the app runs
    with deployed(port_config(model_cache), env=FAST_METRICS | {"RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1"}) as client:
        yield client


class NewConnections:
    """GET /v1/models on a new connection each time, one after another until stopped: the kernel hands
    some of them to a Router whose port has just opened. Statuses counted; anything but 200 kept."""

    def __init__(self, port: int):
        self.url, self.stopping, self.ok, self.bad = f"http://127.0.0.1:{port}/v1/models", threading.Event(), 0, []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                resp = httpx.get(self.url, timeout=60)
                if resp.status_code == 200:
                    self.ok += 1
                else:
                    self.bad.append(f"{resp.status_code}: {resp.text[:200]}")
            except httpx.HTTPError as e:
                self.bad.append(repr(e))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join(60)


def router_warmups() -> list[tuple[int, int]]:
    """(requests, errors) of every Router warm-up the replicas' logs report."""
    import ray._private.worker as ray_worker

    logs = Path(ray_worker._global_node.get_logs_dir_path()) / "serve"
    found = []
    for f in logs.glob("replica_*Router*.log"):
        for m in re.finditer(r"Router warm-up: (\d+) requests in [\d.]+ s, (\d+) errors", f.read_text(errors="replace")):
            found.append((int(m.group(1)), int(m.group(2))))
    return found


def test_routers_scale_up_on_their_own_ports_load_and_back_down(served):
    assert running_replicas("Router") == 1
    before = router_warmups()  # the first Router warms itself too if it started after the LLM replica
    streams = LongStreams(DIRECT_PORT)  # on the shared port: Ray Serve never sees these requests
    with NewConnections(DIRECT_PORT) as probe:
        try:
            streams.start(6)
            # 6 streams against target_ongoing_requests 2: 3 Routers wanted, max_replicas caps it at 2
            wait_for(lambda: running_replicas("Router") == 2, 120, "a second Router")
            # and on until the new Router's port has opened (after its warm-up)
            wait_for(lambda: len(router_warmups()) > len(before), 120, "the new Router's warm-up in its log")
            n = probe.ok
            wait_for(lambda: probe.ok >= n + 20, 60, "more requests after the new port opened")
        finally:
            streams.stop()
    assert not streams.errors, streams.errors
    assert not probe.bad, (probe.ok, probe.bad[:5])  # no connection meets a Router before it is ready
    # the Router added under load warmed itself: two rounds of GET /v1/models and five chat requests
    assert Counter(router_warmups()) - Counter(before) == Counter({(12, 0): 1}), (before, router_warmups())
    wait_for(lambda: running_replicas("Router") == 1, 120, "the Routers scaled back to one")
    # the remaining Router still answers on the shared port, and so does the proxy
    for port in (DIRECT_PORT, PORT):
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert resp.status_code == 200, resp.text
