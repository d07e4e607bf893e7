"""LLM deployment: generation from the prompt plus the encoder's embeddings, streamed.

The engine runs on its own thread. After each step it hands the step's token ids for every request
to this replica's event loop in one call; each request's async generator then makes text of
everything that has arrived for it (detokenization and stop strings happen here, never in the
step) and yields at most one chunk per `stream_interval_ms`, so a stream's Ray messages stay
bounded however fast tokens come.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from ray import serve

from app.config import AppConfig
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
        self.interval = cfg.llm.stream_interval_ms / 1e3
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine.emit = self._emit
        self.metrics = LLMMetrics(self.engine.load)

    def _emit(self, outputs) -> None:
        """Engine thread: one hand-off to the event loop per step, for all requests."""
        self.loop.call_soon_threadsafe(self.engine._emit_each, outputs)

    async def generate(self, gen: dict, encoded: list):
        """Async generator of engine chunks; `encoded` arrives resolved from the encoder's response.
        A client that goes away cancels the request, which frees its blocks at the next step."""
        self.loop = asyncio.get_running_loop()
        req = request_from_dict(gen, encoded)
        inbox: asyncio.Queue = asyncio.Queue()
        stream = self.engine.output_stream(req)
        seq = self.engine.submit(req, sink=inbox.put_nowait)
        last = 0.0
        try:
            while True:
                deltas = [await inbox.get()]
                wait = last + self.interval - time.monotonic()
                if wait > 0 and last:  # merge what arrives until the interval is up
                    await asyncio.sleep(wait)
                while not inbox.empty():
                    deltas.append(inbox.get_nowait())
                chunk = stream.push(deltas)
                if stream.stopped:
                    seq.cancel()
                if chunk is not None:
                    last = time.monotonic()
                    yield asdict(chunk)
                if stream.finished:
                    return
        finally:
            seq.cancel()

    def load(self) -> dict:
        return self.engine.load()

    def stats(self) -> dict:
        return self.engine.stats()
