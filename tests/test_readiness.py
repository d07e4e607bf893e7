"""Ready means ready: /health answers 200 the first time only once every deployment with replicas runs its
whole target, and afterwards while each still has one replica running."""

from __future__ import annotations

from app.serving.readiness import ReadinessProbe, deployments_ready, serving_without


def test_first_ready_needs_every_deployment_settled_with_its_replicas_running():
    starting = {"Router": ("HEALTHY", {"RUNNING": 2}), "MediaPreprocessor": ("HEALTHY", {"RUNNING": 4}),
                "LLM": ("UPDATING", {"STARTING": 2}), "VisionEncoder": ("HEALTHY", {})}
    assert deployments_ready(starting) == (False, {"Router": "2/2 HEALTHY", "MediaPreprocessor": "4/4 HEALTHY",
                                                   "LLM": "0/2 UPDATING", "VisionEncoder": "0/0 HEALTHY"})
    half = starting | {"LLM": ("UPDATING", {"RUNNING": 1, "STARTING": 1})}
    assert not deployments_ready(half)[0]  # its sibling still captures graphs on the same GPU
    assert deployments_ready(half, whole=False)[0]  # but one running replica keeps a ready app ready
    running = starting | {"LLM": ("HEALTHY", {"RUNNING": 2})}
    assert deployments_ready(running)[0]  # the fused placement's dormant encoder does not count
    scaling_up = running | {"LLM": ("UPSCALING", {"RUNNING": 2, "STARTING": 2})}
    assert deployments_ready(scaling_up)[0]  # autoscaling's new replicas join Serve's routing once running
    failing = running | {"LLM": ("DEPLOY_FAILED", {"RUNNING": 1})}
    assert not deployments_ready(failing)[0] and deployments_ready(failing, whole=False)[0]
    replaced = running | {"LLM": ("UPDATING", {"STOPPING": 1, "STARTING": 1})}
    assert not deployments_ready(replaced, whole=False)[0]  # no LLM replica left: not ready until one runs
    # every LLM replica failed to start and Serve drained the deployment to none: not ready, whatever came before
    given_up = running | {"LLM": ("DEPLOY_FAILED", {})}
    assert not deployments_ready(given_up)[0] and not deployments_ready(given_up, whole=False)[0]
    assert not deployments_ready(running | {"LLM": ("UNHEALTHY", {})}, whole=False)[0]


def test_a_router_joins_a_serving_app_when_every_other_deployment_has_a_replica_running():
    first_deploy = {"Router": ("UPDATING", {"STARTING": 3}), "MediaPreprocessor": ("HEALTHY", {"RUNNING": 4}),
                    "LLM": ("UPDATING", {"STARTING": 2}), "VisionEncoder": ("HEALTHY", {})}
    assert not serving_without(first_deploy, "Router")  # no LLM yet: the app's readiness covers the Routers
    scale_up = first_deploy | {"Router": ("UPSCALING", {"RUNNING": 3, "STARTING": 1}),
                               "LLM": ("HEALTHY", {"RUNNING": 2})}
    assert serving_without(scale_up, "Router")
    # the only Router replaced: the others serve, so the new one warms itself too
    assert serving_without(scale_up | {"Router": ("UPDATING", {"STARTING": 1})}, "Router")
    assert not serving_without(scale_up | {"LLM": ("UPDATING", {"STOPPING": 2})}, "Router")


def test_the_probe_latches_after_the_first_whole_readiness_and_asks_at_most_once_per_ttl():
    answers = iter([{"LLM": ("UPDATING", {"RUNNING": 1, "STARTING": 1})},
                    {"LLM": ("HEALTHY", {"RUNNING": 2})},
                    {"LLM": ("UPDATING", {"RUNNING": 1, "STARTING": 1})},  # a rolling update: still ready
                    {"LLM": ("UPDATING", {"STARTING": 2})}])
    calls = []

    def read():
        calls.append(1)
        return next(answers)

    probe = ReadinessProbe(read, ttl_s=3600)
    assert probe()[0] is False and probe()[0] is False and len(calls) == 1
    probe.ttl_s = 0
    assert [probe()[0] for _ in range(3)] == [True, True, False] and len(calls) == 4
