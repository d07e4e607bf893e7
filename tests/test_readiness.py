"""Ready means ready: /health answers 200 only once every deployment with replicas has one running."""

from __future__ import annotations

from app.serving.readiness import ReadinessProbe, deployments_ready


def test_ready_only_when_every_deployment_with_replicas_has_one_running():
    starting = {"Router": {"RUNNING": 2}, "MediaPreprocessor": {"RUNNING": 4}, "LLM": {"STARTING": 1},
                "VisionEncoder": {}}
    assert deployments_ready(starting) == (False, {"Router": "2/2", "MediaPreprocessor": "4/4", "LLM": "0/1",
                                                   "VisionEncoder": "0/0"})
    running = starting | {"LLM": {"RUNNING": 1}}
    assert deployments_ready(running)[0]  # the fused placement's dormant encoder does not count
    scaling_up = running | {"LLM": {"RUNNING": 1, "STARTING": 3}}
    assert deployments_ready(scaling_up)[0]  # replicas already running keep it ready
    replaced = running | {"LLM": {"STOPPING": 1, "STARTING": 1}}
    assert not deployments_ready(replaced)[0]  # the only LLM replica died: not ready until its successor runs


def test_the_probe_asks_the_controller_at_most_once_per_ttl():
    calls = []

    def read():
        calls.append(1)
        return {"LLM": {"RUNNING": 1}} if len(calls) > 1 else {"LLM": {"STARTING": 1}}

    probe = ReadinessProbe(read, ttl_s=3600)
    assert probe()[0] is False and probe()[0] is False and len(calls) == 1
    probe.ttl_s = 0
    assert probe()[0] is True and len(calls) == 2
