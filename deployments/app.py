"""Application builder imported by serve_config.yaml: validates args, places replicas, wires handles.

The options set here are defaults. A config file's `deployments:` entry replaces them key by key
(Ray 2.60, `override_deployment_info`): a listed `autoscaling_config`, `ray_actor_options` or
`request_router_config` replaces the builder's whole value (no field-by-field merge), and an
`autoscaling_config` wins over the builder's `num_replicas`. So:
- Router and MediaPreprocessor get an `autoscaling_config` here (applications built from Python
  autoscale too), whose floor follows the GPUs (`replica_floor`); pin their count from a config file
  with `min_replicas` = `max_replicas` (a bare `num_replicas` there is ignored while an
  `autoscaling_config` exists).
- VisionEncoder and LLM get `num_replicas` and GPU shares from the placement policy
  (app/serving/placement.py); a config file may give either an `autoscaling_config` or a `num_replicas`.
  Listing `ray_actor_options` for them drops the builder's GPU shares.
- Router and LLM get the same `graceful_shutdown_timeout_s`, long enough for an answer of
  `llm.default_max_tokens` tokens (app/serving/shutdown.py); a config file that sets it for one should set
  it for the other.
- Under `fused` the VisionEncoder deployment is still part of the application (so that a config file
  listing it stays valid) but runs no replica: the LLM replicas encode. Ray Serve refuses
  `num_replicas=0`, so it gets an autoscaling range of 0 to 1 starting at 0, and no caller ever sends
  it a request that would scale it up.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError
from ray import serve
from ray.serve.config import RequestRouterConfig

from app.checkpoints.model_builder import resolve_model
from app.config import AppConfig
from app.serving.autoscaling import AUTOSCALING_METRICS_INTERVAL_S
from app.serving.cluster import NodeResources, live_nodes, media_ceiling
from app.serving.cluster import replica_floor as nodes_replica_floor
from app.serving.placement import Plan, llm_memory_share, plan
from app.serving.shutdown import answer_grace_s

from .encoder import VisionEncoder
from .llm import LLM
from .media import MediaPreprocessor
from .router import Router

log = logging.getLogger("ray.serve")

LLM_REQUEST_ROUTER = "deployments.routing:LeastLoadedRouter"
# counts the requests on the Routers' own port as well (router_http_port); Serve's rule otherwise
ROUTER_AUTOSCALING_POLICY = "app.serving.autoscaling:RouterAutoscalingPolicy"
ROUTING_STATS_PERIOD_S = 1.0  # how fresh the LLM replicas' load reports are (Ray's default: 10 s)


def node_gpus() -> list[int]:
    """GPUs of each live node of the Ray cluster ([] outside Ray): tensor-parallel groups stay on one node."""
    import ray

    if not ray.is_initialized():
        return []
    return [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]


def node_resources() -> list[NodeResources]:
    """GPUs and CPUs of each live node ([] outside Ray): the Routers' and media replicas' floors follow them."""
    import ray

    return live_nodes(ray.nodes()) if ray.is_initialized() else []


def cluster_resources() -> tuple[int, float]:
    """(GPUs, CPUs) of the Ray cluster this builder runs in; (0, 0) outside Ray."""
    import ray

    if not ray.is_initialized():
        return 0, 0.0
    res = ray.cluster_resources()
    return int(res.get("GPU", 0)), float(res.get("CPU", 0))


def llm_request_router() -> RequestRouterConfig:
    return RequestRouterConfig(request_router_class=LLM_REQUEST_ROUTER,
                               request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                               request_routing_stats_timeout_s=5 * ROUTING_STATS_PERIOD_S)


def deployment_options(cfg: AppConfig, gpus: int, cpus: float, per_node: list[int] | None = None,
                       nodes: list[NodeResources] | None = None) -> tuple[dict[str, dict], Plan]:
    """`.options()` per deployment name, and the placement plan behind them (`per_node`: each node's GPUs;
    `nodes`: each node's GPUs and CPUs, default one node of `gpus` and `cpus`)."""
    p = cfg.placement
    pl = plan(p, gpus, per_node)
    ongoing = p.max_ongoing_requests
    nodes = nodes or [NodeResources(gpus, cpus)]
    # each node's floor from its own GPUs and cores, summed (app/serving/cluster.py)
    routers = nodes_replica_floor(p.router_replicas_per_gpu, nodes)
    media = nodes_replica_floor(p.media_replicas_per_gpu, nodes)
    # half of each node's cores (one replica each); on GPUs at least twice the floor as well
    media_max = media_ceiling(nodes, media)
    opts = {
        "Router": {"max_ongoing_requests": ongoing, "ray_actor_options": {"num_cpus": p.router_num_cpus},
                   "autoscaling_config": {"min_replicas": routers, "max_replicas": max(4, 2 * routers),
                                          "target_ongoing_requests": 64,
                                          "metrics_interval_s": AUTOSCALING_METRICS_INTERVAL_S,
                                          "upscale_delay_s": 5, "downscale_delay_s": 60,
                                          "policy": {"policy_function": ROUTER_AUTOSCALING_POLICY}}},
        # 64, not fewer: a caller whose replicas are all at max_ongoing_requests retries with a backoff
        # (25, 50, 100 ... 500 ms in Ray 2.60), which cost ~90 ms per request at 64 concurrent
        # requests; items beyond the worker threads wait in the replica's own queue instead.
        "MediaPreprocessor": {"max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": p.media_num_cpus},
                              "autoscaling_config": {"min_replicas": media, "max_replicas": media_max,
                                                     "target_ongoing_requests": 2, "look_back_period_s": 15,
                                                     "metrics_interval_s": AUTOSCALING_METRICS_INTERVAL_S,
                                                     "upscale_delay_s": 3,
                                                     "downscale_delay_s": 120 if gpus > 0 else 60}},
        "VisionEncoder": {"num_replicas": pl.encoder_replicas, "max_ongoing_requests": ongoing,
                          "ray_actor_options": {"num_gpus": pl.encoder_num_gpus, "num_cpus": p.num_cpus}},
        "LLM": {"num_replicas": pl.llm_replicas, "max_ongoing_requests": ongoing,
                "ray_actor_options": {"num_gpus": pl.llm_num_gpus, "num_cpus": p.num_cpus},
                "request_router_config": llm_request_router()},
    }
    # a Router or LLM replica that is stopped lets a long answer finish, both alike (app/serving/shutdown.py)
    grace = answer_grace_s(cfg.llm.default_max_tokens)
    opts["Router"]["graceful_shutdown_timeout_s"] = opts["LLM"]["graceful_shutdown_timeout_s"] = grace
    if p.llm_tensor_parallel > 1:  # one bundle per rank, on one node; the replica itself takes the first
        bundle = {"CPU": p.num_cpus} | ({"GPU": 1} if gpus > 0 else {})
        opts["LLM"] |= {"placement_group_bundles": [bundle] * p.llm_tensor_parallel,
                        "placement_group_strategy": "STRICT_PACK"}
    if pl.fused:
        opts["VisionEncoder"] = dormant_encoder(opts["VisionEncoder"])
    return opts, pl


