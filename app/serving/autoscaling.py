"""Autoscaling policies: the LLM deployment's (requests in flight, and KV-cache use) and the Router's
(requests in flight, counting those that came in on the Routers' own port).

Ray Serve's default policy sizes a deployment by requests in flight per replica, which misses two
loads: an LLM replica whose KV cache a few long prompts have filled, and a Router's requests on its
shared port, which never pass through Ray Serve. Reference a policy from an `autoscaling_config` as
`policy: {policy_function: app.serving.autoscaling:LLMAutoscalingPolicy}` (or `RouterAutoscalingPolicy`); Ray
applies min/max_replicas, upscale/downscale delays and scaling factors around it, as around its own.
Ray pickles this module by value into its controller, so it imports nothing from the project.
"""

from __future__ import annotations

from collections.abc import Iterable

# How often handles and replicas push their requests in flight to the controller, as every autoscaling_config's
# `metrics_interval_s` (Ray 2.60 still reads that field, marked deprecated; default 10 s). The first decision
# waits for a push: a second LLM replica was asked for 9.6-10.2 s after load arrived at 10 s, 1.0-1.1 s at
# 1 s and 2.0-2.1 s at 2 s, whatever `look_back_period_s` (benchmarks/autoscale_reaction.py, CPU machine,
# 2026-12-02). The builder's autoscalers use it; set it in a config file's LLM autoscaling_config too.
AUTOSCALING_METRICS_INTERVAL_S = 1.0


def desired_replicas(total_requests: float, target_requests: float, kv_usages: Iterable[float],
                     target_kv_usage: float) -> float:
    """Replicas that keep requests per replica at `target_requests` and KV use at `target_kv_usage`."""
    by_requests = total_requests / target_requests
    by_kv = sum(kv_usages) / target_kv_usage
    return max(by_requests, by_kv)


class LLMAutoscalingPolicy:
    """A class policy: Ray builds it once with `policy_kwargs` and calls it every control-loop tick.

    An LLM replica can be full well before Ray's `target_ongoing_requests`: a few long prompts fill its
    KV cache, and the next requests wait or preempt. Replicas therefore also report `kv_usage`
    (`record_autoscaling_stats` in deployments/llm.py), and this policy asks for enough replicas that
    both hold:

        replicas >= requests in flight / target_ongoing_requests
        replicas >= sum of the replicas' KV use / target_kv_usage
    """

    def __init__(self, target_kv_usage: float = 0.8):
        if not 0 < target_kv_usage <= 1:
            raise ValueError("target_kv_usage must be in (0, 1]")
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx) -> tuple[float, dict]:
        if ctx.current_num_replicas == 0:  # nothing reports yet; Ray's cold-start path decides
            return ctx.target_num_replicas, {}
        kv = (ctx.aggregated_metrics or {}).get("kv_usage", {})
        desired = desired_replicas(ctx.total_num_requests, ctx.config.get_target_ongoing_requests(), kv.values(),
                                   self.target_kv_usage)
        return desired, {}


def router_desired_replicas(serve_requests: float, direct_requests: Iterable[float], target_requests: float) -> float:
    """Routers that keep requests per Router at `target_requests`, counting both Serve's requests and
    each Router's requests on its own port."""
    return (serve_requests + sum(direct_requests)) / target_requests


class RouterAutoscalingPolicy:
    """Ray Serve's request-count rule over all of a Router's requests, its shared port's included.

    The shared port (`router_http_port`, app/api/shared_port.py) takes requests that never pass through
    Ray Serve, so Serve's count of a Router's requests misses them. Each Router reports them as
    `direct_ongoing`, and this policy sizes the Routers on both counts together, with the same
    `target_ongoing_requests`."""

    def __call__(self, ctx) -> tuple[float, dict]:
        if ctx.current_num_replicas == 0:
            return ctx.target_num_replicas, {}
        direct = (ctx.aggregated_metrics or {}).get("direct_ongoing", {})
        return router_desired_replicas(ctx.total_num_requests, direct.values(),
                                       ctx.config.get_target_ongoing_requests()), {}
