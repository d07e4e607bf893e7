"""When the application may say it is ready (`GET /health`).

A Router answers HTTP as soon as it is up, while the LLM replicas may still be loading weights,
capturing graphs and warming up (app/serving/warmup.py): a load balancer or client that trusted that answer
sent traffic to an application that could only queue or refuse it. Ready means every deployment that
has replicas has at least one running (Ray Serve marks a replica running only after its constructor,
warm-up included, has returned and its health check passed); a deployment kept at zero replicas (the
fused placement's VisionEncoder) does not count. During a rolling update or a scale-up the replicas
already running keep the application ready.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def deployments_ready(replica_states: dict[str, dict[str, int]]) -> tuple[bool, dict[str, str]]:
    """(ready, per deployment "running/total") from each deployment's replicas counted by state."""
    ready, shown = True, {}
    for name, states in replica_states.items():
        total = sum(states.values())
        running = states.get("RUNNING", 0)
        shown[name] = f"{running}/{total}"
        if total and not running:
            ready = False
    return ready, shown


class ReadinessProbe:
    """The application's readiness, read from Ray Serve's controller at most once per `ttl_s`."""

    def __init__(self, read_states: Callable[[], dict[str, dict[str, int]]], ttl_s: float = 1.0):
        self.read_states, self.ttl_s = read_states, ttl_s
        self._at, self._last = float("-inf"), (False, {})

    def __call__(self) -> tuple[bool, dict[str, str]]:
        now = time.monotonic()
        if now - self._at >= self.ttl_s:
            self._last = deployments_ready(self.read_states())
            self._at = now
        return self._last


def serve_replica_states(app_name: str) -> dict[str, dict[str, int]]:
    """Each deployment of `app_name`: its replicas counted by state (a call to Serve's controller)."""
    from ray import serve

    app = serve.status().applications[app_name]
    return {name: {str(getattr(s, "value", s)): n for s, n in d.replica_states.items()}
            for name, d in app.deployments.items()}
