"""Replica failures are retried before the first token, never after; client errors never; media
items asked of a MediaPreprocessor replica that died are asked again; one request's items share a
replica's worker slots. Ray's own exception types, fake handles (no cluster)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("ray")
from ray.exceptions import ActorDiedError, RayTaskError  # noqa: E402

from app.api.retry import RetryPolicy, collect, first_chunk, is_replica_failure  # noqa: E402
from app.errors import ClientError  # noqa: E402
from app.media.pipeline import PreparedItem  # noqa: E402
from app.media.preprocess import Patches, PatchSpec  # noqa: E402
from app.media.ref import MediaRef  # noqa: E402
from app.media.remote import RemoteMedia  # noqa: E402
from app.media.workers import SharedSlots  # noqa: E402

FAST = RetryPolicy(max_attempts=3, budget_s=10, backoff_s=0)


def chunks(n: int, die_after: int | None = None, error: BaseException | None = None):
    async def gen():
        for i in range(n):
            if die_after is not None and i == die_after:
                raise error or ActorDiedError()
            yield {"text": str(i)}
    return gen()


def test_replica_failures_are_told_from_client_errors():
    assert is_replica_failure(ActorDiedError())
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = ActorDiedError()
    assert is_replica_failure(wrapped)
    assert not is_replica_failure(ClientError("bad image"))
    assert not is_replica_failure(ValueError("x"))
    task_error = RayTaskError("prepare", "tb", ClientError("bad image"))
    assert not is_replica_failure(task_error)


def test_first_chunk_retries_until_a_token_then_hands_over_the_rest():
    starts = []

    def start():
        starts.append(1)
        return chunks(3, die_after=0) if len(starts) < 3 else chunks(3)

    async def main():
        first, rest, retries = await first_chunk(start, FAST)
        return first, [c async for c in rest], retries

    first, rest, retries = asyncio.run(main())
    assert first == {"text": "0"} and retries == 2 and len(starts) == 3
    assert rest == [{"text": "1"}, {"text": "2"}]


class _Hanging:
    """A stream whose first chunk never comes (a call queued behind a busy or restarting replica)."""

    def __init__(self):
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()

    def cancel(self):
        self.cancelled = True


def test_a_first_chunk_abandoned_by_its_caller_stops_the_stream_it_started():
    """The client left while the first chunk was awaited: the generation just started is cancelled."""
    started = []

    def start():
        started.append(_Hanging())
        return started[-1]

    async def main():
        task = asyncio.ensure_future(first_chunk(start, FAST))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(started) == 1 and started[0].cancelled


def test_retries_stop_at_max_attempts_with_a_503():
    with pytest.raises(ClientError) as e:
        asyncio.run(first_chunk(lambda: chunks(3, die_after=0), FAST))
    assert e.value.status == 503 and e.value.code == "replica_failed" and e.value.headers["retry-after"]


def test_client_errors_are_not_retried():
    starts = []

    def start():
        starts.append(1)
        return chunks(3, die_after=0, error=ClientError("overloaded", status=503))

    with pytest.raises(ClientError) as e:
        asyncio.run(first_chunk(start, FAST))
    assert e.value.message == "overloaded" and len(starts) == 1


def test_a_non_streamed_answer_is_redone_from_scratch_after_a_mid_way_failure():
    starts = []

    def start():
        starts.append(1)
        return chunks(4, die_after=2) if len(starts) == 1 else chunks(4)

    got, first_at, retries = asyncio.run(collect(start, FAST))
    assert [c["text"] for c in got] == ["0", "1", "2", "3"] and retries == 1 and first_at is not None


def item(tag: int) -> PreparedItem:
    return PreparedItem("image", Patches(np.full((4, 8), tag, np.uint8), (1, 2, 2)), key=str(tag))


class FakeResponse:
    def __init__(self, result):
        self.result, self.cancelled = result, False

    async def _to_object_ref(self):
        async def resolve():
            await asyncio.sleep(0)
            if isinstance(self.result, BaseException):
                raise self.result
            return self.result
        return asyncio.ensure_future(resolve())

    def cancel(self):
        self.cancelled = True


class FakePreprocessor:
    """`.prepare.remote(ref, key)`; the first `deaths` calls fail as if the replica was killed."""

    def __init__(self, deaths: int = 0, bad: str | None = None):
        self.deaths, self.bad, self.calls, self.responses = deaths, bad, [], []
        self.prepare = self

    def remote(self, ref: MediaRef, key):
        self.calls.append((ref.param, key))
        if len(self.calls) <= self.deaths:
            result = ActorDiedError()
        elif ref.param == self.bad:
            result = RayTaskError("prepare", "tb", ClientError("not an image", param=ref.param))
        else:
            result = item(int(ref.param))
        self.responses.append(FakeResponse(result))
        return self.responses[-1]


def test_an_item_whose_preprocessor_died_is_asked_for_again():
    retried = []
    pre = FakePreprocessor(deaths=2)
    media = RemoteMedia(pre, PatchSpec(), FAST, on_retry=retried.append)
    items = asyncio.run(media.prepare_all([MediaRef("image", "data:,x", "7")]))
    assert [it.key for it in items] == ["7"] and retried == [2] and len(pre.calls) == 3
    assert items[0].encoder_ref is not None  # the encoder reads the item by reference


def test_one_request_shares_a_key_and_a_bad_item_is_its_client_error():
    pre = FakePreprocessor(bad="2")
    media = RemoteMedia(pre, PatchSpec(), FAST)
    with pytest.raises(RayTaskError) as e:
        asyncio.run(media.prepare_all([MediaRef("image", "data:,x", str(i)) for i in range(4)]))
    assert isinstance(e.value.cause, ClientError) and e.value.cause.param == "2"
    assert len(pre.calls) == 4 and len({key for _, key in pre.calls}) == 1  # no retry of a client error
    ok = asyncio.run(media.prepare_all([MediaRef("image", "data:,x", "5")]))
    assert ok[0].key == "5" and pre.calls[-1][1] != pre.calls[0][1]  # a new request, a new key


def test_shared_slots_hold_all_but_one_worker_per_request_and_are_dropped_after():
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(3)
    slots = SharedSlots(pool)

    async def main():
        a1, a2, b = slots.acquire("A"), slots.acquire("A"), slots.acquire("B")
        assert a1 is a2 and a1 is not b and slots.acquire(None) is None
        await a1.acquire()
        await a1.acquire()
        assert a1.locked() and not b.locked()  # A holds 2 of 3 workers; B still gets one
        for _ in range(2):
            slots.release("A")
        slots.release("B")
        return len(slots)

    try:
        assert asyncio.run(main()) == 0
    finally:
        pool.shutdown()


def test_a_cancelled_collect_cancels_its_stream_on_the_replica():
    """A non-streamed answer whose client left (the handler cancelled) stops its generation: the Ray
    Serve stream is cancelled, as first_chunk already did before the first chunk."""
    class Stream:
        def __init__(self):
            self.cancelled = False

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.sleep(0.01)
            return {"finish_reason": None, "text": "x"}

        def cancel(self):
            self.cancelled = True

    async def main():
        stream = Stream()
        task = asyncio.ensure_future(collect(lambda: stream, FAST))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return stream.cancelled

    assert asyncio.run(main())


@pytest.mark.parametrize("call", ["first_chunk", "collect"])
def test_a_retry_waits_for_its_first_chunk_no_longer_than_what_is_left_of_the_budget(call):
    """`budget_s` is the request's: once spent, a retried attempt still waiting is cancelled and the
    request answered replica_failed (it used to wait with no bound while the replica was replaced)."""
    import time

    policy = RetryPolicy(max_attempts=5, budget_s=1.0, backoff_s=0)
    died = ActorDiedError()  # made here: its first construction can take longer than the budget
    started = []

    def start():
        started.append(chunks(1, die_after=0, error=died) if not started else _Hanging())
        return started[-1]

    async def main():
        t0 = time.monotonic()
        with pytest.raises(ClientError) as got:
            await (first_chunk(start, policy) if call == "first_chunk" else collect(start, policy))
        return got.value, time.monotonic() - t0

    err, took = asyncio.run(main())
    assert len(started) == 2 and started[1].cancelled
    assert err.code == "replica_failed" and err.status == 503 and 0.9 < took < 4


def test_a_first_attempt_slower_than_the_budget_is_not_cut():
    """The bound is for retries only: a first answer that takes longer than `budget_s` (a long queue
    under load) is waited for."""

    async def slow():
        await asyncio.sleep(0.3)
        yield {"text": "late", "finish_reason": "stop"}

    policy = RetryPolicy(max_attempts=3, budget_s=0.1, backoff_s=0)
    first, _, retries = asyncio.run(first_chunk(slow, policy))
    assert first["text"] == "late" and retries == 0
    got, _, retries = asyncio.run(collect(slow, policy))
    assert [c["text"] for c in got] == ["late"] and retries == 0
