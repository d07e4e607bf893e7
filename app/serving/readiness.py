"""When the application may say it is ready (`GET /health`; docs/guides/autoscaling.md says more).

Ready means, the first time, that every deployment with replicas has reached its target count, all of
them running (Serve marks a replica running once its constructor, warm-up included, returned): one was
not enough (first seconds' TTFT p99 1.87x warm, against 1.21x; H200, 2026-11-27). Once the app has
served, one running replica per deployment keeps it ready through rolling updates and scale-ups. "Has
served" (`has_served`) is read from Serve's state, so that a Router started during a rolling update
answers as its elders do: a replica, live or recently stopped, that started before the last deploy, or a
deployment UNHEALTHY (mostly a settled one whose replicas failed; also a controller error, or a failed
autoscaling step of a first deploy: lenient early). Where the state cannot show it (`serve.run` from
Python keeps `last_deployed_time_s`), a Router's own memory of having seen the app ready
(`ReadinessProbe.was_ready`) still counts."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class AppState:
    """What readiness reads from Ray Serve: each deployment's (status, replicas counted by state), when the
    application was last deployed (Serve's `last_deployed_time_s`, 0: unknown) and when its replicas, live
    and recently stopped, started (Serve's `start_time_s`, 0 for one not started yet)."""

    deployments: dict[str, tuple[str, dict[str, int]]]
    last_deployed_s: float = 0.0
    replica_starts: tuple[float, ...] = ()


def has_served(state: AppState) -> bool:
    """Whether Serve's state shows that the application ran before its present change (see the module's
    docstring): a replica that started before the last deploy, or a deployment UNHEALTHY."""
    if any(status == "UNHEALTHY" for status, _ in state.deployments.values()):
        return True
    return any(0 < t < state.last_deployed_s for t in state.replica_starts)


def app_ready(state: AppState, was_ready: bool = False) -> tuple[bool, dict[str, str]]:
    """(ready, per deployment "running/total status"): every deployment settled with its replicas running,
    or, once the application has served (`has_served`, or `was_ready`: this Router saw it ready), one
    replica running per deployment."""
    ready, shown = deployments_ready(state.deployments, whole=True)
    if not ready and deployments_ready(state.deployments, whole=False)[0]:
        ready = was_ready or has_served(state)
    return ready, shown


class ReadinessProbe:
    """The application's readiness (`app_ready`), read from Ray Serve's controller at most once per `ttl_s`.
    `read_states` gives an AppState (or only the deployments' dict, which shows no history)."""

    def __init__(self, read_states: Callable[[], AppState | dict[str, tuple[str, dict[str, int]]]],
                 ttl_s: float = 1.0):
        self.read_states, self.ttl_s = read_states, ttl_s
        self._at, self._last, self.was_ready = float("-inf"), (False, {}), False

    def __call__(self) -> tuple[bool, dict[str, str]]:
        now = time.monotonic()
        if now - self._at >= self.ttl_s:
            state = self.read_states()
            if not isinstance(state, AppState):
                state = AppState(state)
            self._last = app_ready(state, self.was_ready)
            self.was_ready = self.was_ready or self._last[0]
            self._at = now
        return self._last


def _name(v) -> str:
    return str(getattr(v, "value", v))


def app_state(app) -> AppState:
    """An AppState from Serve's details of one application (`ray.serve.schema.ApplicationDetails`: its
    `last_deployed_time_s`, and per deployment its `status`, its live `replicas` and its
    `recent_dead_replicas`, each with a `state` and a `start_time_s`)."""
    deployments, starts = {}, []
    for dep, d in app.deployments.items():
        deployments[dep] = (_name(d.status), dict(Counter(_name(r.state) for r in d.replicas)))
        stopped = getattr(d, "recent_dead_replicas", None) or ()
        starts += [float(r.start_time_s or 0) for r in (*d.replicas, *stopped)]
    return AppState(deployments, float(app.last_deployed_time_s or 0), tuple(starts))


def serve_app_state(app_name: str) -> AppState:
    """`app_name`'s AppState (a call to Serve's controller: the details `serve.status()` itself reads and
    then reduces to counts)."""
    from ray import serve

    try:
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeInstanceDetails
    except ImportError:  # a Ray without them: the counts only, so no history (the Router's own memory holds)
        app = serve.status().applications[app_name]
        return AppState({dep: (_name(d.status), {_name(s): n for s, n in d.replica_states.items()})
                         for dep, d in app.deployments.items()}, float(app.last_deployed_time_s or 0))
    details = ServeInstanceDetails(**_get_global_client().get_serve_details())
    return app_state(details.applications[app_name])


def serve_replica_states(app_name: str) -> dict[str, tuple[str, dict[str, int]]]:
    """Each deployment of `app_name`: its status and its replicas counted by state (a call to Serve's
    controller)."""
    return serve_app_state(app_name).deployments
