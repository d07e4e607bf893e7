"""MediaPreprocessor deployment: fetch, decode, resize, patchify and cache key for one media item,
off the ingress's GIL. CPU only, autoscaled on its own (`autoscaling_config` in serve_config.yaml).
The item goes back as the call's return value: see app/media/remote.py for who serialises what."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ray import serve

from app.config import AppConfig
from app.media.pipeline import MediaPipeline, PreparedItem
from app.media.preprocess import PatchSpec
from app.media.ref import MediaRef
from app.model_builder import resolve_model

from .logs import route_app_logs


@serve.deployment(name="MediaPreprocessor", graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=2)
class MediaPreprocessor:
    def __init__(self, config: dict):
        route_app_logs()
        cfg = AppConfig(**config)
        spec = PatchSpec.from_checkpoint(resolve_model(cfg.model, cfg.cache_dir))
        pool = ThreadPoolExecutor(max_workers=cfg.media.worker_threads, thread_name_prefix="media")
        self.pipeline = MediaPipeline(cfg.media, spec, pool)

    async def prepare(self, ref: MediaRef) -> PreparedItem:
        return await self.pipeline.prepare(ref)
