"""The followers of a tensor-parallel LLM replica: Ray actors in the replica's own placement group.

The LLM deployment reserves `placement.llm_tensor_parallel` bundles (STRICT_PACK: one node) per
replica, as Ray Serve LLM places vLLM's workers; the replica is rank 0 in bundle 0 and starts one
`LLMFollower` per other bundle. The followers are owned by the replica: if it dies, they die with
it, and its health check fails when one of them is gone, so Serve replaces the whole group.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from app.config import AppConfig
from app.gpu.kernel_cache import use_kernel_cache
from app.llm.loader import resolve_dtype
from app.llm.spec import TextSpec
from app.serving.fused import gemv_tune_dir
from app.serving.tensor_parallel import Rendezvous, free_address, join
from app.vision.service import pick_device

log = logging.getLogger(__name__)


def _rank_setup(cfg: AppConfig, checkpoint: str, rv: Rendezvous, rank: int):
    import torch

    device = torch.device(pick_device(cfg.device))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    spec = TextSpec.from_config(json.loads((Path(checkpoint) / "config.json").read_text()))
    return join(rv, rank, device, spec, resolve_dtype(cfg.llm.dtype, device))


@ray.remote
class LLMFollower:
    """Rank `rank` of a replica: its share of the model, stepping as rank 0's engine says."""

    def __init__(self, config: dict, checkpoint: str, rv: Rendezvous, rank: int):
        from app.llm.engine import Engine

        cfg = AppConfig(**config)
        use_kernel_cache(cfg.cache_dir)
        tp, channel = _rank_setup(cfg, checkpoint, rv, rank)
        self.engine = Engine(checkpoint, pick_device(cfg.device), cfg.llm, tp=tp, lockstep=channel,
                             tune_dir=gemv_tune_dir(cfg))

    def alive(self) -> bool:
        return self.engine.alive


def start_group(cfg: AppConfig, checkpoint: str) -> tuple[dict, list]:
    """In the LLM replica (rank 0): start the followers in the other bundles of this replica's placement
    group, join them, and return the engine keywords for rank 0 and the follower handles."""
    size = cfg.placement.llm_tensor_parallel
    pg = get_current_placement_group()
    if pg is None:
        raise RuntimeError(f"placement.llm_tensor_parallel {size} needs the LLM deployment's placement group "
                           "(placement_group_bundles); start the application through deployments.app")
    rv = Rendezvous(free_address(ray.util.get_node_ip_address()), size, cfg.llm.moe_parallel, cfg.llm.tp_all_reduce)
    bundle = pg.bundle_specs[1] if len(pg.bundle_specs) > 1 else {}
    group = uuid.uuid4().hex[:8]
    followers = [LLMFollower.options(
        name=f"llm-follower-{group}-{rank}", num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank),
    ).remote(cfg.model_dump(), checkpoint, rv, rank) for rank in range(1, size)]
    tp, channel = _rank_setup(cfg, checkpoint, rv, 0)  # meets the followers' joins
    log.info("tensor-parallel group of %d ranks joined at %s", size, rv.address)
    return {"tp": tp, "lockstep": channel}, followers


def followers_alive(followers: list, timeout_s: float = 10.0) -> None:
    """Raise if a follower is gone or its engine thread has stopped (the replica's health check)."""
    if followers and not all(ray.get([f.alive.remote() for f in followers], timeout=timeout_s)):
        raise RuntimeError("a tensor-parallel follower's engine has stopped")
