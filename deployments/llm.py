"""LLM deployment: generation from the prompt plus the encoder's embeddings, streamed.

The engine runs on its own thread; `AsyncEngine` hands each step's tokens to this replica's event
loop in one call and turns them into (coalesced) text chunks there (app/llm/async_engine.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict

from ray import serve

from app.config import AppConfig
from app.llm.async_engine import AsyncEngine
from app.llm.engine import Engine, request_from_dict
from app.model_builder import resolve_model
from app.vision.service import pick_device

from .logs import route_app_logs
from .metrics import LLMMetrics


@serve.deployment(name="LLM", graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=2)
class LLM:
    def __init__(self, config: dict):
        route_app_logs()
        cfg = AppConfig(**config)
        if cfg.llm.switch_interval_ms:  # the event loop and the engine thread share the GIL (app/config.py)
            sys.setswitchinterval(cfg.llm.switch_interval_ms / 1e3)
        self.engine = Engine(str(resolve_model(cfg.model, cfg.cache_dir)), pick_device(cfg.device), cfg.llm)
        self.streams = AsyncEngine(self.engine, cfg.llm.stream_interval_ms / 1e3)
        self.metrics = LLMMetrics(self.engine.load)

    async def generate(self, gen: dict, encoded: list):
        """Async generator of chunk dicts; `encoded` arrives resolved from the encoder's response."""
        async for chunk in self.streams.generate(request_from_dict(gen, encoded)):
            yield asdict(chunk)

    # ------------------------------------------------------------ routing and autoscaling
    def replica_load(self) -> dict:
        """This replica's engine load with its id and GPU (`/v1/llm/load` merges every replica's)."""
        return {"replica": serve.get_replica_context().replica_id.unique_id,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), **self._load()}

    def record_routing_stats(self) -> dict:
        """Ray Serve calls this every `request_routing_stats_period_s`; the routers' LeastLoadedRouter
        (deployments/routing.py) reads it as the replica's `routing_stats`."""
        return self._load()

    def record_autoscaling_stats(self) -> dict:
        """Custom autoscaling metrics (numbers only), pushed to the controller with the replica's
        request counts; app.autoscaling.LLMAutoscalingPolicy reads `kv_usage`."""
        return self._load()

    def _load(self) -> dict:
        load = self.engine.load()
        return {"running": int(load["running"]), "waiting": int(load["waiting"]),
                "kv_usage": float(load["kv_usage"])}

    def load(self) -> dict:
        return self.engine.load()

    def stats(self) -> dict:
        return self.engine.stats()
