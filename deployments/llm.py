"""LLM deployment: generation from the prompt plus the encoder's embeddings, streamed."""

from __future__ import annotations

import asyncio
import os
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
        llm = cfg.llm
        self.engine = Engine(str(resolve_model(cfg.model, cfg.cache_dir)), pick_device(cfg.device), llm.dtype,
                             llm.max_model_len, llm.max_num_seqs, llm.max_waiting, cuda_graphs=llm.cuda_graphs,
                             max_prefill_tokens=llm.max_prefill_tokens)
        self.metrics = LLMMetrics(self.engine.load)

    async def generate(self, gen: dict, encoded: list):
        """Async generator of engine chunks; `encoded` arrives resolved from the encoder's response.
        A client that goes away cancels the sequence, which frees its slot at the next step."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        # chunks arrive on this replica's event loop: no thread parked per stream
        seq = self.engine.submit(request_from_dict(gen, encoded),
                                 on_chunk=lambda c: loop.call_soon_threadsafe(chunks.put_nowait, c))
        try:
            while True:
                chunk = await chunks.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                yield asdict(chunk)
                if chunk.finish_reason:
                    return
        finally:
            seq.cancel()

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
