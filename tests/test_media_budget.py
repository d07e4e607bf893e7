"""The process's budget of media payload bytes in flight (app/media/budget.py): bursts of large items
wait for room or get a retryable 503, never the replica's memory; every item's bytes come back after
success, failure and cancellation (a client gone), and only once its decode job has really ended."""

from __future__ import annotations

import asyncio
import base64
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pydantic
import pytest

import app.media.pipeline as pipeline
from app.api.chat import unwrap_client_error
from app.api.retry import is_replica_failure
from app.config import MediaConfig
from app.errors import ClientError, Overloaded
from app.media.budget import ByteBudget, budget_for
from app.media.fetch import fetch, inline_size
from app.media.pipeline import MediaPipeline
from app.media.preprocess import PatchSpec
from app.media.ref import MediaRef
from app.media.synthetic import image_bytes
from netfakes import MediaServer

BIG = bytes(range(256)) * 4096  # 1 MiB: sixteen 64 KiB chunks
IMAGE_URL = "data:image/png;base64," + base64.b64encode(image_bytes(20, 30, 0, "PNG")).decode()


@pytest.fixture(scope="module")
def server():
    s = MediaServer(BIG)
    yield s
    s.close()


def http_cfg(capacity: int, wait_s: float, **kw) -> MediaConfig:
    return MediaConfig(allow_private_networks=True, max_media_bytes=len(BIG), max_media_bytes_in_flight=capacity,
                       media_bytes_wait_s=wait_s, **kw)


