"""LLM deployment: generation from the prompt plus the encoder's embeddings, streamed.

The engine runs on its own thread; `AsyncEngine` hands each step's tokens to this replica's event
loop in one call and turns them into (coalesced) text chunks there (app/llm/async_engine.py).
Under the `fused` placement the replica also holds the vision tower and encodes its requests' media
itself, the embeddings staying on the GPU (app/serving/fused.py): the Router calls `generate_from_media`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from ray import serve

from app.checkpoints.model_builder import resolve_model
from app.config import AppConfig
from app.gpu import sharing
from app.gpu.kernel_cache import use_kernel_cache
from app.llm.sequence import GenerationRequest
from app.serving.fused import build_generation
from app.serving.gc_pauses import watch
from app.serving.loop_lag import LoopLag
from app.serving.prometheus import RequestMetrics
from app.serving.shutdown import ANSWER_GRACE_S
from app.serving.startup import StartupTimeline

from .logs import route_app_logs
from .metrics import EncoderMetrics, LLMMetrics
from .payload import resolve_payload


def gpu_sharing(device_type: str) -> dict | None:
    """How this replica shares its GPU (app/gpu/sharing.py), from the share of a GPU Ray gave it; it warns
    once when that is by time slices. None on the CPU."""
    if device_type != "cuda":
        return None
    import ray

    share = ray.get_runtime_context().get_assigned_resources().get("GPU", 1.0)
    found = sharing.describe(shares_gpu=share < 1.0)
    if (warning := sharing.time_slice_warning(found)) is not None:
        logging.getLogger(__name__).warning(warning)
    return found


class TextOnly:
    """A replica without a tower (split and colocate placements) warms its text path only."""

    def __init__(self, streams):
        self.streams = streams

    async def stream(self, gen: dict, payload: list):
        async for chunk in self.streams.generate(GenerationRequest.from_router(gen, [])):
            yield chunk.as_dict()


# answers in flight finish when the replica is stopped: the Router's grace, that of a long answer
# (app/serving/shutdown.py; the builder's follows llm.default_max_tokens)
@serve.deployment(name="LLM", graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=ANSWER_GRACE_S)
class LLM:
    def __init__(self, config: dict, fused: bool = False):
        self.startup = StartupTimeline()  # what starting did, and when: /v1/llm/load reports it
        route_app_logs()
        cfg = AppConfig(**config)
        self.kernel_cache = use_kernel_cache(cfg.cache_dir)  # before any Triton compile (app/gpu/kernel_cache.py)
        checkpoint = str(resolve_model(cfg.model, cfg.cache_dir))
        engine_kw, self.followers = {}, []
        if cfg.placement.llm_tensor_parallel > 1:  # this replica is rank 0 of a group spanning several GPUs
            from .tensor_parallel import start_group

            with self.startup.phase("tensor-parallel group"):
                engine_kw, self.followers = start_group(cfg, checkpoint)
        self.fused, self.streams = build_generation(cfg, checkpoint, fused, self.startup, **engine_kw)
        self.gpu_sharing = gpu_sharing(self.streams.engine.device.type)  # its CUDA context exists by now
        self.warmup, self.first_request_at = None, None
        # the builder resolves None from the cluster's GPUs; a replica built elsewhere decides by its device
        warm = cfg.warmup if cfg.warmup is not None else self.streams.engine.device.type == "cuda"
        if warm:
            from app.serving.warmup import warm_llm_replica

            with self.startup.phase("warm-up requests"):
                self.warmup = warm_llm_replica(cfg, checkpoint, self.fused or TextOnly(self.streams), fused)
        self.engine = self.streams.engine
        if self.fused is not None:
            self.encoder_metrics = EncoderMetrics(self.fused.encoder.stats)
            self.fused.encoder.batcher.on_batch = self.encoder_metrics.on_batch
        self.metrics = LLMMetrics(self.engine.load)
        self.request_metrics = RequestMetrics(cfg.llm.max_model_len)  # GET /metrics (app/serving/prometheus.py)
        self.gc = watch()  # Ray Serve freezes the heap once this returns (app/serving/gc_pauses.py)
        self.loop_lag = LoopLag()  # ticks on the replica's event loop from its first request (app/serving/loop_lag.py)
        # Serve routes to a replica once this constructor returns, warm-up included: replica_load reports
        # both times so that a test can hold that a replica added under load takes nothing while cold
        self.ready_at = time.time()

    def _first_request(self) -> None:
        if self.first_request_at is None:
            self.first_request_at = time.time()

    def _observed(self, gen: dict, stream, t0: float | None = None):
        """`stream` counted in this replica's request metrics, unless a Router's warm-up sent it."""
        if gen.get("warm_up"):
            return stream
        self.loop_lag.ensure_started()
        self._first_request()
        return self.request_metrics.observe(stream, len(gen["input_ids"]), gen["params"].get("n", 1), t0)

    async def generate(self, gen: dict, encoded: list):
        """Async generator of chunk dicts; `encoded` arrives resolved from the encoder's response."""
        stream = self.streams.generate(GenerationRequest.from_router(gen, encoded))
        async for chunk in self._observed(gen, stream):
            yield chunk.as_dict()

    async def generate_from_media(self, gen: dict, payload: list):
        """`fused` placement: the request's encoder payload (object-store references of prepared
        items, nested so that Ray passes them unresolved) is encoded here, then generated from."""
        if self.fused is None:
            raise RuntimeError("generate_from_media needs the fused placement (this replica has no tower)")
        t0, entered = time.perf_counter(), time.time()  # the time to first token counts reading and encoding the media
        # a full queue: 503 before reading the media
        self.engine.check_admission(len(gen["input_ids"]), gen["params"].get("n", 1))
        items = await resolve_payload(payload)
        resolved = time.perf_counter()
        async for chunk in self._observed(gen, self.fused.chunks(gen, items), t0):
            if chunk.timing is not None:  # a choice's first: this replica's share of the Router's parts, and
                # when it began and ended by the wall clock, which the Router turns into the hops' times
                chunk.timing = {**chunk.timing, "payload_s": resolved - t0, "replica_s": time.perf_counter() - t0,
                                "replica_in_at": entered, "replica_out_at": time.time()}
            yield chunk.as_dict()

    def encoder_stats(self) -> dict:
        """`fused`: this replica's encoder counters (`/v1/encoder/stats` merges every replica's)."""
        if self.fused is None:
            raise RuntimeError("encoder_stats needs the fused placement (this replica has no tower)")
        return {**self.fused.encoder.stats(), "replica": serve.get_replica_context().replica_id.unique_id,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def metrics_snapshot(self) -> dict:
        """This replica's request counters and histograms, engine load and GPU time, and (`fused`) tower
        counters: GET /metrics sums every replica's (app/serving/prometheus.py)."""
        return {**self.request_metrics.snapshot(), "load": {**self.engine.load(), **self.engine.gpu_time()},
                "encoder": self.fused.encoder.stats() if self.fused is not None else None}

    async def __del__(self):
        """Ray Serve awaits this when it stops the replica, and only once the replica has taken itself out
        of routing and every request it had (a streamed answer until its last chunk) has ended, within
        `graceful_shutdown_timeout_s` (app/serving/shutdown.py): the engine has nothing left to finish, and
        stopping its loop tells a tensor-parallel group's followers to stop too. A replica stopped before
        its constructor returned may have no engine yet."""
        streams = getattr(self, "streams", None)
        engine = getattr(self, "engine", None) or getattr(streams, "engine", None)
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    def check_health(self) -> None:
        """Serve replaces a replica whose check raises: a tensor-parallel replica with a follower gone
        (its collectives would wait forever), or whose own rank stopped after a failed step
        (app/llm/engine.py: `_break_group`), is replaced whole, followers and all."""
        if not self.engine.alive:
            raise RuntimeError(f"the LLM engine has stopped: {self.engine.broken!r}")
        if self.followers:
            from .tensor_parallel import followers_alive

            followers_alive(self.followers)

    # ------------------------------------------------------------ routing and autoscaling
    def replica_load(self) -> dict:
        """This replica's engine load with its id and GPU, its engine's cumulative GPU time
        (`engine_gpu_ms_total`, `engine_timed_steps`: app/gpu/timing.py), whether it warmed up, when it
        became ready and when its first request came, the phases of its start (wall clock) and its garbage
        collector's pauses (app/serving/gc_pauses.py), its event loop's lag (app/serving/loop_lag.py) and
        where its Triton kernels are kept
        (app/gpu/kernel_cache.py) and how it shares its GPU (app/gpu/sharing.py): `/v1/llm/load` merges every
        replica's."""
        return {"replica": serve.get_replica_context().replica_id.unique_id,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), **self._load(),
                **self.engine.gpu_time(), "ready_at": self.ready_at, "first_request_at": self.first_request_at,
                "warmed": self.warmup is not None, "startup": self.startup.as_dict(), "gc": self.gc.snapshot(),
                "loop_lag": self.loop_lag.snapshot(),
                "kernel_cache": self.kernel_cache, "gpu_sharing": self.gpu_sharing}

    def record_routing_stats(self) -> dict:
        """Ray Serve calls this every `request_routing_stats_period_s`; the routers' LeastLoadedRouter
        (deployments/routing.py) reads it as the replica's `routing_stats`."""
        return self._load()

    def record_autoscaling_stats(self) -> dict:
        """Custom autoscaling metrics (numbers only), pushed to the controller with the replica's
        request counts; app.serving.autoscaling.LLMAutoscalingPolicy reads `kv_usage`."""
        return self._load()

    def _load(self) -> dict:
        load = self.engine.load()
        return {"running": int(load["running"]), "waiting": int(load["waiting"]),
                "kv_usage": float(load["kv_usage"])}

    def load(self) -> dict:
        return self.engine.load()

    def stats(self) -> dict:
        return self.engine.stats()
