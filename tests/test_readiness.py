"""Ready means ready: /health answers 200 the first time only once every deployment with replicas runs its
whole target, and afterwards while each still has one replica running. "Afterwards" is read from Serve's
state, so a Router started during a rolling update answers as the Routers that saw the app ready."""

from __future__ import annotations

from enum import Enum
from types import SimpleNamespace

import pytest

from app.serving.readiness import (
    AppState,
    ReadinessProbe,
    app_ready,
    app_state,
    deployments_ready,
    has_served,
    serve_app_state,
    serving_without,
)


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


class _State(str, Enum):  # noqa: UP042 - as Serve's DeploymentStatus and ReplicaState: str() is not the value
    RUNNING = "RUNNING"
    STARTING = "STARTING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    UPDATING = "UPDATING"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"


def _replica(state: str, start: float):
    return SimpleNamespace(state=_State(state), start_time_s=start)


def _app(last_deployed: float, **deployments):
    """A fake of Serve's ApplicationDetails: per deployment (status, [(state, start)], [start of a stopped one])."""
    return SimpleNamespace(last_deployed_time_s=last_deployed, deployments={
        name: SimpleNamespace(status=_State(status), replicas=[_replica(st, t) for st, t in live],
                              recent_dead_replicas=[_replica("STOPPED", t) for t in dead])
        for name, (status, live, dead) in deployments.items()})


DEPLOYED = 1000.0  # the application's last deploy (Serve's last_deployed_time_s)


def test_a_router_started_during_a_rolling_update_answers_as_the_routers_that_saw_the_app_ready():
    """A rolling update after the app served (its replicas started at 100-110, the update deployed at 1000):
    a Router replica started now (a fresh probe) and one that saw the app ready give the same answers, state
    by state, including once every replica of before has stopped (Serve still lists the stopped ones)."""
    rollout = [
        # the new Routers start first while the LLM's old replicas still serve
        _app(DEPLOYED, Router=("UPDATING", [("RUNNING", 100), ("STARTING", 1001)], []),
             LLM=("UPDATING", [("RUNNING", 110), ("STOPPING", 110), ("STARTING", 1002)], [])),
        # the old Routers are gone; one old LLM replica left
        _app(DEPLOYED, Router=("HEALTHY", [("RUNNING", 1001), ("RUNNING", 1003)], [100, 100]),
             LLM=("UPDATING", [("RUNNING", 110), ("STARTING", 1002)], [110])),
        # every live replica is new, the LLM still half way: Serve's stopped replicas show the app served
        _app(DEPLOYED, Router=("HEALTHY", [("RUNNING", 1001), ("RUNNING", 1003)], [100, 100]),
             LLM=("UPDATING", [("RUNNING", 1002), ("STARTING", 1050)], [110, 110])),
        # no LLM replica running: not ready, whatever came before
        _app(DEPLOYED, Router=("HEALTHY", [("RUNNING", 1001), ("RUNNING", 1003)], [100, 100]),
             LLM=("UPDATING", [("STARTING", 1050), ("STARTING", 1051)], [110, 110, 1002])),
        _app(DEPLOYED, Router=("HEALTHY", [("RUNNING", 1001), ("RUNNING", 1003)], [100, 100]),
             LLM=("HEALTHY", [("RUNNING", 1050), ("RUNNING", 1051)], [110, 110, 1002])),
    ]
    states = [app_state(a) for a in rollout]
    assert states[0] == AppState({"Router": ("UPDATING", {"RUNNING": 1, "STARTING": 1}),
                                  "LLM": ("UPDATING", {"RUNNING": 1, "STOPPING": 1, "STARTING": 1})},
                                 DEPLOYED, (100.0, 1001.0, 110.0, 110.0, 1002.0))
    want = [True, True, True, False, True]
    assert [app_ready(s)[0] for s in states] == want  # a Router that never saw the app ready
    assert [app_ready(s, was_ready=True)[0] for s in states] == want  # one that did
    fresh, elder = ReadinessProbe(iter(states).__next__, ttl_s=0), ReadinessProbe(iter(states).__next__, ttl_s=0)
    elder.was_ready = True
    assert [fresh()[0] for _ in states] == [elder()[0] for _ in states] == want


