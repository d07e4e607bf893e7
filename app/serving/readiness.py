"""When the application may say it is ready (`GET /health`).

A Router answers HTTP as soon as it is up, while the LLM replicas may still be loading weights, capturing
graphs and warming up (app/serving/warmup.py). Ready means, the first time, that every deployment with
replicas has reached its target count, all of them running (Ray Serve marks a replica running only after
its constructor, warm-up included, returned). One running replica was not enough: its siblings were
still starting (graph capture on the same GPU, imports on the same cores) when load began, the likely
cause of the first seconds' TTFT p99 at up to 1.87x warm (H200, 2026-11-27); waiting for all of them,
the worst second was 1.21x. Once ready, a Router stays ready while every such deployment has one replica
running, so that rolling updates and scale-ups keep it in a load balancer's rotation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# A deployment's status once every replica of its target has started (UPDATING before; failing ones never)
SETTLED = frozenset({"HEALTHY", "UPSCALING", "DOWNSCALING"})
# A deployment Serve gave up on (every replica failed to start, and it drained them to none) or whose
# replicas keep failing: with none left it serves nothing, unlike one that has none by design (the `fused`
# placement's dormant VisionEncoder, HEALTHY at zero)
FAILED = frozenset({"DEPLOY_FAILED", "UNHEALTHY"})


def deployments_ready(deployments: dict[str, tuple[str, dict[str, int]]], whole: bool = True
                      ) -> tuple[bool, dict[str, str]]:
    """(ready, per deployment "running/total status") from each deployment's (status, replicas counted by
    state). `whole`: every deployment with replicas must also be settled at its target, not just have one
    running (the first readiness)."""
    ready, shown = True, {}
    for name, (status, states) in deployments.items():
        total = sum(states.values())
        running = states.get("RUNNING", 0)
        shown[name] = f"{running}/{total} {status}"
        if total and (not running or (whole and status not in SETTLED)):
            ready = False
        elif not total and status in FAILED:
            ready = False
    return ready, shown


def serving_without(deployments: dict[str, tuple[str, dict[str, int]]], name: str) -> bool:
    """Whether every deployment but `name` that has replicas has one running: a replica of `name` that
    starts now joins an app that already serves (a scale-up, a replacement), not a first deploy."""
    return deployments_ready({k: v for k, v in deployments.items() if k != name}, whole=False)[0]


class ReadinessProbe:
    """The application's readiness, read from Ray Serve's controller at most once per `ttl_s`: whole the
    first time, then one running replica per deployment."""

    def __init__(self, read_states: Callable[[], dict[str, tuple[str, dict[str, int]]]], ttl_s: float = 1.0):
        self.read_states, self.ttl_s = read_states, ttl_s
        self._at, self._last, self.was_ready = float("-inf"), (False, {}), False

    def __call__(self) -> tuple[bool, dict[str, str]]:
        now = time.monotonic()
        if now - self._at >= self.ttl_s:
            self._last = deployments_ready(self.read_states(), whole=not self.was_ready)
            self.was_ready = self.was_ready or self._last[0]
            self._at = now
        return self._last


def serve_replica_states(app_name: str) -> dict[str, tuple[str, dict[str, int]]]:
    """Each deployment of `app_name`: its status and its replicas counted by state (a call to Serve's
    controller)."""
    from ray import serve

    def name(v) -> str:
        return str(getattr(v, "value", v))

    app = serve.status().applications[app_name]
    return {dep: (name(d.status), {name(s): n for s, n in d.replica_states.items()})
            for dep, d in app.deployments.items()}
