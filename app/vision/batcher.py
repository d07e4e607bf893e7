"""Cross-request batching in front of one encoder replica.

Concurrent `submit` calls (one per request) put their items, long videos already cut into chunks
that fit a graph, on one queue. A loop waits at most `wait_ms` after the oldest queued piece (less if
the queue already fills the largest budget), packs the whole queue with `packing.pack`, runs the
batches and scatters the results back. Each round drains the queue, so no piece waits more than one
round; a cancelled request's pieces are dropped before they run. An idle encoder (no batch ended
within the last `wait_ms`) does not wait: with nothing else in flight there is nothing to batch with,
and the wait would only add to time to first token. Under load batches end back to back, so the wait
applies, and pieces arriving during a batch join the next. When to wait longer: `EncodeBatcher.__init__`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .graphs import VisionEmbedding, VisionItem
from .packing import Limits, Piece, chunk_video, pack

log = logging.getLogger(__name__)

RunBatch = Callable[[list[VisionItem]], tuple[list[VisionEmbedding], int]]  # -> outputs, padded tokens
BACKLOG_POLL_S = 0.002  # while waiting on a backlog, how often it is asked whether the backlog is gone


@dataclass
class _Request:
    future: asyncio.Future
    parts: list[list[VisionEmbedding | None]]  # per item, per chunk
    cancelled: bool = False
    ran_at: float = 0.0  # when the batch that ran its last piece began (monotonic)
    done_at: float = 0.0  # when its last piece's batch had run and its result was set

    def fill(self, item: int, chunk: int, out: VisionEmbedding, ran_at: float) -> None:
        self.parts[item][chunk] = out
        self.ran_at = max(self.ran_at, ran_at)
        if self.future.done() or any(p is None for chunks in self.parts for p in chunks):
            return
        self.done_at = time.monotonic()
        merged = []
        for chunks in self.parts:
            if len(chunks) == 1:
                merged.append(chunks[0])
            else:  # temporal chunks of one video: concatenate in time order
                merged.append(VisionEmbedding(torch.cat([c.main for c in chunks]),
                                              [torch.cat(ds) for ds in zip(*[c.deepstack for c in chunks])]))
        self.future.set_result(merged)

    def fail(self, err: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(err)


@dataclass
class _Queued:
    req: _Request
    item: int
    chunk: int
    vision: VisionItem
    enqueued: float


@dataclass
class BatcherStats:
    batches: int = 0
    pieces: int = 0
    tokens: int = 0
    budget_tokens: int = 0
    queue_wait_s_total: float = 0.0
    queue_wait_s_max: float = 0.0
    cancelled_pieces: int = 0

    def as_dict(self) -> dict:
        return {
            "batches": self.batches,
            "pieces": self.pieces,
            "items_per_batch": self.pieces / self.batches if self.batches else 0.0,
            "batch_fill": self.tokens / self.budget_tokens if self.budget_tokens else 0.0,
            "queue_wait_ms_mean": 1e3 * self.queue_wait_s_total / self.pieces if self.pieces else 0.0,
            "queue_wait_ms_max": 1e3 * self.queue_wait_s_max,
            "cancelled_pieces": self.cancelled_pieces,
            "batch_tokens": self.tokens,
            "batch_budget_tokens": self.budget_tokens,
        }


class EncodeBatcher:
    def __init__(self, run_batch: RunBatch, limits: Limits, wait_ms: float = 2.0, wait_when_idle: bool = False,
                 on_batch: Callable[[float, float, list[float]], None] | None = None,
                 on_idle: Callable[[], Callable[[], object] | None] | None = None,
                 backlog_wait_ms: float = 0.0, backlog: Callable[[], bool] | None = None):
        """`on_batch(latency_s, fill, queue_waits_s)` is called after every batch (metrics).
        `on_idle()` is called whenever the queue drains; it returns deferred work (graph captures)
        to run in a worker thread, or None when there is none. `backlog()` (may be set later, by the
        fused replica once its engine exists) says whether the consumer of the embeddings has work
        queued; while it has, the wait is `backlog_wait_ms` when that is the longer one.

        A batch job wants full batches, not first tokens: with `wait_when_idle` the wait applies
        always. Under the `fused` placement the tower shares its GPU with the engine: while the engine
        has requests waiting for a sequence slot or KV blocks, a piece encoded now would wait there
        anyway, so the batcher may wait longer for a fuller batch, which costs the GPU less per item.
        Why it matters: arrivals spread out in time, as real traffic arrives, make small batches under
        the short wait (benchmarks/results/2026-11-26-routing-ab-four-h100s-poisson.md)."""
        self.run_batch, self.limits, self.wait_s = run_batch, limits, wait_ms / 1000
        self.wait_when_idle = wait_when_idle
        self.backlog_wait_s, self.backlog = backlog_wait_ms / 1000, backlog
        self.on_batch, self.on_idle = on_batch, on_idle
        self.stats = BatcherStats()
        self._queue: list[_Queued] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._last_end = float("-inf")  # when the last batch ended (monotonic)

    async def submit(self, items: list[tuple[torch.Tensor, tuple[int, int, int]]],
                     timing: dict | None = None) -> list[VisionEmbedding]:
        """The items' embeddings, in order. `timing` (a dict), if given, gets where the request's time
        went, in seconds: `wait_s` in the queue until the batch that ran its last piece began (the
        window, and the batches ahead of it), `run_s` that batch (the hop to a worker thread, the
        tower's host work and launches), `wake_s` from its result to this coroutine running again
        (the event loop's lag: the replica's other requests' chunks go through the same loop)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = loop.create_task(self._run())
        now = time.monotonic()
        req = _Request(loop.create_future(), [])
        for i, (pixels, (t, h, w)) in enumerate(items):
            ranges = chunk_video((t, h, w), self.limits)
            req.parts.append([None] * len(ranges))
            for c, (s, e) in enumerate(ranges):
                rows = pixels[s * h * w:e * h * w] if len(ranges) > 1 else pixels
                self._queue.append(_Queued(req, i, c, VisionItem(rows, (e - s, h, w)), now))
        self._wakeup.set()
        try:
            out = await req.future
        except asyncio.CancelledError:
            req.cancelled = True
            raise
        if timing is not None:
            timing.update(wait_s=req.ran_at - now, run_s=req.done_at - req.ran_at, wake_s=time.monotonic() - req.done_at)
        return out

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                await self._wait_for_batch()
                queued, self._queue = self._queue, []
                try:
                    live = [q for q in queued if not q.req.cancelled]
                    self.stats.cancelled_pieces += len(queued) - len(live)
                    pieces = [Piece(q, q.vision.pixels.shape[0], q.vision.grid[0], q.enqueued) for q in live]
                    for batch in pack(pieces, self.limits):
                        await self._run_one([p.key for p in batch])
                except Exception as e:  # noqa: BLE001 - the round's requests fail; the batcher goes on
                    # (packing or merging a request's pieces raised: without this the task died, and these
                    # requests, and every later one, waited for ever)
                    log.exception("encoder batching round failed")
                    for q in queued:
                        q.req.fail(e)
            work = self.on_idle() if self.on_idle is not None else None
            if work is not None:
                try:
                    await asyncio.to_thread(work)
                except Exception:  # a failed capture must not stop the batcher
                    log.exception("encoder idle task failed")

    def _backlogged(self) -> bool:
        if self.backlog is None or self.backlog_wait_s <= self.wait_s:
            return False
        try:
            return bool(self.backlog())
        except Exception:  # a broken signal must not stop the batcher: batch as without one
            log.exception("encoder backlog signal failed")
            return False

    def _queue_full(self) -> bool:
        """The queue already makes a whole batch: the largest budget's tokens, or the item or sequence cap."""
        q, lim = self._queue, self.limits
        return (len(q) >= lim.max_items or sum(p.vision.pixels.shape[0] for p in q) >= lim.max_tokens
                or sum(p.vision.grid[0] for p in q) >= lim.max_seqs)

    async def _wait_for_batch(self) -> None:
        """Until the oldest piece has waited the window (wait_ms, or backlog_wait_ms while there is a
        backlog), or the queue already makes a whole batch; not at all when the encoder was idle and
        there is no backlog (unless `wait_when_idle`). A backlog that clears is seen within
        BACKLOG_POLL_S, and the window is then wait_ms again, from the oldest piece."""
        if not (self.wait_when_idle or self._backlogged()) and time.monotonic() - self._last_end > self.wait_s:
            return
        while self._queue:
            backlogged = self._backlogged()
            oldest = min(q.enqueued for q in self._queue)
            left = oldest + (self.backlog_wait_s if backlogged else self.wait_s) - time.monotonic()
            if left <= 0 or self._queue_full():
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=min(left, BACKLOG_POLL_S) if backlogged else left)
            except TimeoutError:
                if not backlogged:
                    return

    async def _run_one(self, batch: list[_Queued]) -> None:
        batch = [q for q in batch if not q.req.cancelled]
        if not batch:
            return
        start = time.monotonic()
        waits = [start - q.enqueued for q in batch]
        self.stats.queue_wait_s_total += sum(waits)
        self.stats.queue_wait_s_max = max(self.stats.queue_wait_s_max, *waits)
        try:
            outs, padded = await asyncio.to_thread(self.run_batch, [q.vision for q in batch])
        except Exception as e:  # one bad batch fails only its own requests
            for q in batch:
                q.req.fail(e)
            return
        finally:
            self._last_end = time.monotonic()
        tokens = sum(q.vision.pixels.shape[0] for q in batch)
        self.stats.batches += 1
        self.stats.pieces += len(batch)
        self.stats.tokens += tokens
        self.stats.budget_tokens += padded
        if self.on_batch is not None:
            try:
                self.on_batch(time.monotonic() - start, tokens / padded if padded else 1.0, waits)
            except Exception:  # noqa: BLE001 - metrics must not fail the batch they describe
                log.exception("encoder on_batch hook failed")
        for q, out in zip(batch, outs):
            try:
                q.req.fill(q.item, q.chunk, out, start)
            except Exception as e:  # noqa: BLE001 - its request fails, the batch's others are answered
                q.req.fail(e)
