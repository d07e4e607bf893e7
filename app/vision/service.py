"""The encoder replica's work, independent of Ray: load the tower, capture graphs, encode."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..config import AppConfig
from ..gpu.timing import GpuTimer
from ..gpu.tune_cache import TOWER_CODE, TuneCache, checkpoint_parts, library_versions, source_digest
from ..llm.loader import resolve_dtype
from ..media.spec import patch_spec_for
from .batcher import EncodeBatcher
from .cache import EmbeddingCache
from .graphs import GraphManager, GraphSettings, VisionEmbedding, VisionItem
from .loading import build_tower
from .packing import Limits

log = logging.getLogger(__name__)

EncodedItem = tuple[torch.Tensor, list[torch.Tensor]]  # (main, deepstack): on the CPU, or kept on the device


def tune_cache_for(cfg: AppConfig, checkpoint: str, device, dtype, settings: GraphSettings, tower) -> TuneCache:
    """The auto-tune table's place for this GPU model, checkpoint config, dtype, graph settings, tower
    (its class, tensor-parallel ranks, dense attention), tower code and libraries (app/gpu/tune_cache.py),
    under `cache_dir`."""
    from ..checkpoints.model_builder import cache_root

    parts = {**checkpoint_parts(checkpoint, device, dtype),
             "budgets": sorted(set(settings.budgets)), "uniform": sorted(settings.uniform_shapes),
             "items": settings.max_items_per_batch, "frames": settings.max_frames_per_batch,
             "uint8": settings.uint8_pixels, "pinned": settings.pinned_staging, "flash4": tower.flash4,
             "tower": type(tower).__name__, "ranks": getattr(getattr(tower, "tp", None), "size", 1),
             "code": source_digest(TOWER_CODE), **library_versions()}
    return TuneCache(cache_root(cfg.cache_dir) / "vision-tune", parts)


def _to_cpu(o) -> EncodedItem:
    # Each item gets its own storage: a view would ship the whole batch to every request.
    return o.main.to("cpu", copy=True), [d.to("cpu", copy=True) for d in o.deepstack]


def _on_device(o) -> EncodedItem:
    # Each item gets its own storage here too (a device-to-device copy): a view would keep the whole
    # batch's output alive on the GPU for as long as any one of its requests holds its item.
    return o.main.clone(), [d.clone() for d in o.deepstack]


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


class EncoderService:
    def __init__(self, cfg: AppConfig, checkpoint: str, keep_on_device: bool = False):
        """`keep_on_device`: `encode_async` returns the embeddings where the tower ran (the `fused`
        placement's LLM replica reads them there) instead of copying them to the host for Ray; the
        embedding cache then holds device memory too (`encoder.cache_bytes`)."""
        enc = cfg.encoder
        device = pick_device(cfg.device)
        dtype = resolve_dtype(enc.dtype, torch.device(device))
        # The router sends raw uint8 patch rows (a quarter of float32's bytes through Ray and to the GPU);
        # the tower normalises them with the checkpoint's processor settings.
        # (the checkpoint's family picks the tower: Qwen3-VL, Qwen2.5-VL or MiniCPM-V; loading.build_tower)
        t, steps = time.time(), []
        if torch.device(device).type == "cuda":  # the process's first CUDA call makes its context: its own phase
            torch.zeros(1, device=device)
            torch.cuda.synchronize(device)
            steps.append(("CUDA context", t, time.time()))
        tower = build_tower(checkpoint, dtype, device, pixel_norm=patch_spec_for(checkpoint).column_norm(),
                            random_weights=cfg.llm.load_format == "dummy", phases=steps)
        tower.use_dense_attention(enc.dense_attention if enc.cuda_graphs else "sdpa")  # FA4 runs only in graphs
        budgets = enc.token_budgets or GraphSettings.power_of_two_budgets(enc.min_budget, enc.max_budget,
                                                                                enc.budget_steps_per_octave)
        settings = GraphSettings(
            budgets, enc.max_items_per_batch, enc.max_frames_per_batch, enc.cuda_graphs, enc.autotune,
            uniform_shapes=[tuple(s) for s in enc.uniform_graph_shapes],
            uniform_capture_after=enc.uniform_capture_after, max_uniform_graphs=enc.max_uniform_graphs,
            eager_margin=enc.eager_margin, observe_dispatch=enc.observe_dispatch, uint8_pixels=True,
            # `fused` (keep_on_device): no eager batch where a graph fits (EncoderConfig.eager_when_faster)
            eager_when_faster=enc.eager_when_faster if enc.eager_when_faster is not None else not keep_on_device,
            pinned_staging=enc.pinned_pixel_copy, pinned_min_rows=enc.pinned_copy_min_rows)
        if enc.autotune_cache and torch.device(device).type == "cuda":  # the GEMM choice too, autotune or not
            settings.tune_cache = tune_cache_for(cfg, checkpoint, device, dtype, settings, tower)
        t1 = time.time()
        self.manager = GraphManager(tower, settings)
        steps.append(("static buffers", t1, time.time()))
        weights = ("weights", t, time.time())
        self.manager.capture()
        # (phase, start, end), wall clock: the LLM replica's start-up timeline reports them (`fused`); the
        # weights' own steps as "weights: <step>"
        self.startup = [weights, *((f"weights: {n}", a, b) for n, a, b in steps), *self.manager.startup]
        # device time of each batch, from CUDA events on the stream it runs on (app/gpu/timing.py)
        self.gpu_timer = GpuTimer(device)
        self.keep_on_device = keep_on_device
        self.cache = EmbeddingCache(enc.cache_bytes)
        # `fused`: the engine's steps run on the device's default stream, from their own thread. On that
        # stream too (`encoder.stream: shared`), a tower batch queues between two steps and the GPU runs
        # them one after the other; on a stream of its own the two may overlap.
        self._stream = None
        if keep_on_device and enc.stream == "own" and torch.device(device).type == "cuda":
            self._stream = torch.cuda.Stream(device)
        if enc.backlog_wait_ms and not keep_on_device:
            log.warning("encoder.backlog_wait_ms applies to the fused placement only (it reads the engine's "
                        "scheduling state in the same process); ignored by this encoder replica")
        self.batcher = EncodeBatcher(self._encode_batch,
                                     Limits(self.manager.max_budget, enc.max_items_per_batch, enc.max_frames_per_batch),
                                     enc.batch_wait_ms, enc.batch_wait_when_idle,
                                     on_idle=self.manager.pending_captures, backlog_wait_ms=enc.backlog_wait_ms)
        log.info("vision encoder ready on %s (%s, dense attention: %s%s), budgets %s, graphs %s", device, dtype,
                 "FlashAttention-4" if tower.flash4 else "SDPA", f", stream {enc.stream}" if self._stream else "",
                 self.manager.budgets, sorted(self.manager.graphs) or "none captured")

    def _encode_batch(self, items: list[VisionItem]) -> tuple[list[VisionEmbedding], int]:
        """The batcher's worker thread: one batch, on the engine's stream or the tower's own."""
        if self._stream is not None:
            return self._encode_on_own_stream(items)
        with self.gpu_timer.timed():
            return self.manager.encode_batch(items)

    def _encode_on_own_stream(self, items: list[VisionItem]) -> tuple[list[VisionEmbedding], int]:
        """The batcher's worker thread, `fused` on a GPU: one batch on the tower's stream, each item's
        embeddings copied out there too, and returned once the GPU has made them. Until then the
        engine never sees the request, so it never queues a step that would wait for the tower (a wait
        on the device would stall the engine's stream behind the whole batch). The thread sleeps on
        the event (no spinning core); the batcher forms the next batch meanwhile.

        The copies are read on the caller's stream (the batcher's loop joins a video's chunks there, the
        engine builds its request there) and freed whenever; recorded on that stream, their memory goes
        to a later tower batch only after the work queued there at their release has run."""
        reader = torch.cuda.current_stream(self._stream.device)  # this thread's: the default, the engine's
        with torch.cuda.stream(self._stream):
            with self.gpu_timer.timed():  # its events on the tower's stream
                outs, padded = self.manager.encode_batch(items)
            copies = [VisionEmbedding(*_on_device(o)) for o in outs]
            done = torch.cuda.Event(blocking=True)
            done.record(self._stream)
        for c in copies:
            for t in (c.main, *c.deepstack):
                t.record_stream(reader)
        done.synchronize()
        return copies, padded

    def encode(self, items: list[tuple[np.ndarray, tuple[int, int, int]]]) -> list[EncodedItem]:
        """One request's items (uint8 patch rows, grid) as one batch, synchronously (no cache, no
        cross-request batching)."""
        with self.gpu_timer.timed():
            outs = self.manager.encode([VisionItem(torch.from_numpy(px), tuple(grid)) for px, grid in items])
        return [_to_cpu(o) for o in outs]

    async def encode_async(self, items: list[tuple[np.ndarray, tuple[int, int, int], str | None]],
                           timing: dict | None = None) -> list[EncodedItem]:
        """Items (uint8 patch rows, grid, cache key). Cache first; the misses join the cross-request
        batcher; results in item order. `timing`: as EncodeBatcher.submit's (left empty when every item
        was cached)."""
        results: list[EncodedItem | None] = [self.cache.get(key) for _, _, key in items]
        todo = [i for i, r in enumerate(results) if r is None]
        if todo:
            outs = await self.batcher.submit([(torch.from_numpy(items[i][0]), tuple(items[i][1])) for i in todo],
                                             timing)
            for i, o in zip(todo, outs):
                if self._stream is not None:  # copied out on the tower's stream already
                    results[i] = o.main, o.deepstack
                else:
                    results[i] = _on_device(o) if self.keep_on_device else _to_cpu(o)
                self.cache.put(items[i][2], results[i])
        return results

    def stats(self) -> dict:
        """Counters (cumulative), among them the tower's device time: `encoder_gpu_ms_total` over
        `encoder_timed_batches` batches (GpuTimer.snapshot)."""
        return {**self.manager.stats.as_dict(), **self.batcher.stats.as_dict(), **self.cache.stats(),
                **self.gpu_timer.snapshot("encoder", "batches"),
                "budgets": self.manager.budgets,
                "captured": sorted(self.manager.graphs), "capture_seconds": self.manager.capture_seconds,
                "uniform_graphs": [list(k) for k in list(self.manager.uniform_graphs)],  # a capture may add one
                "autotune": self.manager.autotune_table,
                "dispatch_observed": self.manager.observed.summary() if self.manager.observed else {},
                "explored_batches": self.manager.observed.explored if self.manager.observed else 0}
