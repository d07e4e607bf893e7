"""MediaPreprocessor deployment: fetch, decode, resize, patchify and cache key for one media item,
off the ingress's GIL. CPU only, autoscaled on its own (`autoscaling_config` in serve_config.yaml).
The item goes back as the call's return value: see app/media/remote.py for who serialises what.

Every media guard lives here now, since this is where untrusted bytes are fetched and decoded: the
network policy and streamed byte cap of app/media/fetch.py, the header checks and per-item deadline
of app/media/pipeline.py, the worker-pool share of app/media/workers.py (items of one request,
named by the caller's request key, hold at most all but one worker of this replica), and the replica's
budget of payload bytes in flight (app/media/budget.py: past it, 503 `overloaded`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ray import serve

from app.checkpoints.model_builder import resolve_model
from app.config import AppConfig
from app.media.pipeline import MediaPipeline, PreparedItem
from app.media.ref import MediaRef
from app.media.spec import patch_spec_for
from app.media.workers import SharedSlots

from .logs import route_app_logs


@serve.deployment(name="MediaPreprocessor", graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=10)
class MediaPreprocessor:
    def __init__(self, config: dict):
        route_app_logs()
        cfg = AppConfig(**config)
        spec = patch_spec_for(resolve_model(cfg.model, cfg.cache_dir))
        pool = ThreadPoolExecutor(max_workers=cfg.media.worker_threads, thread_name_prefix="media")
        self.pipeline = MediaPipeline(cfg.media, spec, pool)
        self.slots = SharedSlots(pool)
        if cfg.warmup:  # the builder resolves None: on where the cluster has GPUs
            from app.serving.warmup import warm_media

            warm_media(self.pipeline)

    async def prepare(self, ref: MediaRef, request_key: str | None = None) -> PreparedItem:
        """A ClientError (bad, hostile or oversized media) reaches the caller inside Ray's RayTaskError."""
        slots = self.slots.acquire(request_key)
        try:
            return await self.pipeline.prepare(ref, slots)
        finally:
            self.slots.release(request_key)
