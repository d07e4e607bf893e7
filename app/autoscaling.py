"""Autoscaling policy for the LLM deployment: requests in flight, and KV-cache use.

Ray Serve's default policy sizes a deployment by requests in flight per replica
(`target_ongoing_requests`). An LLM replica can be full well before that: a few long prompts fill
its KV cache, and the next requests wait or preempt. Replicas therefore also report `kv_usage`
(`record_autoscaling_stats` in deployments/llm.py), and this policy asks for enough replicas that
both hold:

    replicas >= requests in flight / target_ongoing_requests
    replicas >= sum of the replicas' KV use / target_kv_usage

Ray applies min/max_replicas, upscale/downscale delays and scaling factors around it (custom
policies are wrapped in the same rules as the default one). Reference it from an
`autoscaling_config` as `policy: {policy_function: app.autoscaling:LLMAutoscalingPolicy}`.
Ray pickles this module by value into its controller, so it imports nothing from the project.
"""

from __future__ import annotations

from collections.abc import Iterable


def desired_replicas(total_requests: float, target_requests: float, kv_usages: Iterable[float],
                     target_kv_usage: float) -> float:
    """Replicas that keep requests per replica at `target_requests` and KV use at `target_kv_usage`."""
    by_requests = total_requests / target_requests
    by_kv = sum(kv_usages) / target_kv_usage
    return max(by_requests, by_kv)


class LLMAutoscalingPolicy:
    """A class policy: Ray builds it once with `policy_kwargs` and calls it every control-loop tick."""

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
