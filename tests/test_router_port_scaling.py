"""The Routers scale on the requests that come in on their own shared port (router_http_port), which
never pass through Ray Serve: started from serve_config.yaml as `serve run` starts it, on the CPU. Each
Router reports its port's requests in flight (`record_autoscaling_stats`) and
app.serving.autoscaling:RouterAutoscalingPolicy adds them to Serve's count; with Serve's own policy the Routers
would see no load at all here and stay at one replica."""

from __future__ import annotations

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
    with deployed(port_config(model_cache), env=FAST_METRICS) as client:
        yield client


def test_routers_scale_up_on_their_own_ports_load_and_back_down(served):
    assert running_replicas("Router") == 1
    streams = LongStreams(DIRECT_PORT)  # on the shared port: Ray Serve never sees these requests
    try:
        streams.start(6)
        # 6 streams against target_ongoing_requests 2: 3 Routers wanted, max_replicas caps it at 2
        wait_for(lambda: running_replicas("Router") == 2, 120, "a second Router")
    finally:
        streams.stop()
    assert not streams.errors, streams.errors
    wait_for(lambda: running_replicas("Router") == 1, 120, "the Routers scaled back to one")
    # the remaining Router still answers on the shared port, and so does the proxy
    for port in (DIRECT_PORT, PORT):
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert resp.status_code == 200, resp.text
