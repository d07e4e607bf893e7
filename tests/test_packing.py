"""Packing and chunking invariants (hypothesis), the batcher's routing, chunking exactness, cache."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.vision.graphs import VisionItem
from app.vision.packing import Limits, Piece, chunk_video, pack

limits_st = st.builds(Limits, max_tokens=st.integers(16, 4096), max_items=st.integers(1, 16),
                      max_seqs=st.integers(1, 32))
pieces_st = st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 40), st.floats(0, 100)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(limits_st, pieces_st)
def test_pack_places_every_piece_once_within_limits(limits, raw):
    pieces = [Piece(key=i, tokens=t, seqs=s, age=a) for i, (t, s, a) in enumerate(raw)]
    batches = pack(pieces, limits)
    placed = [p.key for b in batches for p in b]
    assert sorted(placed) == list(range(len(pieces)))  # exactly once
    for b in batches:
        assert b
        oversize = len(b) == 1 and (b[0].tokens > limits.max_tokens or b[0].seqs > limits.max_seqs)
        if not oversize:
            assert sum(p.tokens for p in b) <= limits.max_tokens
            assert sum(p.seqs for p in b) <= limits.max_seqs
            assert len(b) <= limits.max_items
    if pieces:  # the oldest piece is never left behind larger ones
        assert batches[0][0].age == min(p.age for p in pieces)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200), st.integers(1, 40), st.integers(1, 40), limits_st)
def test_chunks_cover_the_video_and_fit(t, h, w, limits):
    ranges = chunk_video((t, h, w), limits)
    assert ranges[0][0] == 0 and ranges[-1][1] == t
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    if h * w <= limits.max_tokens:
        for s, e in ranges:
            assert (e - s) * h * w <= limits.max_tokens and e - s <= limits.max_seqs
    else:
        assert ranges == [(0, t)]


@pytest.fixture(scope="module")
def service(tiny_checkpoint):
    from app.config import AppConfig
    from app.vision.service import EncoderService

    cfg = AppConfig(model=str(tiny_checkpoint), encoder={"token_budgets": [64, 128, 256], "max_items_per_batch": 4,
                                                         "max_frames_per_batch": 6, "batch_wait_ms": 20})
    return EncoderService(cfg, str(tiny_checkpoint))


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _items(grids, seed):
    """Raw uint8 patch rows, as the router sends them."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (t * h * w, 1536), generator=g, dtype=torch.uint8).numpy(), (t, h, w),
             f"k{seed}-{i}") for i, (t, h, w) in enumerate(grids)]


