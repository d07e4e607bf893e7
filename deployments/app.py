"""Application builder imported by serve_config.yaml: validates args, places replicas, wires handles."""

from __future__ import annotations

import logging

from pydantic import ValidationError
from ray import serve

from app.config import AppConfig
from app.model_builder import resolve_model

from .encoder import VisionEncoder
from .llm import LLM
from .router import Router

log = logging.getLogger("ray.serve")


def cluster_gpus() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0


def placement(cfg: AppConfig, gpus: int) -> tuple[dict, dict]:
    """Options for (VisionEncoder, LLM). Auto: one encoder replica per GPU; with one GPU the two share it."""
    p = cfg.placement
    if gpus == 0:
        enc_gpus, llm_gpus, replicas = 0.0, 0.0, 1
    elif gpus == 1:
        enc_gpus, llm_gpus, replicas = 0.5, 0.5, 1
    else:  # the LLM takes one GPU, every other GPU gets one encoder replica
        enc_gpus, llm_gpus, replicas = 1.0, 1.0, gpus - 1
    enc_gpus = enc_gpus if p.encoder_num_gpus == "auto" else p.encoder_num_gpus
    llm_gpus = llm_gpus if p.llm_num_gpus == "auto" else p.llm_num_gpus
    replicas = replicas if p.encoder_replicas == "auto" else p.encoder_replicas
    ongoing = p.max_ongoing_requests
    return ({"num_replicas": replicas, "max_ongoing_requests": ongoing,
             "ray_actor_options": {"num_gpus": enc_gpus, "num_cpus": p.num_cpus}},
            {"max_ongoing_requests": ongoing, "ray_actor_options": {"num_gpus": llm_gpus, "num_cpus": p.num_cpus}})


def build_app(args: dict):
    try:
        cfg = AppConfig(**(args or {}))
    except ValidationError as e:
        raise ValueError(f"invalid application config:\n{e}") from None
    resolve_model(cfg.model, cfg.cache_dir)  # fail fast, and build an embedded checkpoint once, here
    enc_opts, llm_opts = placement(cfg, cluster_gpus())
    log.info("placement: encoder %s, llm %s", enc_opts, llm_opts)
    config = cfg.model_dump()
    encoder = VisionEncoder.options(**enc_opts).bind(config)
    llm = LLM.options(**llm_opts).bind(config)
    return Router.options(max_ongoing_requests=cfg.placement.max_ongoing_requests).bind(config, encoder, llm)


def build(args: dict | None = None):
    """`serve.run(deployments.app.build({...}))` from Python."""
    return build_app(args or {})


__all__ = ["build_app", "build", "serve"]
