"""LLM deployment: generation from the prompt plus the encoder's embeddings, streamed.

The engine runs on its own thread; `AsyncEngine` hands each step's tokens to this replica's event
loop in one call and turns them into (coalesced) text chunks there (app/llm/async_engine.py).
"""

from __future__ import annotations

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
        self.engine = Engine(str(resolve_model(cfg.model, cfg.cache_dir)), pick_device(cfg.device), cfg.llm)
        self.streams = AsyncEngine(self.engine, cfg.llm.stream_interval_ms / 1e3)
        self.metrics = LLMMetrics(self.engine.load)

    async def generate(self, gen: dict, encoded: list):
        """Async generator of chunk dicts; `encoded` arrives resolved from the encoder's response."""
        async for chunk in self.streams.generate(request_from_dict(gen, encoded)):
            yield asdict(chunk)

    def load(self) -> dict:
        return self.engine.load()

    def stats(self) -> dict:
        return self.engine.stats()