def test_chunked_long_video_equals_the_unchunked_encoding(service):
    (px, grid, _), = _items([(20, 4, 4)], seed=1)  # 20 temporal groups > 6 per batch: 4 chunks
    before, eager = service.batcher.stats.batches, service.manager.stats.eager_batches
    out = asyncio.run(service.encode_async([(px, grid, None)]))[0]
    assert service.batcher.stats.batches - before == 4  # 6 + 6 + 6 + 2 groups
    assert service.manager.stats.eager_batches == eager  # every chunk took the static-shape path
    whole = service.manager.encode([VisionItem(torch.from_numpy(px), grid)], force_eager=True)[0]
    assert out[0].shape == whole.main.shape == (20 * 4 * 4 // 4, 64)
    assert _rel(out[0], whole.main) <= 1e-6
    for a, b in zip(out[1], whole.deepstack, strict=True):
        assert _rel(a, b) <= 1e-6


def test_concurrent_requests_share_batches_and_get_their_own_results(service):
    reqs = [_items([(1, 4, 4), (2, 2, 4)], seed=100 + r) for r in range(8)]

    async def run_all():
        return await asyncio.gather(*(service.encode_async(r) for r in reqs))

    b0, p0 = service.batcher.stats.batches, service.batcher.stats.pieces
    results = asyncio.run(run_all())
    batches, pieces = service.batcher.stats.batches - b0, service.batcher.stats.pieces - p0
    assert pieces == 16 and batches < pieces
    for r, res in zip(reqs, results):
        alone = service.encode([(px, g) for px, g, _ in r])
        for (m, ds), (m0, ds0) in zip(res, alone, strict=True):
            assert _rel(m, m0) <= 1e-5 and all(_rel(a, b) <= 1e-5 for a, b in zip(ds, ds0))


def test_repeated_items_hit_the_cache_and_skip_the_encoder(service):
    items = _items([(1, 4, 6)], seed=7)
    first = asyncio.run(service.encode_async(items))
    batches, hits = service.batcher.stats.batches, service.cache.hits
    again = asyncio.run(service.encode_async(items))
    assert service.batcher.stats.batches == batches and service.cache.hits == hits + 1
    assert torch.equal(first[0][0], again[0][0])


def test_a_cancelled_request_leaves_the_queue(service):
    async def scenario():
        first = asyncio.ensure_future(service.encode_async(_items([(1, 2, 4)], seed=8)))
        for _ in range(3):  # an idle encoder starts at once: this batch is now running in its thread
            await asyncio.sleep(0)
        task = asyncio.ensure_future(service.encode_async(_items([(1, 4, 4)], seed=9)))
        await asyncio.sleep(0)  # queued behind the running batch (then batch_wait_ms = 20 for the next)
        task.cancel()
        kept = await service.encode_async(_items([(1, 2, 2)], seed=10))
        await first
        return task, kept

    before = service.batcher.stats.cancelled_pieces
    task, kept = asyncio.run(scenario())
    assert task.cancelled() and len(kept) == 1
    assert service.batcher.stats.cancelled_pieces == before + 1


def test_cache_is_bounded_in_bytes():
    from app.vision.cache import EmbeddingCache, entry_bytes

    e = (torch.zeros(10, 4), [torch.zeros(10, 4)])
    cache = EmbeddingCache(max_bytes=3 * entry_bytes(e))
    for i in range(5):
        cache.put(f"k{i}", e)
    assert len(cache) == 3 and cache.bytes <= cache.max_bytes
    assert cache.get("k0") is None and cache.get("k4") is not None  # least recently used went first


def echo_batch(sizes: list[int] | None = None, sleep_s: float = 0.0):
    """A stand-in for the tower's batch: each item's first row back, batch sizes recorded in `sizes`."""
    import time

    from app.vision.graphs import VisionEmbedding

    def run_batch(items):
        if sizes is not None:
            sizes.append(len(items))
        time.sleep(sleep_s)
        return [VisionEmbedding(it.pixels[:1], []) for it in items], sum(it.pixels.shape[0] for it in items)

    return run_batch


def test_the_batcher_runs_its_idle_task_after_the_queue_drains():
    """Deferred work (the encoder's uniform-graph captures) runs between rounds, never mid-batch."""
    from app.vision.batcher import EncodeBatcher
    from app.vision.graphs import VisionEmbedding

    events = []

    def run_batch(items):
        events.append(("batch", len(items)))
        return [VisionEmbedding(it.pixels[:1], []) for it in items], sum(it.pixels.shape[0] for it in items)

    def on_idle():  # deferred work only while there is some: here, once
        return None if ("idle",) in events else (lambda: events.append(("idle",)))

    batcher = EncodeBatcher(run_batch, Limits(64, 4, 4), wait_ms=5, on_idle=on_idle)

    async def scenario():
        out = await batcher.submit([(torch.full((4, 8), 1.0), (1, 2, 2)), (torch.full((4, 8), 2.0), (1, 2, 2))])
        for _ in range(100):
            if ("idle",) in events:
                break
            await asyncio.sleep(0.01)
        return out

    out = asyncio.run(scenario())
    assert [o.main[0, 0].item() for o in out] == [1.0, 2.0]
    assert events == [("batch", 2), ("idle",)]


def test_a_failing_metrics_hook_or_round_never_strands_a_request():
    """A raising `on_batch` (the metrics hook) used to kill the batcher's task: the requests it had taken
    from the queue, and every later one, waited for ever. Now the hook's error is logged and the batch
    answered; a round that fails (here: packing raises once) fails its own requests, and the next is served."""
    import app.vision.batcher as batcher_module
    from app.vision.batcher import EncodeBatcher
    from app.vision.graphs import VisionEmbedding

    def run_batch(items):
        return [VisionEmbedding(it.pixels[:1], []) for it in items], sum(it.pixels.shape[0] for it in items)

    def on_batch(*_):
        raise RuntimeError("metrics broke")

    batcher = EncodeBatcher(run_batch, Limits(64, 4, 4), wait_ms=1, on_batch=on_batch)
    item = [(torch.full((4, 8), 3.0), (1, 2, 2))]
    real_pack, calls = batcher_module.pack, []

    def pack_once_broken(pieces, limits):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("packing broke")
        return real_pack(pieces, limits)

    async def scenario():
        first = await asyncio.wait_for(asyncio.gather(batcher.submit(item), batcher.submit(item)), 5)
        batcher_module.pack = pack_once_broken
        try:
            with pytest.raises(ValueError, match="packing broke"):
                await asyncio.wait_for(batcher.submit(item), 5)
            after = await asyncio.wait_for(batcher.submit(item), 5)
        finally:
            batcher_module.pack = real_pack
        return first, after

    first, after = asyncio.run(scenario())
    assert [o[0].main[0, 0].item() for o in first] == [3.0, 3.0] and after[0].main[0, 0].item() == 3.0


def test_an_idle_encoder_starts_at_once_and_a_busy_one_waits_to_batch():
    """No batching wait when no batch ended within `wait_ms` (nothing to batch with: it would only add
    to time to first token); right after a batch, arrivals wait up to `wait_ms` and run together."""

    from app.vision.batcher import EncodeBatcher

    sizes = []
    batcher = EncodeBatcher(echo_batch(sizes, sleep_s=0.05), Limits(64, 4, 4), wait_ms=400)
    px = torch.ones((4, 8))

    async def scenario():
        await batcher.submit([(px, (1, 2, 2))])
        idle_wait = batcher.stats.queue_wait_s_max
        await asyncio.gather(batcher.submit([(px, (1, 2, 2))]), batcher.submit([(px, (1, 2, 2))]))
        return idle_wait

    idle_wait = asyncio.run(scenario())
    assert idle_wait < 0.2  # the idle start did not wait the 400 ms window
    assert sizes == [1, 2]  # the two arrivals right after a batch waited and ran as one batch
    assert batcher.stats.queue_wait_s_max >= 0.3


def test_a_batch_jobs_encoder_waits_for_company_even_when_idle():
    """`wait_when_idle` (batch jobs): the first arrival at an idle encoder waits the window, and one
    that comes meanwhile shares its batch; without it the first runs alone at once."""
    from app.vision.batcher import EncodeBatcher

    def scenario(wait_when_idle: bool) -> list[int]:
        sizes = []
        batcher = EncodeBatcher(echo_batch(sizes), Limits(64, 4, 4), wait_ms=400, wait_when_idle=wait_when_idle)
        px = torch.ones((4, 8))

        async def two_arrivals():
            first = asyncio.ensure_future(batcher.submit([(px, (1, 2, 2))]))
            for _ in range(5):  # the batcher's loop takes the first piece before the second comes
                await asyncio.sleep(0)
            await asyncio.gather(first, batcher.submit([(px, (1, 2, 2))]))

        asyncio.run(two_arrivals())
        return sizes

    assert scenario(wait_when_idle=True) == [2]
    assert scenario(wait_when_idle=False) == [1, 1]


def test_a_backlog_lengthens_the_wait_and_its_end_cuts_it_short():
    """While the consumer has a backlog (the fused engine's waiting requests), even an idle encoder
    waits up to `backlog_wait_ms` for company; when the backlog clears, the batch runs within a poll
    instead of waiting out the window. Without a backlog the idle encoder starts at once."""
    import time

    from app.vision.batcher import EncodeBatcher

    def scenario(backlog: list[bool], clear_after_s: float | None) -> tuple[list[int], float]:
        sizes = []
        batcher = EncodeBatcher(echo_batch(sizes), Limits(64, 4, 4), wait_ms=1, backlog_wait_ms=3000,
                                backlog=lambda: backlog[0])
        px = torch.ones((4, 8))

        async def two_arrivals():
            t0 = time.monotonic()
            first = asyncio.ensure_future(batcher.submit([(px, (1, 2, 2))]))
            await asyncio.sleep(0.1)
            second = asyncio.ensure_future(batcher.submit([(px, (1, 2, 2))]))
            if clear_after_s is not None:
                await asyncio.sleep(clear_after_s)
                backlog[0] = False
            await asyncio.gather(first, second)
            return time.monotonic() - t0

        return sizes, asyncio.run(two_arrivals())

    sizes, took = scenario([True], clear_after_s=0.2)
    assert sizes == [2]  # the first arrival waited for the second
    assert 0.25 <= took < 0.3 + 1.0  # and ran soon after the backlog cleared, far inside the 3 s window
    sizes, took = scenario([False], clear_after_s=None)
    assert sizes == [1, 1]  # no backlog: each arrival at the idle encoder ran at once


def test_no_backlog_wait_without_a_longer_window():
    """`backlog_wait_ms` at or below `wait_ms` (the default 0: off) leaves the batcher as before: the
    backlog is not even asked."""
    from app.vision.batcher import EncodeBatcher

    asked = []
    batcher = EncodeBatcher(echo_batch(), Limits(64, 4, 4), wait_ms=5, backlog=lambda: asked.append(1) or True)
    out = asyncio.run(batcher.submit([(torch.ones((4, 8)), (1, 2, 2))]))
    assert len(out) == 1 and asked == []


def test_a_failing_backlog_signal_does_not_stop_the_batcher():
    """A backlog signal that raises counts as no backlog: the batch still runs, and later ones too."""
    from app.vision.batcher import EncodeBatcher

    def broken():
        raise RuntimeError("engine gone")

    batcher = EncodeBatcher(echo_batch(), Limits(64, 4, 4), wait_ms=1, backlog_wait_ms=3000, backlog=broken)

    async def twice():
        px = torch.ones((4, 8))
        return [await asyncio.wait_for(batcher.submit([(px, (1, 2, 2))]), 2.0) for _ in range(2)]

    assert [len(o) for o in asyncio.run(twice())] == [1, 1]


def test_a_queue_that_makes_a_whole_batch_does_not_wait_out_the_window():
    """Items up to the item cap (not only tokens up to the largest budget) end the wait: a longer one
    could add nothing to the batch."""
    import time

    from app.vision.batcher import EncodeBatcher

    sizes = []
    batcher = EncodeBatcher(echo_batch(sizes), Limits(1024, 2, 8), wait_ms=3000, wait_when_idle=True)
    px = torch.ones((4, 8))

    async def two():
        t0 = time.monotonic()
        await asyncio.gather(batcher.submit([(px, (1, 2, 2))]), batcher.submit([(px, (1, 2, 2))]))
        return time.monotonic() - t0

    took = asyncio.run(two())
    assert sizes == [2] and took < 1.0  # two items fill the cap of 2: no 3 s wait



def test_a_requests_encode_time_splits_into_its_wait_its_batch_and_the_loops_lag():
    """EncodeBatcher.submit's `timing`: `wait_s` until the batch running the request's piece began, `run_s`
    that batch, `wake_s` from its result to the request running again. Here the first request starts an
    idle encoder (no wait) and its batch takes 0.1 s; a second arrives 0.02 s in and waits for that batch;
    after each batch something holds the event loop for 0.1 s before the request can resume."""
    import time

    from app.vision.batcher import EncodeBatcher

    sizes = []
    batcher = EncodeBatcher(echo_batch(sizes, sleep_s=0.1), Limits(64, 4, 4), wait_ms=0)
    px = torch.ones((4, 8))

    async def scenario():
        loop = asyncio.get_running_loop()
        # called after each batch, before its results are set: the sleep runs before the waiters resume
        batcher.on_batch = lambda *_: loop.call_soon(time.sleep, 0.1)
        first, second = {}, {}

        async def later():
            await asyncio.sleep(0.02)
            await batcher.submit([(px, (1, 2, 2))], second)

        await asyncio.gather(batcher.submit([(px, (1, 2, 2))], first), later())
        return first, second

    first, second = asyncio.run(scenario())
    assert sizes == [1, 1]
    assert first["wait_s"] < 0.05 and first["run_s"] >= 0.1 and first["wake_s"] >= 0.1
    assert second["wait_s"] >= 0.06  # the first batch's remaining 0.08 s
    assert second["run_s"] >= 0.1 and second["wake_s"] >= 0.1