async def until(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


def test_reservations_past_the_budget_wait_in_line_then_get_a_retryable_503():
    async def main():
        b = ByteBudget(100, wait_s=10)
        await b.acquire(60)
        await b.acquire(30)  # fits: at once
        big = asyncio.ensure_future(b.acquire(50))
        small = asyncio.ensure_future(b.acquire(5))  # would fit, but waits behind `big`: no starving it
        await asyncio.sleep(0.05)
        assert not big.done() and not small.done() and b.used == 90
        threading.Timer(0.05, b.release, (60,)).start()  # released from a worker thread
        await asyncio.wait_for(asyncio.gather(big, small), 5)
        assert b.used == 85
        b.release(85)

        short = ByteBudget(100, wait_s=0.1)
        await short.acquire(100)
        t0 = time.monotonic()
        with pytest.raises(Overloaded) as e:
            await short.acquire(1)
        assert time.monotonic() - t0 >= 0.09
        assert e.value.status == 503 and e.value.code == "overloaded" and e.value.headers == {"Retry-After": "1"}
        assert e.value.to_json()["error"]["type"] == "server_busy"
        assert short.used == 100 and not short._waiters  # the refused wait left nothing behind
        waiter = asyncio.ensure_future(short.acquire(10))
        await asyncio.sleep(0.02)
        waiter.cancel()  # its client left while it waited
        with pytest.raises(asyncio.CancelledError):
            await waiter
        short.release(100)
        assert short.used == 0 and not short._waiters
        with pytest.raises(ClientError) as e:
            await short.acquire(101)  # more than the whole budget: the client's fault, never a 503
        assert e.value.status == 413 and e.value.code == "media_too_large"

    asyncio.run(main())


def test_room_granted_to_a_waiter_whose_event_loop_has_closed_is_given_back():
    """A waiter on a loop that closed (a warm-up thread's, say) cannot be told, and would never release
    what it was granted: the grant returns to the budget at once, and the next waiter gets the room."""
    b = ByteBudget(100, wait_s=10)

    async def hold_all_and_wait_on_a_closing_loop():
        await b.acquire(100)
        asyncio.ensure_future(b.acquire(40))  # waits on this loop, which closes under it
        await asyncio.sleep(0.02)

    loop = asyncio.new_event_loop()  # closed with the wait pending, as a thread's loop that just ends
    loop.run_until_complete(hold_all_and_wait_on_a_closing_loop())
    loop.close()
    assert b.used == 100 and len(b._waiters) == 1

    async def main():
        nxt = asyncio.ensure_future(b.acquire(80))  # in line behind the orphan
        await asyncio.sleep(0.02)
        b.release(100)  # the orphan is granted 40, cannot be told, gives them back; then 80 fit
        await asyncio.wait_for(nxt, 5)
        assert b.used == 80 and not b._waiters

    asyncio.run(main())


def test_a_body_reserves_its_declared_length_waits_for_room_then_gets_a_503(server):
    url = f"http://127.0.0.1:{server.port}/img.png"
    cfg = http_cfg(len(BIG) * 3 // 2, 0.2)
    budget = budget_for(cfg)

    async def main():
        assert await fetch(url, cfg, param="p") == BIG
        assert budget.used == 0  # released after success
        await budget.acquire(len(BIG))  # other items hold 1 MiB: the declared 1 MiB body finds no room
        with pytest.raises(Overloaded) as e:
            await fetch(url, cfg, param="p")
        assert e.value.status == 503 and e.value.headers["Retry-After"]
        assert budget.used == len(BIG)  # the refused body holds nothing
        budget.release(len(BIG))
        assert await fetch(url, cfg, param="p") == BIG and budget.used == 0

    asyncio.run(main())


def test_a_fetch_waits_for_room_and_finishes_when_other_items_let_go(server):
    url = f"http://127.0.0.1:{server.port}/img.png"
    cfg = http_cfg(len(BIG) * 3 // 2 + 1, 10.0)
    budget = budget_for(cfg)

    async def main():
        await budget.acquire(len(BIG))
        task = asyncio.ensure_future(fetch(url, cfg, param="p"))
        await until(lambda: len(budget._waiters) == 1)  # it waits for room for its declared length
        assert not task.done()
        budget.release(len(BIG))
        assert await asyncio.wait_for(task, 10) == BIG
        assert budget.used == 0

    asyncio.run(main())


def test_bodies_that_together_exceed_the_budget_take_turns_instead_of_all_timing_out(server):
    """Two 1 MiB bodies on a 1.5 MiB budget. Reserved as they arrived, each received about 768 KiB, then
    both waited for room that only the other could give: both waited out media_bytes_wait_s, and one or
    both were refused after downloading most of their body. Each now reserves its declared length before
    reading, so the second waits until the first is done, and both succeed. (Each body comes in two
    halves 0.3 s apart, so that both are half received at once.)"""
    url = f"http://127.0.0.1:{server.port}/halves"
    cfg = http_cfg(len(BIG) * 3 // 2, 3.0)
    budget = budget_for(cfg)

    async def main():
        got = await asyncio.wait_for(asyncio.gather(fetch(url, cfg, param="a"), fetch(url, cfg, param="b")), 20)
        assert got == [BIG, BIG] and budget.used == 0

    asyncio.run(main())


def test_an_item_that_holds_bytes_and_needs_more_goes_ahead_of_new_items():
    """A body without a declared length grows as it arrives: its next bytes go ahead of items that hold
    nothing yet, which would otherwise keep a half-received body waiting behind them."""
    async def main():
        b = ByteBudget(100, wait_s=5)
        growing = b.hold()
        await growing.grow_to(50)
        await b.acquire(40)  # another item holds 40: 10 left
        new = asyncio.ensure_future(b.acquire(30))  # a new item waits first
        await asyncio.sleep(0.02)
        more = asyncio.ensure_future(growing.grow_to(80))  # then the half-received body needs 30 more
        await asyncio.sleep(0.02)
        b.release(40)  # 50 free: the growing body's 30 first, then the new item's 30 no longer fits
        await asyncio.wait_for(more, 5)
        assert growing.held == 80 and not new.done() and b.used == 80
        growing.release()
        await asyncio.wait_for(new, 5)
        assert b.used == 30

    asyncio.run(main())


def test_the_fetch_deadline_while_waiting_for_room_is_an_overload_not_a_bad_source(server):
    url = f"http://127.0.0.1:{server.port}/img.png"
    cfg = http_cfg(len(BIG) * 3 // 2 + 2, 10.0, fetch_timeout_s=0.5)
    budget = budget_for(cfg)

    async def main():
        await budget.acquire(len(BIG))
        with pytest.raises(ClientError) as e:
            await fetch(url, cfg, param="p")
        assert e.value.status == 503 and e.value.code == "overloaded"
        budget.release(len(BIG))
        assert budget.used == 0

    asyncio.run(main())


def test_failed_and_cancelled_fetches_give_their_bytes_back(server):
    base = f"http://127.0.0.1:{server.port}"
    cfg = http_cfg(len(BIG) * 3 // 2 + 3, 5.0)
    budget = budget_for(cfg)

    async def main():
        with pytest.raises(ClientError) as e:
            await fetch(f"{base}/endless", cfg, param="p")  # reserves up to the cap, then 413
        assert e.value.status == 413 and budget.used == 0
        task = asyncio.ensure_future(fetch(f"{base}/stall", cfg, param="p"))  # 256 KiB, then nothing
        await until(lambda: budget.used >= 256 << 10)
        task.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await task
        assert budget.used == 0
        assert await fetch(f"{base}/img.png", cfg, param="p") == BIG and budget.used == 0

    asyncio.run(main())


def test_a_file_reserves_the_cap_then_only_its_size(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    cfg = MediaConfig(allowed_local_media_path=str(tmp_path), max_media_bytes=1 << 20,
                      max_media_bytes_in_flight=(1 << 20) + 4)
    budget = budget_for(cfg)

    async def main():
        hold = budget.hold("p")
        assert await fetch(f"file://{tmp_path}/a.bin", cfg, param="p", hold=hold) == b"x" * 1000
        assert hold.held == budget.used == 1000  # the caller keeps the bytes: still reserved
        hold.release()
        hold.release()  # once only
        assert budget.used == 0

    asyncio.run(main())


@pytest.fixture
def gate(monkeypatch):
    """Decode jobs of inline items block until the gate opens."""
    opened, real = threading.Event(), pipeline.prepare_inline

    def gated(*args):
        assert opened.wait(20)
        return real(*args)

    monkeypatch.setattr(pipeline, "prepare_inline", gated)
    yield opened
    opened.set()


def test_an_items_bytes_stay_reserved_until_its_decode_job_ends_even_after_its_client_left(gate):
    size = inline_size(IMAGE_URL)
    budget = ByteBudget(10 * size, 5.0)
    pool = ThreadPoolExecutor(2)
    pipe = MediaPipeline(MediaConfig(), PatchSpec(), pool, budget=budget)
    ref = MediaRef("image", IMAGE_URL, "p")

    async def main():
        task = asyncio.ensure_future(pipe.prepare(ref))
        await until(lambda: budget.used == size)
        task.cancel()  # the client left; its job, already in a thread, holds the bytes until it ends
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert budget.used == size
        gate.set()
        await until(lambda: budget.used == 0)
        assert (await pipe.prepare(ref)).kind == "image" and budget.used == 0  # success
        bad = "data:image/png;base64," + base64.b64encode(b"not an image" * 10).decode()
        with pytest.raises(ClientError) as e:
            await pipe.prepare(MediaRef("image", bad, "p"))  # failure in the decode
        assert e.value.status == 400 and budget.used == 0

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_concurrent_items_beyond_the_budget_wait_or_get_a_503_and_the_budget_comes_back(gate):
    size = inline_size(IMAGE_URL)
    pool = ThreadPoolExecutor(4)
    refs = [MediaRef("image", IMAGE_URL, f"p{i}") for i in range(3)]

    async def main():
        budget = ByteBudget(2 * size, 10.0)  # room for two items
        pipe = MediaPipeline(MediaConfig(), PatchSpec(), pool, budget=budget)
        tasks = [asyncio.ensure_future(pipe.prepare(r)) for r in refs]
        await until(lambda: budget.used == 2 * size and len(budget._waiters) == 1)
        gate.set()  # the first two finish decoding, the third gets their room
        assert [it.kind for it in await asyncio.wait_for(asyncio.gather(*tasks), 20)] == ["image"] * 3
        assert budget.used == 0
        gate.clear()

        budget = ByteBudget(2 * size, 0.2)
        pipe = MediaPipeline(MediaConfig(), PatchSpec(), pool, budget=budget)
        tasks = [asyncio.ensure_future(pipe.prepare(r)) for r in refs]
        done, _ = await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        err = done.pop().exception()
        assert isinstance(err, Overloaded) and err.status == 503 and err.headers == {"Retry-After": "1"}
        gate.set()
        assert len(await asyncio.wait_for(asyncio.gather(*[t for t in tasks if not t.done()]), 20)) == 2
        assert budget.used == 0
        assert (await pipe.prepare(refs[0])).kind == "image" and budget.used == 0

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_the_budget_is_configured_per_process_and_holds_any_valid_item():
    cfg = MediaConfig()
    assert cfg.max_media_bytes_in_flight >= cfg.max_media_bytes
    assert MediaPipeline(cfg, PatchSpec()).budget is MediaPipeline(cfg, PatchSpec()).budget is budget_for(cfg)
    with pytest.raises(pydantic.ValidationError, match="max_media_bytes_in_flight"):
        MediaConfig(max_media_bytes=1000, max_media_bytes_in_flight=999)
    # an item over the per-item limit stays a 413, with a budget exactly that limit
    tight = MediaConfig(max_media_bytes=100, max_media_bytes_in_flight=100)
    url = "data:image/png;base64," + base64.b64encode(b"x" * 200).decode()
    with pytest.raises(ClientError) as e:
        asyncio.run(fetch(url, tight, param="p"))
    assert e.value.status == 413 and e.value.code == "media_too_large" and budget_for(tight).used == 0


def test_the_overload_reaches_the_client_as_a_503_through_ray_and_is_not_retried_as_a_replica_failure():
    err = pickle.loads(pickle.dumps(ByteBudget(10, 1.0).overloaded()))  # as Ray sends it back
    assert isinstance(err, Overloaded) and err.status == 503 and err.headers == {"Retry-After": "1"}
    assert err.to_json()["error"]["code"] == "overloaded"
    try:
        raise RuntimeError("RayTaskError(Overloaded)") from err
    except RuntimeError as wrapped:
        assert unwrap_client_error(wrapped) is err
        assert not is_replica_failure(wrapped)
