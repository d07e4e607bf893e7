"""The `fused` placement's LLM replica: the vision tower and the engine in one process, on one GPU.

Why: under `colocate` each item's embeddings go through the host (off the GPU, through Ray's object
store, back onto the same GPU) and each request costs a second replica call; on an H200 that host
path, not the GPU, was the queue (benchmarks/RESULTS.md, "Serving: the bottleneck sweep"). Here the
tower's output reaches the engine as device tensors. With `encoder.stream: shared` (default) the
tower's batches and the engine's steps share the default stream, so a prefill queues behind the batch
that made its embeddings; with `own` a request reaches the engine once its embeddings are made.
Given up: the tower's host work shares this process's GIL with the engine thread and the event
loop, and graphs are not captured while serving (a capture would race the engine's launches).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from ..config import AppConfig
from ..llm.async_engine import AsyncEngine
from ..llm.engine import Engine
from ..llm.sequence import GenerationRequest
from ..llm.stream import Chunk
from ..vision.service import EncoderService, pick_device
from .startup import StartupTimeline

log = logging.getLogger(__name__)


class FusedBackend:
    """ChatService's backend for one process: encode (batched across requests, cached), then generate."""

    def __init__(self, encoder: EncoderService, streams: AsyncEngine):
        self.encoder, self.streams = encoder, streams

    @property
    def engine(self) -> Engine:
        return self.streams.engine

    @classmethod
    def build(cls, cfg: AppConfig, checkpoint: str, timeline: StartupTimeline | None = None,
              **engine_kw) -> FusedBackend:
        if cfg.encoder.uniform_capture_after:
            log.warning("encoder.uniform_capture_after is ignored under the fused placement: no graph is "
                        "captured while the engine runs in the same process")
            cfg = cfg.model_copy(update={"encoder": cfg.encoder.model_copy(update={"uniform_capture_after": 0})})
        # The tower first: its weights, graphs and buffers take their memory before the engine sizes
        # its KV cache from what is left (llm.gpu_memory_utilization).
        timeline = timeline or StartupTimeline()
        with timeline.phase("tower"):  # weights, GEMM choice, graphs, the auto-tune's timing runs
            encoder = EncoderService(cfg, checkpoint, keep_on_device=True)
        timeline.extend("tower", encoder.startup)
        engine = _engine(cfg, checkpoint, timeline, engine_kw)
        if cfg.encoder.backlog_wait_ms:  # requests waiting for an engine slot gain nothing from early encoding
            encoder.batcher.backlog = engine.short_of_room
        return cls(encoder, AsyncEngine(engine, cfg.llm.stream_interval_ms / 1e3))

    async def chunks(self, gen: dict, items: list) -> AsyncIterator[Chunk]:
        """One request: `gen` is the Router's generation dict, `items` its tower inputs (uint8 rows,
        grid, cache key), in prompt order. A request the engine would refuse now (queue full, prompt
        too long) is refused before its media is encoded; requests still encoding do not count
        towards the queue, so a burst may still be refused after encoding, by `submit`."""
        self.engine.check_admission(len(gen["input_ids"]), gen["params"].get("n", 1))
        t, parts = time.perf_counter(), {}
        encoded = await self.encoder.encode_async(items, parts) if items else []
        # the tower's queue and batch: part of the time to first token, and its own three parts
        encode = {"encode_s": time.perf_counter() - t, **{f"encode_{k}": v for k, v in parts.items()}}
        stream = self.streams.generate(GenerationRequest.from_router(gen, encoded))
        del encoded  # the engine's sequence copies the embeddings: keep no GPU memory here meanwhile
        async for chunk in stream:
            if chunk.timing is not None:  # each choice's first chunk
                chunk.timing = {**chunk.timing, **encode}
            yield chunk

    async def stream(self, gen: dict, payload: list) -> AsyncIterator[dict]:
        """app.api.chat.Backend: chunks as dicts."""
        async for chunk in self.chunks(gen, payload):
            yield chunk.as_dict()


def gemv_tune_dir(cfg: AppConfig) -> str | None:
    """Where an LLM engine keeps its matrix-vector choice (`llm.decode_gemv_cache`), or None."""
    from ..checkpoints.model_builder import cache_root

    return str(cache_root(cfg.cache_dir) / "gemv-tune") if cfg.llm.decode_gemv_cache else None


def _engine(cfg: AppConfig, checkpoint: str, timeline: StartupTimeline, engine_kw: dict) -> Engine:
    engine = Engine(checkpoint, pick_device(cfg.device), cfg.llm, tune_dir=gemv_tune_dir(cfg), **engine_kw)
    timeline.extend("engine", engine.startup)
    return engine


def build_generation(cfg: AppConfig, checkpoint: str, fused: bool, timeline: StartupTimeline | None = None,
                     **engine_kw) -> tuple[FusedBackend | None, AsyncEngine]:
    """What an LLM replica (or a batch job's LLM actor) generates with: the engine behind an event
    loop, and under `fused` the tower beside it (else None). `engine_kw`: the tensor-parallel rank
    and lockstep channel of a replica that spans several GPUs (app/serving/tensor_parallel.py).
    `timeline` gets the phases of the start (the tower, the engine's)."""
    if fused:
        backend = FusedBackend.build(cfg, checkpoint, timeline, **engine_kw)
        return backend, backend.streams
    engine = _engine(cfg, checkpoint, timeline or StartupTimeline(), engine_kw)
    return None, AsyncEngine(engine, cfg.llm.stream_interval_ms / 1e3)
