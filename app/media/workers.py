"""Fair use of the media worker pool: one request's items cannot starve another request's.

Decoding runs in a small thread pool (a few workers per Router replica). Two guards:
- a request holds at most `workers - 1` workers at once, so a request with many slow items (16
  long videos, say) leaves a worker free and other requests' items keep flowing;
- an item is answered by its deadline (`decode_timeout_s`, counted from when a worker picks it up,
  plus a grace): the video decoder checks the same deadline in its loops and stops, and the bounded
  header checks keep an image's single uninterruptible decode short. A waiting request never hangs
  on a worker that is stuck.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import Executor
from contextlib import nullcontext
from typing import Any

from ..errors import ClientError

GRACE_S = 2.0


def pool_size(executor: Executor | None) -> int:
    """Workers of a ThreadPoolExecutor (asyncio's default pool when None)."""
    n = getattr(executor, "_max_workers", None)
    return n if isinstance(n, int) and n > 0 else min(32, (os.cpu_count() or 1) + 4)


def request_slots(executor: Executor | None) -> asyncio.Semaphore:
    """Workers one request may hold at once: all but one."""
    return asyncio.Semaphore(max(1, pool_size(executor) - 1))


async def run_item(executor: Executor | None, slots: asyncio.Semaphore | None, timeout_s: float, param: str,
                   fn: Callable[..., Any], *args, release: Callable[[], None] | None = None) -> Any:
    """`fn(*args)` in the pool. `release()` is called once the job no longer holds its arguments: when it
    ends (even after its caller stopped waiting for it), or on the way out if it never reached the pool."""
    loop = asyncio.get_running_loop()
    handed = False
    try:
        async with slots if slots is not None else nullcontext():
            started = loop.create_future()

            def job():
                loop.call_soon_threadsafe(lambda: started.done() or started.set_result(None))
                return fn(*args)

            fut = loop.run_in_executor(executor, job)
            handed = True
            if release is not None:
                fut.add_done_callback(lambda _: release())
            # read the outcome even when nobody awaits it any more (a sibling item failed and this one was
            # cancelled, or its deadline passed): otherwise asyncio logs "exception was never retrieved"
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            try:
                await asyncio.wait({fut, started}, return_when=asyncio.FIRST_COMPLETED)  # queued: no clock yet
                return await asyncio.wait_for(asyncio.shield(fut), timeout_s + GRACE_S)
            except TimeoutError:
                raise ClientError(f"media item took longer than {timeout_s:g} s to decode", param=param,
                                  code="media_decode_timeout") from None
            finally:
                started.cancel()
    finally:
        if release is not None and not handed:
            release()


class SharedSlots:
    """`request_slots` for a process that sees a request's items as separate calls (a
    MediaPreprocessor replica gets one call per item): calls that carry the same request key share
    one semaphore, dropped when its last call ends."""

    def __init__(self, executor: Executor | None):
        self.executor, self._held = executor, {}  # key -> [semaphore, calls using it]

    def acquire(self, key: str | None) -> asyncio.Semaphore | None:
        if key is None:
            return None
        entry = self._held.setdefault(key, [request_slots(self.executor), 0])
        entry[1] += 1
        return entry[0]

    def release(self, key: str | None) -> None:
        entry = self._held.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._held[key]

    def __len__(self) -> int:
        return len(self._held)


async def all_or_first_failure(coros: list) -> list:
    """Run a request's items together: all results in order, or the first failure. A failure (or the
    caller's cancellation) cancels the other items, so a refused request stops taking workers."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        if tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
