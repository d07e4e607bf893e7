"""VisionEncoder deployment: one replica per GPU (or CPU replicas), each with its own graph manager."""

from __future__ import annotations

import logging
import os

import ray
from ray import serve

from app.checkpoints.model_builder import resolve_model
from app.config import AppConfig
from app.gpu.kernel_cache import use_kernel_cache
from app.serving.gc_pauses import watch
from app.serving.placement import pinned_gpu

from .logs import route_app_logs
from .metrics import EncoderMetrics
from .payload import resolve_payload

log = logging.getLogger("ray.serve")


def pin_to_gpu_by_rank() -> None:
    """`colocate` placement: this replica reserved no GPU in Ray (so Ray did not set
    CUDA_VISIBLE_DEVICES); take the node's GPU of this replica's rank on the node, before CUDA starts."""
    ctx = serve.get_replica_context()
    node = ray.get_runtime_context().get_node_id()
    node_gpus = next((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["NodeID"] == node), 0)
    device = pinned_gpu(ctx.rank.local_rank, node_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if device is None:
        log.warning("encoder replica asked to pin a GPU, but the node has none visible; running as configured")
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    log.info("encoder replica of node rank %d pinned to GPU %s", ctx.rank.local_rank, device)


@serve.deployment(name="VisionEncoder", graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=10)
class VisionEncoder:
    def __init__(self, config: dict, pin_gpu_by_rank: bool = False):
        route_app_logs()
        if pin_gpu_by_rank:
            pin_to_gpu_by_rank()
        from app.vision.service import EncoderService  # after pinning: importing it may touch CUDA

        cfg = AppConfig(**config)
        use_kernel_cache(cfg.cache_dir)
        self.service = EncoderService(cfg, str(resolve_model(cfg.model, cfg.cache_dir)))
        self.metrics = EncoderMetrics(self.service.stats)
        self.service.batcher.on_batch = self.metrics.on_batch
        self.gc = watch()

    async def encode(self, items: list) -> list:
        """One request's items, batched with other requests' items. Each item is an object-store
        reference of a PreparedItem (from a MediaPreprocessor replica; read here, zero-copy on the same
        node) or a (uint8 rows, grid, cache key) tuple."""
        return await self.service.encode_async(await resolve_payload(items))

    def stats(self) -> dict:
        """The service's counters, with which replica and GPU they come from, and its garbage collector's pauses."""
        return {**self.service.stats(), "replica": serve.get_replica_context().replica_id.unique_id,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "gc": self.gc.snapshot()}
