"""VisionEncoder deployment: one replica per GPU (or CPU replicas), each with its own graph manager."""

from __future__ import annotations

from ray import serve

from app.config import AppConfig
from app.model_builder import resolve_model
from app.vision.service import EncoderService

from .logs import route_app_logs
from .metrics import EncoderMetrics


@serve.deployment(name="VisionEncoder", graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=2)
class VisionEncoder:
    def __init__(self, config: dict):
        route_app_logs()
        cfg = AppConfig(**config)
        self.service = EncoderService(cfg, str(resolve_model(cfg.model, cfg.cache_dir)))
        self.metrics = EncoderMetrics(self.service.stats)
        self.service.batcher.on_batch = self.metrics.on_batch

    async def encode(self, items: list) -> list:
        """Items (pixels, grid, cache key) of one request; batched with other requests' items."""
        return await self.service.encode_async(items)

    def stats(self) -> dict:
        return self.service.stats()
