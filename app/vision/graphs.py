"""CUDA-graph manager for the vision tower: capture per token budget, replay with padding.

One set of max-size static input buffers is shared by every graph (each reads a prefix slice), and
all graphs share one memory pool. Budget graphs replay any batch padded to the smallest budget that
holds it; uniform graphs replay equal-length batches at their exact shape (`GraphManager`). What fits
no graph runs eagerly through the same tower code and is counted. Every graph is timed against eager
when captured and dropped if it is not faster (kept whatever its time with `eager_when_faster` off);
while serving, dispatch corrects those timings with the batch times it observes (observed.py).
Without CUDA (or with graphs off) the same padded static-shape path runs without capture, so the
padding logic is exercised on the CPU too.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ..gpu.capture import collection_paused
from ..gpu.kernel_timing import cuda_times_ms
from .device_metadata import DeviceMetadataCache
from .metadata import BatchLayout, Grid
from .observed import EAGER, GRAPH, ObservedTimes
from .staging import PinnedStaging, copy_rows
from .tower_api import GraphTower, TowerBatch

log = logging.getLogger(__name__)
# The auto-tune's timing of each path (eager, graph) per budget: untimed runs first (a shape's first run
# meets cuBLAS's heuristics and lazy allocations), then the median of the timed runs (CUDA events). It ran
# for 8.6 s of a first deploy's 61.7 s on one H200 with 3 + 10 (2026-12-01); the median of 5 is as robust
# to one or two slow runs, and the dispatch corrects the table with the times of served batches anyway
# (observed.py).
TUNE_WARMUP, TUNE_RUNS = 1, 5


@dataclass
class VisionItem:
    """One image or video (or a video chunk) ready for the tower."""

    pixels: torch.Tensor  # [t*h*w, C*T*P*P]: normalised float, or raw uint8 (GraphSettings.uint8_pixels)
    grid: Grid


@dataclass
class VisionEmbedding:
    """Tower output for one item: its embedding rows for the LLM and one tensor per deepstack layer
    (none for towers without deepstack)."""

    main: torch.Tensor  # [rows, out_dim]: t*h*w / merge^2 for Qwen towers, the resampler's queries for MiniCPM-V
    deepstack: list[torch.Tensor]


@dataclass
class GraphSettings:
    budgets: list[int]
    max_items_per_batch: int = 16
    max_frames_per_batch: int = 32
    use_cuda_graphs: bool = True
    autotune: bool = True
    uniform_shapes: list[tuple[int, int]] = field(default_factory=list)  # (sequences, length) at start-up
    # Sightings of a new equal-length shape before it is captured while serving; 0 = never. Off by
    # default: a capture stalls the replica's queue
    # (benchmarks/results/2026-11-21-serving-under-load-graphs-on-off.md).
    uniform_capture_after: int = 0
    max_uniform_graphs: int = 16
    # Items carry raw uint8 patch rows and the tower normalises them (VisionTower's pixel_norm): a
    # quarter of the bytes from the router and to the GPU. Otherwise rows come normalised, as floats.
    uint8_pixels: bool = False
    # A batch that fits a graph runs eagerly only when the tuned eager estimate, raised by this
    # fraction, still beats the graph: eager is launch-bound, so its time (and its tail) is the host
    # CPU's, while a replay's is not. Near a tie the graph wins (the case that set it:
    # benchmarks/results/2026-11-21-vision-encoder-qwen3-vl.md).
    eager_margin: float = 0.1
    # Correct the auto-tune's estimates with the times of the batches served, and time the path not
    # taken now and then near a tie (observed.py); the margin then applies only until a path is known.
    observe_dispatch: bool = True
    # False: the auto-tune keeps every graph it captured, and a batch replays the smallest that holds it,
    # whatever the estimates; eager only where none does (EncoderConfig's eager_when_faster says when, and
    # why: the `fused` placement)
    eager_when_faster: bool = True
    # uint8 rows from host memory go to the GPU through pinned buffers (app/vision/staging.py says why)
    pinned_staging: bool = False
    pinned_min_rows: int = 0  # smaller batches are copied directly
    # the start-up timings on disk (tune_cache.TuneCache): the auto-tune table and the GEMM choice beside it
    tune_cache: Any = None  # (each applied where one matches, else measured and kept)

    @staticmethod
    def power_of_two_budgets(min_budget: int, max_budget: int, steps_per_octave: int = 1) -> list[int]:
        """Powers of two from `min_budget` up to `max_budget` (always included), optionally with
        `steps_per_octave - 1` evenly spaced budgets between neighbours (multiples of 16), so that
        common sizes pad less: 784 tokens (a 448^2 image) pads to 896, not 1024, with 4 steps."""
        out, b = {max_budget}, 1
        while b < min_budget:
            b *= 2
        while b < max_budget:
            for i in range(steps_per_octave):
                v = (b + b * i // steps_per_octave) // 16 * 16 if i else b
                if v < max_budget:
                    out.add(v)
            b *= 2
        return sorted(out)


@dataclass(frozen=True)
class Dispatch:
    """How a batch runs: the budget graph to replay, or eager (budget None) and why."""

    budget: int | None
    reason: str | None = None
    # the budget whose graph and eager estimates were compared, as observed.py keys it: `b`, or `"b equal"`
    # for equal-length batches (another tuned column, dense attention); None: there was no choice
    bucket: int | str | None = None
    predicted_ms: float = 0.0  # the tuned estimate of the path taken; its observed time is kept as a ratio


@dataclass
class EncoderStats:
    """Counters exported as metrics."""

    graph_hits: int = 0
    uniform_hits: int = 0  # graph hits that replayed an exact-shape (uniform) graph
    idle_captures: int = 0  # exact-shape graphs captured while serving (kept or not)
    idle_capture_ms: float = 0.0  # time the replica spent on them, blocking its queue
    eager_batches: int = 0
    eager_reasons: Counter = field(default_factory=Counter)
    per_budget: Counter = field(default_factory=Counter)
    real_tokens: int = 0
    padded_tokens: int = 0
    items: int = 0

    @property
    def padding_ratio(self) -> float:
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0

    def as_dict(self) -> dict:
        return {
            "graph_hits": self.graph_hits,
            "uniform_hits": self.uniform_hits,
            "idle_captures": self.idle_captures,
            "idle_capture_ms": self.idle_capture_ms,
            "eager_batches": self.eager_batches,
            "eager_reasons": dict(self.eager_reasons),
            "per_budget": {str(k): v for k, v in sorted(self.per_budget.items())},
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "padding_ratio": self.padding_ratio,
            "items": self.items,
        }


class GraphManager:
    """Owns static buffers, captured graphs and the eager fallback for one tower (one GPU).

    - Budget graphs, one per token budget: any batch (images and videos mixed) replays the smallest
      budget that holds it, padded; attention is variable-length (attention.py).
    - Uniform graphs, one per (sequences, length): batches whose attention sequences are all equally
      long (one image, one video's frames, same-size images) replay a graph of their exact shape, with
      no padding (and cuDNN's dense attention for long sequences). Listed shapes are captured at
      start-up; optionally, a shape seen `uniform_capture_after` times is captured when the replica
      is idle (`capture_pending`).

    What fits no graph (too many tokens, attention sequences or items) runs eagerly."""

    def __init__(self, tower: GraphTower, settings: GraphSettings):
        if not settings.budgets:
            raise ValueError("at least one token budget is needed")
        unit = tower.budget_unit
        for b in settings.budgets:
            if b % unit:
                raise ValueError(f"token budget {b} is not a multiple of the tower's unit {unit}")
        self.tower = tower
        self.settings = settings
        self.budgets = sorted(set(settings.budgets))
        self.max_budget = self.budgets[-1]
        self.seq_slots = settings.max_frames_per_batch + 1  # + one sequence for the padding tokens
        self.device = tower.device
        self.capture_enabled = settings.use_cuda_graphs and self.device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_out: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.uniform_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._uniform_out: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._uniform_seen: Counter = Counter()
        self._uniform_pending: list[tuple[int, int]] = []
        self._uniform_rejected: set[tuple[int, int]] = set()  # captured, but not faster than eager
        self._pool = None
        self.autotune_table: list[dict] = []
        # budget -> (eager ms on unequal lengths, eager ms on equal lengths, graph ms), from the auto-tune
        self._tuned: dict[int, tuple[float, float, float]] = {}
        self.observed = ObservedTimes(cuda=self.device.type == "cuda") if settings.observe_dispatch else None
        self.capture_seconds = 0.0
        # (phase, start, end), wall clock, of `capture`: the replica's start-up timeline reports them
        self.startup: list[tuple[str, float, float]] = []
        self.capture_bytes = 0
        self.stats = EncoderStats()
        self._lock = threading.Lock()
        self.metadata = DeviceMetadataCache(
            lambda lay, budget, uniform: tower.metadata(lay, budget, uniform, self.seq_slots), self.device)
        self._filled: tuple | None = None  # the metadata key the static buffers hold now
        self._alloc_static()

    # ------------------------------------------------------------------ buffers
    def _alloc_static(self) -> None:
        n, dev = self.max_budget, self.device
        px_dtype = torch.uint8 if self.settings.uint8_pixels else self.tower.dtype
        self._pixels = torch.zeros(n, self.tower.patch_dim, dtype=px_dtype, device=dev)
        self._staging = None
        if self.settings.pinned_staging and self.settings.uint8_pixels and dev.type == "cuda":
            self._staging = PinnedStaging(n, self.tower.patch_dim, px_dtype, dev,
                                          min_rows=self.settings.pinned_min_rows)
        self._pixels_read: torch.cuda.Event | None = None  # after the last forward that read `_pixels`
        self._meta = self.tower.metadata_buffers(n, self.seq_slots)  # the tower's metadata, max-size

    def _meta_views(self, budget: int, uniform: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        rows = self.tower.metadata_rows(budget, uniform, self.seq_slots)
        return {k: self._meta[k][:r] for k, r in rows.items()}

    def _static_inputs(self, budget: int, uniform: tuple[int, int] | None = None) -> TowerBatch:
        return TowerBatch(self._pixels[:budget], self._meta_views(budget, uniform),
                          uniform[1] if uniform else budget, uniform, static=True)

    def _fill(self, items: list[VisionItem], lay: BatchLayout, budget: int,
              uniform: tuple[int, int] | None = None) -> None:
        """Copy a batch into the static buffers (laid out as `_static_inputs(budget, uniform)` reads
        them): the pixels, zeroed padding rows and the padded metadata. The metadata and the padding
        are copied only when the layout differs from the previous fill's."""
        n = lay.num_tokens
        key = DeviceMetadataCache.key(lay, budget, uniform)
        if key != self._filled:
            self._filled = None  # until every buffer below is written: a copy that raises leaves no key behind
            meta = self.metadata.get(lay, budget, uniform)
            views = self._meta_views(budget, uniform)
            if meta.keys() != views.keys():
                raise ValueError(f"tower metadata {sorted(meta)} does not match its buffers {sorted(views)}")
            for name, t in meta.items():
                views[name].copy_(t)
            if budget > n:
                self._pixels[n:budget].zero_()
            self._filled = key
        rows = [it.pixels for it in items]
        if self._staging is not None:
            self._staging.copy(rows, self._pixels[:n], ready=self._pixels_read)
        else:
            copy_rows(rows, self._pixels[:n])

    # ------------------------------------------------------------------ selection
    def choose_budget(self, lay: BatchLayout) -> tuple[int | None, str | None]:
        """Smallest budget holding the batch, or (None, reason) when it must run eagerly."""
        d = self.dispatch(lay)
        return d.budget, d.reason

    def dispatch(self, lay: BatchLayout, explore: bool = False) -> Dispatch:
        """The smallest captured budget holding the batch, unless eager is expected to be faster there;
        with `explore` (a batch about to run), near a tie now and then the other path (observed.py)."""
        if self.device.type == "cuda" and not self.settings.use_cuda_graphs:
            return Dispatch(None, "disabled")  # graphs off on a GPU: exact-shape eager (the CPU keeps the padded path)
        if lay.num_items > self.settings.max_items_per_batch:
            return Dispatch(None, "items")
        if lay.num_seqs > self.settings.max_frames_per_batch:
            return Dispatch(None, "frames")
        if lay.num_tokens > self.max_budget:
            return Dispatch(None, "tokens")
        for b in self.budgets:
            if b >= lay.num_tokens:
                if self.capture_enabled and b not in self.graphs:
                    continue  # dropped by auto-tune: a larger captured budget may still pay
                tuned = self._tuned.get(b)  # (eager unequal, eager equal, graph) ms
                if not tuned:
                    return Dispatch(b)
                if not self.settings.eager_when_faster:
                    return Dispatch(b, None, b if lay.uniform is None else f"{b} equal", tuned[2])
                # Eager pays no padding (and a launch-bound floor): where it is expected to beat this
                # graph at the batch's real size, eager it is.
                eager_ms = self._eager_estimate(lay.num_tokens, lay.uniform is not None)
                bucket = b if lay.uniform is None else f"{b} equal"
                eager, graph = self._expected_ms(bucket, eager_ms, tuned[2])
                take_eager, reason = eager < graph, "faster_eager"
                if explore and self.observed is not None and self.observed.explore(bucket, eager, graph):
                    take_eager, reason = not take_eager, "explore"
                if take_eager:
                    return Dispatch(None, reason, bucket, eager_ms)
                return Dispatch(b, None, bucket, tuned[2])
        return Dispatch(None, "no_graph")

    def _expected_ms(self, bucket: int | str, eager_ms: float, graph_ms: float) -> tuple[float, float]:
        """Both paths' expected times for a batch of `bucket`: the tuned ones, times the corrections
        observed in serving once enough batches were seen; until then eager's is raised by the margin
        (its time under load is the host's, which an idle tuning run does not see)."""
        fe = fg = None
        if self.observed is not None:
            fe, fg = self.observed.factor(bucket, EAGER), self.observed.factor(bucket, GRAPH)
        eager = eager_ms * (fe if fe is not None else 1 + self.settings.eager_margin)
        return eager, graph_ms * (fg if fg is not None else 1.0)

    def _eager_estimate(self, tokens: int, equal_lengths: bool) -> float:
        """Eager time for `tokens`, interpolated from the auto-tune table (inf when not tuned)."""
        pts = sorted((b, t[1] if equal_lengths else t[0]) for b, t in self._tuned.items())
        if not pts:
            return float("inf")
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (b0, e0), (b1, e1) in zip(pts, pts[1:]):
            if tokens <= b1:
                return e0 + (e1 - e0) * (tokens - b0) / (b1 - b0)
        return pts[-1][1] * tokens / pts[-1][0]

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every budget, largest first, into one pool; then the listed uniform shapes; auto-tune.
        First, on CUDA (graphs or not), the tower picks its GEMM ways for these token counts."""
        if self.device.type == "cuda":
            t = time.time()
            rows = set(self.budgets) | {s * n for s, n in map(tuple, self.settings.uniform_shapes)}
            source = self.tower.tune_gemms(sorted(rows), self.settings.tune_cache)
            if self.tower.down is not None:
                log.info("vision MLP down projection, fastest way per token count (%s): %s", source,
                         self.tower.down.choice)
            self.startup.append(("GEMM choice", t, time.time()))
        if not self.capture_enabled:
            return
        t, t0 = time.time(), time.perf_counter()
        torch.cuda.synchronize(self.device)
        warm = self._synthetic_batch(self.max_budget)
        self._fill(warm, self._layout(warm), self.max_budget)
        self._on_side_stream(lambda: [self.tower(self._static_inputs(self.max_budget)) for _ in range(2)])
        # Growth of reserved memory over the capture, from an emptied cache (torch.cuda.graph empties
        # it on entry too): the private graph pool's segments, i.e. what the graphs hold.
        torch.cuda.empty_cache()
        reserved0 = torch.cuda.memory_reserved(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        for i, b in enumerate(sorted(self.budgets, reverse=True)):
            self.graphs[b], self._graph_out[b] = self._capture_graph(self._static_inputs(b))
            log.info("captured vision graph %d/%d: budget %d tokens", i + 1, len(self.budgets), b)
        for shape in map(tuple, self.settings.uniform_shapes):
            if self.uniform_fits(shape):
                self._capture_uniform(shape, tune=False)
            else:
                log.warning("uniform graph shape %s exceeds the largest budget or max_frames_per_batch: skipped",
                            shape)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - reserved0
        log.info("captured %d budget and %d uniform vision graphs in %.2f s using %.1f MiB", len(self.graphs),
                 len(self.uniform_graphs), self.capture_seconds, self.capture_bytes / 2**20)
        self.startup.append(("graphs", t, time.time()))
        if self.settings.autotune:
            t = time.time()
            self.autotune()
            self.startup.append(("auto-tune", t, time.time()))

    def _on_side_stream(self, fn) -> None:
        """Run `fn` on a side stream and wait for it (warm-ups before capture: lazy init, cuDNN plans)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)

    def _capture_graph(self, inp: TowerBatch):
        g = torch.cuda.CUDAGraph()
        with collection_paused(), torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
            out = self.tower(inp)
        return g, out

    def uniform_fits(self, shape: tuple[int, int]) -> bool:
        seqs, length = shape
        return (seqs * length <= self.max_budget and seqs <= self.settings.max_frames_per_batch
                and length % self.tower.budget_unit == 0)

    def _capture_uniform(self, shape: tuple[int, int], tune: bool = True, reps: int = TUNE_RUNS) -> bool:
        """Capture the exact-shape graph for `shape` = (sequences, length); with `tune`, keep it only
        if it beats eager on that shape (median of `reps` runs each). Returns whether it was kept."""
        if shape in self.uniform_graphs or not self.uniform_fits(shape):
            return shape in self.uniform_graphs
        seqs, length = shape
        n = seqs * length
        items = self._synthetic_uniform(shape)
        lay = self._layout(items)
        self._fill(items, lay, n, shape)
        inp = self._static_inputs(n, shape)
        t0 = time.perf_counter()
        self.tower.tune_gemms([n])
        self._on_side_stream(lambda: self.tower(inp))  # cuDNN builds its plan for this shape here
        g, out = self._capture_graph(inp)
        self.uniform_graphs[shape], self._uniform_out[shape] = g, out
        log.info("captured uniform vision graph %s in %.0f ms", shape, 1e3 * (time.perf_counter() - t0))
        if tune:
            self._tune_uniform(shape, items, lay, reps)
        return shape in self.uniform_graphs

    def _tune_budget(self, b: int) -> dict:
        mixed, same = self._synthetic_batch(b, equal=False), self._synthetic_batch(b)
        lay_m, lay_s = self._layout(mixed), self._layout(same)
        eager_ms = self._time_ms(lambda: self._run_eager(mixed, lay_m))
        graph_ms = self._time_ms(lambda: self._run_graph(mixed, lay_m, b))
        dense_ms = self._time_ms(lambda: self._run_eager(same, lay_s)) if lay_s.uniform else eager_ms
        keep = self._keeps(graph_ms, eager_ms)
        self._tuned[b] = (eager_ms, dense_ms, graph_ms)
        if not keep:
            del self.graphs[b], self._graph_out[b]
        return {"budget": b, "eager_ms": round(eager_ms, 3), "eager_equal_ms": round(dense_ms, 3),
                "graph_ms": round(graph_ms, 3), "kept": keep}

    def _tune_uniform(self, shape, items, lay, reps: int = TUNE_RUNS) -> None:
        eager_ms = self._time_ms(lambda: self._run_eager(items, lay), reps)
        graph_ms = self._time_ms(lambda: self._run_uniform(items, lay, shape), reps)
        keep = self._keeps(graph_ms, eager_ms)
        self.autotune_table.append({"uniform": list(shape), "eager_ms": round(eager_ms, 3),
                                    "graph_ms": round(graph_ms, 3), "kept": keep})
        if not keep:
            del self.uniform_graphs[shape], self._uniform_out[shape]
            self._uniform_rejected.add(shape)

    def _random_pixels(self, rows: int) -> torch.Tensor:
        """Rows in the format items carry (random: zeros could time differently)."""
        shape, dev = (rows, self.tower.patch_dim), self.device
        if self.settings.uint8_pixels:
            return torch.randint(0, 256, shape, dtype=torch.uint8, device=dev)
        return torch.randn(shape, device=dev)

    def _synthetic_uniform(self, shape: tuple[int, int]) -> list[VisionItem]:
        return [VisionItem(self._random_pixels(t * h * w), (t, h, w)) for t, h, w in self.tower.uniform_grids(shape)]

    def _layout(self, items: list[VisionItem]) -> BatchLayout:
        return self.tower.layout([it.grid for it in items])

    def _note_uniform(self, shape: tuple[int, int]) -> None:
        """Count an equal-length shape that has no graph; queue it for capture at the threshold."""
        after = self.settings.uniform_capture_after
        if (not after or shape in self._uniform_rejected or shape in self._uniform_pending
                or not self.uniform_fits(shape)):
            return
        self._uniform_seen[shape] += 1
        if (self._uniform_seen[shape] >= after
                and len(self.uniform_graphs) + len(self._uniform_pending) < self.settings.max_uniform_graphs):
            self._uniform_pending.append(shape)

    def pending_captures(self):
        """The batcher's idle hook: capture one queued shape (so a request arriving meanwhile waits
        for one capture at most), or None when traffic has queued none."""
        return (lambda: self.capture_pending(limit=1)) if self._uniform_pending else None

    @torch.inference_mode()
    def capture_pending(self, limit: int | None = None) -> int:
        """Capture the uniform shapes queued by traffic, at most `limit` of them (call when idle).
        Returns how many were kept."""
        kept = done = 0
        with self._lock:
            while self._uniform_pending and (limit is None or done < limit):
                shape = self._uniform_pending.pop(0)
                t0 = time.perf_counter()
                try:
                    # Few timing runs: this blocks the replica's queue (once per shape).
                    kept += self._capture_uniform(shape, tune=self.settings.autotune, reps=3)
                except Exception:  # e.g. out of memory: serve this shape from the budget graphs
                    log.exception("capturing the uniform vision graph %s failed", shape)
                    self.uniform_graphs.pop(shape, None)
                    self._uniform_out.pop(shape, None)
                    self._uniform_rejected.add(shape)
                done += 1
                self.stats.idle_captures += 1
                self.stats.idle_capture_ms += 1e3 * (time.perf_counter() - t0)
        return kept

    def _synthetic_batch(self, budget: int, equal: bool = True) -> list[VisionItem]:
        """Images that fill `budget` tokens exactly.

        With `equal=False` the first image is split 3:1 so the sequence lengths differ: that is what
        budget graphs serve, since equal-length batches get exact-shape graphs of their own.
        """
        unit = self.tower.budget_unit
        sizes, left = [], budget
        while left > 0:
            sizes.append(min(1024, left))  # 1024 patches = a 512x512 image
            left -= sizes[-1]
        first = sizes[0] * 3 // 4 // unit * unit
        if not equal and 0 < first < sizes[0]:
            sizes[:1] = [first, sizes[0] - first]
        sizes = sizes[: self.settings.max_items_per_batch]
        return [VisionItem(self._random_pixels(n), self.tower.synthetic_grid(n)) for n in sizes]

    def _time_ms(self, fn, reps: int = TUNE_RUNS) -> float:
        return statistics.median(cuda_times_ms(fn, reps, warmup=TUNE_WARMUP))

    @torch.inference_mode()
    def autotune(self) -> None:
        """Per budget: time graph vs eager on a batch of unequal lengths that fills it, and drop graphs
        that are not faster. Eager on equal lengths (dense attention, no padding) is timed too: for an
        equal-length batch without a graph of its own, dispatch picks whichever of the two is faster.
        With `settings.tune_cache`, the table that a replica measured for the same GPU, tower, settings
        and code is applied instead of timing, and one measured here is kept for the next."""
        cache, source = self.settings.tune_cache, "measured"
        if cache is None:
            self._measure()
        else:
            source = cache.applied_or_measured(self._apply, lambda: self._measure() or self.autotune_table)
        log.info("vision graph auto-tune, %s (budget or uniform shape, eager ms, graph ms, kept):\n%s", source,
                 "\n".join(f"  {str(r.get('budget', r.get('uniform'))):>10} {r['eager_ms']:>9.3f} "
                           f"{r['graph_ms']:>9.3f} {r['kept']}" for r in self.autotune_table))

    def _measure(self) -> None:
        self.autotune_table = [self._tune_budget(b) for b in sorted(self.graphs)]
        for shape in list(self.uniform_graphs):
            items = self._synthetic_uniform(shape)
            self._tune_uniform(shape, items, self._layout(items))

    def _apply(self, table: list[dict]) -> bool:
        """Another replica's auto-tune table, if it covers exactly the graphs captured here: its times, and
        the drops this replica's settings make of them, as `_measure` would have (the cache key does not
        hold `eager_when_faster`, so the file's own `kept` is not trusted). False (nothing changed) otherwise."""
        def valid(r, times) -> bool:
            return isinstance(r, dict) and isinstance(r.get("kept"), bool) and all(
                isinstance(r.get(k), int | float) for k in times)

        if not all(valid(r, ("eager_ms", "eager_equal_ms", "graph_ms")) if "budget" in r
                   else valid(r, ("eager_ms", "graph_ms")) and "uniform" in r for r in table):
            return False  # a foreign or damaged file: checked whole before anything changes
        rows = [{**r, "kept": self._keeps(r["graph_ms"], r["eager_ms"])} for r in table]
        budgets = {r["budget"]: r for r in rows if "budget" in r}
        uniform = {tuple(r["uniform"]): r for r in rows if "uniform" in r}
        if set(budgets) != set(self.graphs) or set(uniform) != set(self.uniform_graphs):
            return False
        for b, r in budgets.items():
            self._tuned[b] = (r["eager_ms"], r["eager_equal_ms"], r["graph_ms"])
            if not r["kept"]:
                del self.graphs[b], self._graph_out[b]
        for shape, r in uniform.items():
            if not r["kept"]:
                del self.uniform_graphs[shape], self._uniform_out[shape]
                self._uniform_rejected.add(shape)
        self.autotune_table = rows
        return True

    def _keeps(self, graph_ms: float, eager_ms: float) -> bool:
        """Whether auto-tune keeps a captured graph: where it is faster than eager, or always without eager
        where a graph fits (`eager_when_faster` off, the fused placement's default). Under `fused` a dropped
        budget sends every batch that only it or a larger dropped one would hold to eager, and an eager batch
        there is launch-bound on the GIL that the engine's thread shares: on one H200 at 220 req/s, 181 of a
        window's 238 tower batches went eager ("no_graph"), at 9.35 GPU ms a request against 4.18 at 200
        req/s, and the tower's queue took over the time to first token (2026-12-03, results)."""
        return graph_ms < eager_ms or not self.settings.eager_when_faster

    # ------------------------------------------------------------------ run
    def _split(self, main: torch.Tensor, deepstack: list[torch.Tensor], lay: BatchLayout,
               copy: bool = True) -> list[VisionEmbedding]:
        """Per-item views; with `copy` (graph outputs, which the next replay overwrites) the real rows
        of every output are copied out first, in one kernel."""
        if copy:
            n_out = lay.num_out
            main, *deepstack = torch.stack([main[:n_out], *(d[:n_out] for d in deepstack)]).unbind(0)
        return [VisionEmbedding(main[s], [d[s] for d in deepstack]) for s in lay.item_slices()]

    def _run_eager(self, items: list[VisionItem], lay: BatchLayout) -> list[VisionEmbedding]:
        dev = self.device
        if self._staging is not None:
            pixels = self._staging.to_device([it.pixels for it in items])
        elif len(items) > 1:
            pixels = torch.cat([it.pixels.to(dev, non_blocking=True) for it in items])
        else:
            pixels = items[0].pixels.to(dev, non_blocking=True)
        inp = TowerBatch(pixels, self.metadata.get(lay, None, lay.uniform), max(lay.seq_lens), lay.uniform)
        main, deepstack = self.tower(inp)
        return self._split(main, deepstack, lay, copy=False)

    def _run_graph(self, items: list[VisionItem], lay: BatchLayout, budget: int) -> list[VisionEmbedding]:
        self._fill(items, lay, budget)
        if self.capture_enabled:
            self.graphs[budget].replay()
            main, deepstack = self._graph_out[budget]
        else:
            main, deepstack = self.tower(self._static_inputs(budget))
        self._mark_pixels_read()
        return self._split(main, deepstack, lay)

    def _run_uniform(self, items: list[VisionItem], lay: BatchLayout, shape: tuple[int, int]) -> list[VisionEmbedding]:
        self._fill(items, lay, lay.num_tokens, shape)
        self.uniform_graphs[shape].replay()
        self._mark_pixels_read()
        main, deepstack = self._uniform_out[shape]
        return self._split(main, deepstack, lay)

    def _mark_pixels_read(self) -> None:
        """With staging, the next batch's copy (on its own stream) must wait for this forward only."""
        if self._staging is not None:
            self._pixels_read = torch.cuda.Event()
            self._pixels_read.record()

    def encode(self, items: list[VisionItem], force_eager: bool = False) -> list[VisionEmbedding]:
        """Encode one batch (images and videos may be mixed); results in item order."""
        return self.encode_batch(items, force_eager)[0]

    @torch.inference_mode()
    def encode_batch(self, items: list[VisionItem], force_eager: bool = False) -> tuple[list[VisionEmbedding], int]:
        """Like encode, also returning the tokens processed: the budget replayed, or the real tokens."""
        if not items:
            return [], 0
        for it in items:
            t, h, w = it.grid
            if it.pixels.shape[0] != t * h * w:
                raise ValueError(f"item has {it.pixels.shape[0]} patch rows but grid {it.grid} needs {t * h * w}")
            if (it.pixels.dtype == torch.uint8) != self.settings.uint8_pixels:
                want = "uint8 (raw)" if self.settings.uint8_pixels else "normalised float"
                raise ValueError(f"item pixels are {it.pixels.dtype}; this manager takes {want} rows")
        lay = self.tower.layout([it.grid for it in items])
        with self._lock:
            shape = None if force_eager else self._uniform_graph_for(lay)
            d = Dispatch(None, "forced")
            if shape is None and not force_eager:
                if self.observed is not None:
                    self.observed.poll()  # the batches whose times have come in since
                d = self.dispatch(lay, explore=True)
            budget = d.budget
            timed = self.observed is not None and d.bucket is not None  # a uniform graph or forced: no choice
            mark = self.observed.start() if timed else None
            if shape is not None:
                out = self._run_uniform(items, lay, shape)
                self.stats.graph_hits += 1
                self.stats.uniform_hits += 1
            elif budget is None:
                out = self._run_eager(items, lay)
                self.stats.eager_batches += 1
                self.stats.eager_reasons[d.reason] += 1
            else:
                out = self._run_graph(items, lay, budget)
                self.stats.graph_hits += 1
                self.stats.per_budget[budget] += 1
                self.stats.padded_tokens += budget - lay.num_tokens
            if timed:
                self.observed.finish(mark, d.bucket, EAGER if budget is None else GRAPH, d.predicted_ms)
            self.stats.real_tokens += lay.num_tokens
            self.stats.items += len(items)
        return out, budget or lay.num_tokens

    def _uniform_graph_for(self, lay: BatchLayout) -> tuple[int, int] | None:
        """The exact-shape graph for an equal-length batch, if captured (else the shape is counted)."""
        shape = lay.uniform
        if shape is None or not self.capture_enabled or lay.num_items > self.settings.max_items_per_batch:
            return None
        if shape in self.uniform_graphs:
            return shape
        self._note_uniform(shape)
        return None