def test_a_first_deploy_keeps_the_whole_target_rule_for_every_router():
    """On a first deploy every replica, live or failed, started after the deploy: half an LLM target running
    is not ready, nor is a replica Serve has not started yet (start time 0)."""
    half = _app(DEPLOYED, Router=("HEALTHY", [("RUNNING", 1001), ("RUNNING", 1002)], []),
                LLM=("UPDATING", [("RUNNING", 1003), ("STARTING", 1040)], [1004]))  # one failed to start, retried
    assert not has_served(app_state(half)) and app_ready(app_state(half)) == (
        False, {"Router": "2/2 HEALTHY", "LLM": "1/2 UPDATING"})
    unstarted = _app(DEPLOYED, Router=("HEALTHY", [("RUNNING", 1001)], []),
                     LLM=("UPDATING", [("RUNNING", 1003), ("STARTING", 0)], []))
    assert not app_ready(app_state(unstarted))[0]
    probe = ReadinessProbe(lambda: app_state(half), ttl_s=0)
    assert probe() == probe() and not probe()[0]
    whole = _app(DEPLOYED, Router=("HEALTHY", [("RUNNING", 1001), ("RUNNING", 1002)], []),
                 LLM=("HEALTHY", [("RUNNING", 1003), ("RUNNING", 1040)], [1004]))
    assert app_ready(app_state(whole))[0]


def test_a_deployment_unhealthy_shows_the_app_served():
    """Serve reaches UNHEALTHY from a settled deployment whose replicas then failed (a first deploy's
    failures read DEPLOY_FAILED): a Router added meanwhile answers as the others, ready while one runs."""
    failing = AppState({"Router": ("UPSCALING", {"RUNNING": 2, "STARTING": 1}),
                        "LLM": ("UNHEALTHY", {"RUNNING": 1, "STARTING": 1})}, DEPLOYED, (1001.0, 1002.0))
    assert has_served(failing) and app_ready(failing)[0] and app_ready(failing, was_ready=True)[0]
    gone = AppState(failing.deployments | {"LLM": ("UNHEALTHY", {"STARTING": 2})}, DEPLOYED)
    assert not app_ready(gone)[0] and not app_ready(gone, was_ready=True)[0]
    # a failed rolling update: the old replicas still serve, the app stays ready for every Router
    failed_update = AppState({"LLM": ("DEPLOY_FAILED", {"RUNNING": 1})}, DEPLOYED, (110.0,))
    assert app_ready(failed_update)[0]
    assert not app_ready(AppState({"LLM": ("DEPLOY_FAILED", {"RUNNING": 1})}, DEPLOYED, (1001.0,)))[0]


def test_the_app_state_is_read_from_serves_details(monkeypatch):
    """`serve_app_state` parses the controller's details as `serve.status()` does (Ray's own schema), with
    the replicas' start times, the stopped ones' included."""
    pytest.importorskip("ray")
    import ray.serve.context as context

    replicas = [{"replica_id": "a", "state": "RUNNING", "start_time_s": 110.0},
                {"replica_id": "b", "state": "STARTING", "start_time_s": 1002.0}]
    llm = {"name": "LLM", "status": "UPDATING", "status_trigger": "CONFIG_UPDATE_STARTED", "message": "",
           "deployment_config": {"name": "LLM"}, "target_num_replicas": 2, "required_resources": {},
           "replicas": replicas, "recent_dead_replicas": [{"replica_id": "c", "state": "STOPPED", "start_time_s": 105.0}]}
    details = {"proxies": {}, "applications": {"vlm": {
        "name": "vlm", "route_prefix": "/", "docs_path": None, "external_scaler_enabled": False,
        "status": "DEPLOYING", "message": "", "last_deployed_time_s": DEPLOYED, "source": "declarative",
        "deployments": {"LLM": llm}}}}
    monkeypatch.setattr(context, "_get_global_client", lambda: SimpleNamespace(get_serve_details=lambda: details))
    state = serve_app_state("vlm")
    assert state == AppState({"LLM": ("UPDATING", {"RUNNING": 1, "STARTING": 1})}, DEPLOYED, (110.0, 1002.0, 105.0))
    assert app_ready(state)[0]