def replica_floor(per_gpu: int, gpus: int, cpus: float) -> int:
    """The replicas of a CPU deployment (Router, MediaPreprocessor) kept running: `per_gpu` for each GPU,
    at most a quarter of the cluster's cores (so the two floors together leave half of them to the
    LLM and encoder replicas), at least one, the floor without GPUs. The autoscaler adds replicas only
    after seconds of load (and each takes seconds to start), so a floor that follows the GPUs serves a
    burst at once. Under load the Routers' Python threads, not the GPUs, capped two GPUs: two Routers
    served 1.31x one GPU, six 1.73x (benchmarks/RESULTS.md). Media costs about 12 ms of CPU per request:
    on four H200s four media replicas served 500.76 req/s (the GPUs 71-74% busy), twelve 764.88."""
    return nodes_replica_floor(per_gpu, [NodeResources(gpus, cpus)])  # one node; app/serving/cluster.py per node


def dormant_encoder(opts: dict) -> dict:
    """The `fused` placement's VisionEncoder options: no replica (see the module's docstring)."""
    opts = {k: v for k, v in opts.items() if k != "num_replicas"}
    return opts | {"autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}}


def warn_without_low_overhead_mode() -> bool:
    """Logs, and returns True, when this cluster's Ray Serve runs replicas' code on a thread of its own: Ray
    was started without deployments/ray_env.py's environment (`make serve` and the docs' commands set it),
    and the config files no longer ask for that part of it through a runtime_env, which would start a fresh
    worker for the builder and each replica."""
    from ray.serve._private import constants

    if not constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD:
        return False
    log.warning("Ray was started without Ray Serve's low-overhead mode: each replica's code runs on a thread "
                "of its own, which costs the Routers time per call. Start Ray with "
                "`env $(python -m deployments.ray_env) serve run ...` (what `make serve` does), or export those "
                "variables before `ray start` on every node (docs/guides/single-gpu.md)")
    return True


def build_app(args: dict):
    try:
        cfg = AppConfig(**(args or {}))
    except ValidationError as e:
        raise ValueError(f"invalid application config:\n{e}") from None
    resolve_model(cfg.model, cfg.cache_dir)  # fail fast, and build an embedded checkpoint once, here
    warn_without_low_overhead_mode()
    gpus, cpus = cluster_resources()
    if cfg.warmup is None:  # on where there are GPUs to warm (app/serving/warmup.py)
        cfg = cfg.model_copy(update={"warmup": gpus > 0})
    opts, pl = deployment_options(cfg, gpus, cpus, node_gpus(), node_resources())
    log.info("placement on %d GPUs: %s", gpus, pl.describe())
    config = cfg.model_dump()
    llm_config = cfg.model_copy(update={"llm": cfg.llm.model_copy(update={
        "gpu_memory_utilization": llm_memory_share(cfg.llm.gpu_memory_utilization, pl.llm_num_gpus)})}).model_dump()
    media = MediaPreprocessor.options(**opts["MediaPreprocessor"]).bind(config)
    encoder = VisionEncoder.options(**opts["VisionEncoder"]).bind(config, pl.encoder_pins_gpu)
    llm = LLM.options(**opts["LLM"]).bind(llm_config, pl.fused)
    return Router.options(**opts["Router"]).bind(config, media, encoder, llm, pl.fused)


def build(args: dict | None = None):
    """`serve.run(deployments.app.build({...}))` from Python."""
    return build_app(args or {})


__all__ = ["build_app", "build", "serve"]
